"""Compile the warp-specialised sparse-MLA kernel for sm_90a without a GPU (CPU machine).

Prints the registers, spills and shared memory that ``ptxas`` reports, and optionally a histogram
of SASS opcodes, so that changes to the Gluon kernel can be checked before they take device time.
The runtime's divisibility hints are passed (without them the allocation differs from the GPU's).

    python benchmarks/kernels/aot_sm90.py [--fp8] [--producer-warps 4] [--producer-regs 120]
        [--sass-hist] [--dump DIR]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from vllm.kernels import sparse_mla_ws as ws


def _bin(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_ws(fp8: bool, producer_warps: int, producer_regs: int, fp8_rows: int, maxnreg: int,
               dequant: int = 0, out_dtype: str = "bf16", schedule: str = "split",
               staged: bool = False):  # fmt: skip
    # q, kv, idx, out, lse pointers; scale; 3 ints; 10 strides
    sig = {
        "q_ptr": "*bf16", "kv_ptr": "*u8" if fp8 else "*bf16", "idx_ptr": "*i32",
        "out_ptr": f"*{out_dtype}", "lse_ptr": "*fp32", "scale_log2": "fp32", "num_heads": "i32",
        "topk": "i32", "k_per_split": "i32", "stride_qt": "i32", "stride_qh": "i32",
        "stride_it": "i32", "row_stride": "i32", "stride_os": "i32", "stride_ot": "i32",
        "stride_oh": "i32", "stride_ls": "i32", "stride_lt": "i32",
    }  # fmt: skip
    consts = dict(IS_FP8=fp8, ROW_BYTES=656 if fp8 else 1152, BLOCK_N=64, NUM_STAGES=2,
                  PRODUCER_WARPS=producer_warps, PRODUCER_REGS=producer_regs, FP8_ROWS=fp8_rows,
                  DEQUANT=dequant)
    fn = ws._sparse_mla_seesaw_kernel if schedule == "seesaw" else ws._sparse_mla_ws_kernel
    consts["CONSUMER_REGS"] = ws.consumer_regs(producer_warps, producer_regs)
    consts["FP8_STAGED"] = fp8 and staged
    names = list(fn.arg_names)
    for k, v in consts.items():
        sig[k] = "constexpr"
    sig = {n: sig[n] for n in names}
    consts_by_idx = {(names.index(k),): v for k, v in consts.items()}
    div = [["tt.divisibility", 16]]
    attrs = {(names.index(n),): div for n in ("q_ptr", "kv_ptr", "idx_ptr", "out_ptr", "lse_ptr",
                                              "stride_qt", "stride_qh", "stride_it", "row_stride", "stride_os",
                                              "stride_ot", "stride_oh")}  # fmt: skip
    src = GluonASTSource(fn, sig, consts_by_idx, attrs)
    opts = dict(num_warps=producer_warps, maxnreg=maxnreg)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--producer-warps", type=int, default=4)
    ap.add_argument("--producer-regs", type=int, default=None)
    ap.add_argument("--fp8-rows", type=int, default=16)
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--dequant", type=int, default=0)
    ap.add_argument("--schedule", default="split")
    ap.add_argument("--staged", action="store_true", help="FP8 rows staged through smem")
    ap.add_argument("--sass-hist", action="store_true")
    ap.add_argument("--dump", default=None, help="write ptx/sass there")
    a = ap.parse_args()
    pw = a.producer_warps
    regs = a.producer_regs or ws.default_producer_regs(a.fp8, pw)
    maxnreg = a.maxnreg or ws.launch_maxnreg(pw)
    k = compile_ws(a.fp8, pw, regs, a.fp8_rows, maxnreg, a.dequant, schedule=a.schedule,
                   staged=a.staged)
    ptx = k.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        open(p, "w").write(ptx)
        r = subprocess.run([_bin("ptxas"), "-arch=sm_90a", "-v", p, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)  # fmt: skip
        info = r.stderr
        sass = subprocess.run([_bin("nvdisasm"), "-c", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True).stdout  # fmt: skip
    print(f"fp8={a.fp8} dequant={a.dequant} producer_warps={pw} producer_regs={regs} maxnreg={maxnreg} "
          f"smem={k.metadata.shared} B")  # fmt: skip
    for line in info.splitlines():
        if "registers" in line or "spill" in line:
            print(" ", line.strip())
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        open(os.path.join(a.dump, "k.ptx"), "w").write(ptx)
        open(os.path.join(a.dump, "k.sass"), "w").write(sass)
    if a.sass_hist:
        ops = collections.Counter()
        for line in sass.splitlines():
            m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
            if m:
                ops[m.group(1)] += 1
        for op, n in ops.most_common(40):
            print(f"  {op:28s} {n}")


if __name__ == "__main__":
    main()
