"""Compile Triton kernels for sm_90a without a GPU (CPU machine) and report each one's registers,
spills and shared memory from ``ptxas``.

The Triton interpreter, which runs the kernels in CI, does not type-check them the way the
compiler does (a variable redefined with another type in one branch, for one); these builds do.

    PYTHONPATH=. python tools/aot_triton_sm90.py [--json] [CASE ...]
    PYTHONPATH=. python tools/aot_triton_sm90.py --from-log LOG [--per-kernel N]

A CASE is the top-k at ``T,S,K`` or ``T,S,K,key=value,...`` with :func:`indexer_topk`'s tuning
knobs (ints, floats, true/false), e.g. ``8192,32768,2048`` or
``300,5000,2048,sample_run=1,prefetch=true``, resolved as the launcher resolves it
(:func:`vllm.kernels.triton.topk.topk_launch_config`). ``--from-log`` compiles the launches the kernel
tests ran under the interpreter (``VLLM_TRITON_LAUNCH_LOG``, see ``tests/kernels/conftest.py``):
every kernel, up to N distinct configurations each, with the constexprs the launchers set from
the device (``GPU_CONSTS``) at their CUDA values. Run it without TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import importlib
import json

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tools.aot_sm90 import ptxas
from vllm.kernels.triton import topk

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


# constexprs the launchers set from the device or the interpreter, at their CUDA values
GPU_CONSTS = {"SOFT_FP8": False, "USE_LIBDEVICE": True, "RECIP_DIV": True, "DOT_DTYPE": tl.bfloat16}


def compile_kernel(fn, types: dict, meta: dict, div16=None):
    """triton.compile for sm_90a: ``types`` the run-time arguments' types, ``meta`` the
    constexprs and the launch options; ``div16`` the arguments known to be multiples of 16
    (default: the pointers)."""
    meta = dict(meta)
    opts = {k: meta.pop(k) for k in ("num_warps", "num_stages", "maxnreg", "num_ctas") if k in meta}
    names = list(fn.arg_names)
    sig = {n: types.get(n, "constexpr") for n in names}
    consts = {(names.index(k),): v for k, v in meta.items()}
    if div16 is None:
        div16 = [n for n, ty in types.items() if ty.startswith("*")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=opts)  # fmt: skip


def build_log(path: str, per_kernel: int = 3) -> dict:
    """{"module.kernel": [report or {"error": text}, ...]} for the distinct launches in the log."""
    seen, out = {}, {}
    for line in open(path):
        rec = json.loads(line)
        key = f"{rec['module']}.{rec['name']}"
        ident = json.dumps([rec["sig"], rec["consts"], rec["options"]], sort_keys=True)
        if ident in seen.setdefault(key, set()) or len(seen[key]) >= per_kernel:
            continue
        seen[key].add(ident)
        fn = getattr(importlib.import_module(rec["module"]), rec["name"])
        consts = {k: tl.dtype(v["tl_dtype"]) if isinstance(v, dict) else v
                  for k, v in rec["consts"].items()}  # fmt: skip
        consts.update({k: v for k, v in GPU_CONSTS.items() if k in consts})
        types = {k: v for k, v in rec["sig"].items() if v != "constexpr"}
        try:
            rep = ptxas(
                compile_kernel(fn, types, consts | rec["options"], rec["div16"]), sass=False
            )
            rep = {k: v for k, v in rep.items() if k != "sass"}
        except Exception as e:  # noqa: BLE001 - reported per kernel, the caller decides
            rep = {"error": f"{type(e).__name__}: {str(e)[-1500:]}"}
        out.setdefault(key, []).append(rep)
    return out


def _parse_case(text: str):
    t, s, k = (int(x) for x in text.split(",")[:3])
    tuning = {}
    for item in text.split(",")[3:]:
        key, val = item.split("=")
        low = val.lower()
        tuning[key] = (
            low == "true" if low in ("true", "false") else (float(val) if "." in val else int(val))
        )
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
    ap.add_argument("--from-log", default=None, help="a VLLM_TRITON_LAUNCH_LOG file")
    ap.add_argument("--per-kernel", type=int, default=3, help="with --from-log")
    a = ap.parse_args()
    if a.from_log:
        out = build_log(a.from_log, a.per_kernel)
        if a.json:
            print(json.dumps(out))
            return
        for key, reps in out.items():
            for rep in reps:
                print(f"{key:48s} {rep.get('error') or rep}")
        return
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
