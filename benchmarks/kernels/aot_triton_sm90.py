"""Compile the Triton top-k kernels for sm_90a without a GPU (CPU machine), the way the launcher
resolves them (:func:`vllm.kernels.topk.topk_launch_config`).

The Triton interpreter, which runs the kernels in CI, does not type-check them the way the
compiler does (a variable redefined with another type in one branch, for one); this build does,
and reports each kernel's registers, spills and shared memory from ``ptxas``.

    PYTHONPATH=. python benchmarks/kernels/aot_triton_sm90.py [--json] [CASE ...]

A CASE is ``T,S,K`` or ``T,S,K,key=value,...`` with :func:`indexer_topk`'s tuning knobs (ints,
floats, true/false), e.g. ``8192,32768,2048`` or ``300,5000,2048,sample_run=1,prefetch=true``.
Run it in a process without TRITON_INTERPRET=1 (the kernel tests' CPU runs set it).
"""

from __future__ import annotations

import argparse
import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.kernels.aot_sm90 import ptxas
from vllm.kernels import topk

# argument types of the four kernels (limits as int64, as the model and tests pass them)
SIGNATURES = {
    "pivot": (topk._pivot_kernel, dict(
        logits_ptr="*fp32", limit_ptr="*i64", out_ptr="*i32", pivot_ptr="*i32", tab_ptr="*i32",
        num_cols="i32", num_chunks="i32", stride_lt="i32", z="fp32")),
    "collect": (topk._collect_kernel, dict(
        logits_ptr="*fp32", limit_ptr="*i64", pivot_ptr="*i32", tab_ptr="*i32", count_ptr="*i32",
        list_ptr="*i64", num_rows="i32", num_cols="i32", num_chunks="i32", stride_lt="i32")),
    "select": (topk._select_kernel, dict(
        limit_ptr="*i64", pivot_ptr="*i32", count_ptr="*i32", list_ptr="*i64", out_ptr="*i32",
        num_cols="i32")),
    "fallback": (topk._fallback_kernel, dict(
        logits_ptr="*fp32", limit_ptr="*i64", count_ptr="*i32", out_ptr="*i32", num_cols="i32",
        stride_lt="i32")),
}  # fmt: skip


def compile_kernel(fn, types: dict, meta: dict):
    meta = dict(meta)
    opts = {k: meta.pop(k) for k in ("num_warps", "maxnreg") if k in meta}
    names = list(fn.arg_names)
    sig = {n: types.get(n, "constexpr") for n in names}
    consts = {(names.index(k),): v for k, v in meta.items()}
    ptrs = [n for n, ty in types.items() if ty.startswith("*")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=opts)  # fmt: skip


def _parse_case(text: str):
    t, s, k = (int(x) for x in text.split(",")[:3])
    tuning = {}
    for item in text.split(",")[3:]:
        key, val = item.split("=")
        low = val.lower()
        tuning[key] = low == "true" if low in ("true", "false") else (float(val) if "." in val else int(val))
    return t, s, k, tuning


def build_case(text: str) -> dict:
    t, s, k, tuning = _parse_case(text)
    cfg = topk.topk_launch_config(t, s, k, **tuning)
    reps = {name: ptxas(compile_kernel(fn, types, cfg[name]), sass=False)
            for name, (fn, types) in SIGNATURES.items()}  # fmt: skip
    return {name: {k: v for k, v in rep.items() if k != "sass"} for name, rep in reps.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", default=["8192,32768,2048", "64,1048576,2048"])
    ap.add_argument("--json", action="store_true", help="one JSON line: {case: {kernel: report}}")
    a = ap.parse_args()
    out = {c: build_case(c) for c in a.cases}
    if a.json:
        print(json.dumps(out))
        return
    for c, reps in out.items():
        for name, rep in reps.items():
            print(f"{c:40s} {name:9s} registers {rep['registers']:3d}  spills {rep['spill_stores']:4d} B"
                  f"  smem {rep['smem']} B")  # fmt: skip


if __name__ == "__main__":
    main()
