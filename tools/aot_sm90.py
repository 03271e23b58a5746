"""Compile the warp-specialised sparse-MLA kernel for sm_90a without a GPU (CPU machine).

Prints what ``ptxas`` reports (registers, spills), the shared memory and the partitions'
``setmaxnreg`` counts, and optionally a histogram of SASS opcodes, so that changes to the Gluon
kernel can be checked before they take device time. The build is the one the launcher launches
(:func:`vllm.kernels.sparse_mla_ws.launch_config`: bf16 rows, bf16 queries and output), with
the runtime's divisibility hints (without them the allocation differs from the GPU's);
``--ids-from-global`` / ``--sync-query`` build the launcher's fallbacks (a top-k slice longer
than the shared-memory id copy; a query that cp.async cannot copy).

    python tools/aot_sm90.py [--ids-from-global] [--sync-query] [--sass-hist]
        [--dump DIR] [--json]

Run it in a process without TRITON_INTERPRET=1 (the kernel tests' CPU runs set it).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from vllm.kernels import sparse_mla_ws as ws

SMEM_LIMIT = 232448  # 227 KB of dynamic shared memory per block on sm_90


def _bin(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_config(q_async: bool = True, idx_smem: bool = True):
    """triton.compile, for sm_90a, of the kernel :func:`sparse_mla_ws` launches (bf16 queries,
    rows and output)."""
    kernel, meta = ws.launch_config(q_async=q_async, idx_smem=idx_smem)
    meta = dict(meta)
    opts = dict(num_warps=meta.pop("num_warps"), maxnreg=meta.pop("maxnreg"))
    names = list(kernel.arg_names)
    ints = ("num_heads", "topk", "k_per_split", "stride_qt", "stride_qh", "stride_it", "row_stride",
            "stride_os", "stride_ot", "stride_oh", "stride_ls", "stride_lt")  # fmt: skip
    sig = dict(q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i32", out_ptr="*bf16", lse_ptr="*fp32",
               scale_log2="fp32", **dict.fromkeys(ints, "i32"),
               **dict.fromkeys(meta, "constexpr"))  # fmt: skip
    sig = {n: sig[n] for n in names}
    consts = {(names.index(k),): v for k, v in meta.items()}
    aligned = ("q_ptr", "kv_ptr", "idx_ptr", "out_ptr", "lse_ptr", "stride_qt", "stride_qh",
               "stride_it", "row_stride", "stride_os", "stride_ot", "stride_oh")  # fmt: skip
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = GluonASTSource(kernel, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def ptxas(compiled, sass: bool = True) -> dict:
    """``ptxas -v`` (sm_90a) of a compiled kernel's PTX: registers and spill bytes, the shared
    memory, and (``sass``) the disassembly."""
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        r = subprocess.run([_bin("ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin],
                           capture_output=True, text=True, check=True)  # fmt: skip
        text = ""
        if sass:
            text = subprocess.run(
                [_bin("nvdisasm"), "-c", cubin], capture_output=True, text=True
            ).stdout
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, r.stderr)) else 0  # noqa: E731
    return dict(registers=num(r"Used (\d+) registers"), spill_stores=num(r"(\d+) bytes spill stores"),
                spill_loads=num(r"(\d+) bytes spill loads"), smem=compiled.metadata.shared,
                sass=text)  # fmt: skip


def report(compiled) -> dict:
    """:func:`ptxas` plus the spills per register region and the setmaxnreg counts in the PTX."""
    rep = ptxas(compiled)
    sass = rep["sass"]
    return dict(
        region_spills=region_spills(sass),
        registers=rep["registers"],
        spill_stores=rep["spill_stores"],
        spill_loads=rep["spill_loads"],
        smem=compiled.metadata.shared,
        setmaxnreg=sorted(
            {
                int(x)
                for x in re.findall(
                    r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", compiled.asm["ptx"]
                )
            }
        ),
        sass=sass,
    )


def region_spills(sass: str) -> list[tuple[str, int]]:
    """Local-memory instructions (STL/LDL: spills) per stretch of SASS between two register
    reallocations (USETMAXREG), each labelled with the reallocation that opens it — which
    partition spills, since every partition's code follows its own ``setmaxnreg``."""
    out, label, n = [], "entry", 0
    for line in sass.splitlines():
        m = re.search(r"USETMAXREG\.(\w+)\.CTAPOOL\s+(?:UP\d+,\s*)?(0x[0-9a-f]+)", line)
        if m:
            out.append((label, n))
            label, n = f"{m.group(1).lower()} {int(m.group(2), 16)}", 0
        elif re.search(r"\b(STL|LDL)(\.|\s)", line):
            n += 1
    out.append((label, n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ids-from-global", action="store_true",
                    help="the top-k ids read from global memory (slices over IDX_CAP)")  # fmt: skip
    ap.add_argument("--sync-query", action="store_true",
                    help="the query loaded before the fork (not copyable by cp.async)")  # fmt: skip
    ap.add_argument("--sass-hist", action="store_true")
    ap.add_argument("--dump", default=None, help="write the ptx and sass there")
    ap.add_argument(
        "--json", action="store_true", help="print the report (no SASS) as one JSON line"
    )
    a = ap.parse_args()
    flags = dict(q_async=not a.sync_query, idx_smem=not a.ids_from_global)
    k = compile_config(**flags)
    rep = report(k)
    if a.json:
        _, meta = ws.launch_config(**flags)
        consts = dict(PRODUCER_WARPS=ws.PRODUCER_WARPS.value, PRODUCER_REGS=ws.PRODUCER_REGS,
                      CONSUMER_REGS=ws.CONSUMER_REGS.value)  # fmt: skip
        print(json.dumps({**{k: v for k, v in rep.items() if k != "sass"}, "limit": SMEM_LIMIT,
                          "meta": {**meta, **consts}}))  # fmt: skip
        return
    print(f"{flags}: registers {rep['registers']}, spills {rep['spill_stores']} B "
          f"stored / {rep['spill_loads']} B loaded, smem {rep['smem']} B (limit {SMEM_LIMIT}), "
          f"setmaxnreg {rep['setmaxnreg']}")  # fmt: skip
    print("  spill instructions per register region:",
          ", ".join(f"[{lab}] {n}" for lab, n in rep["region_spills"] if n))  # fmt: skip
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        with open(os.path.join(a.dump, "k.ptx"), "w") as f:
            f.write(k.asm["ptx"])
        with open(os.path.join(a.dump, "k.sass"), "w") as f:
            f.write(rep["sass"])
    if a.sass_hist:
        ops = collections.Counter()
        for line in rep["sass"].splitlines():
            m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
            if m:
                ops[m.group(1)] += 1
        for op, n in ops.most_common(40):
            print(f"  {op:28s} {n}")


if __name__ == "__main__":
    main()
