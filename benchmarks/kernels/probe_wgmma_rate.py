"""How fast the H200's tensor cores run the wgmma shapes and issue patterns of the CUDA FP8
sparse-MLA decode kernel (vllm/kernels/cuda/sparse_mla_fp8_sm90.cu), measured on their own (GPU).

The decode kernel issues only m64n64k16 wgmmas with the A operand in registers (K or V^T
dequantised from e4m3 by the warpgroup itself), N = 64 heads. This probe times, one CTA per SM,
one, two or four warpgroups issuing such wgmmas back to back with the kernel's commit/wait pattern:
fed by fixed registers; fed by the QK's or the PV's dequantisation (cvt.rn.f16x2.e4m3x2, or the
same values built on the integer pipe, at several commit-group depths); with the dequantisation
beside wgmmas that do not read it (fixed registers, or A from shared memory); with the
dequantised values stored to shared memory for SS wgmmas; wider N; and the dequantisation alone.
So the kernel's main loop can be put against what its instruction shapes and operand feeding
reach. Each row prints FLOP per SM cycle (clock64 of the issuing warps; rows without wgmmas count
the FLOPs their operands would have fed) and its share of the tensor cores' 4096 dense f16 FLOP
per SM cycle, TFLOP/s from CUDA events beside a bf16 matmul timed the same way (20 back-to-back
8192^3 products: a burst like these rows, so at a similar clock, above the benchmarks' sustained
figure), the SM clock, and the cycles per commit group of 4 wgmmas of each warpgroup.

    python3 benchmarks/kernels/probe_wgmma_rate.py [--json OUT.jsonl] [--match 'drained,PV dequant']
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import tempfile

import torch

from vllm.kernels.sparse_mla_cuda import _driver, nvcc_path

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "probe_wgmma_rate.cu")
SMEM = 200 * 1024  # dynamic shared memory of each probe CTA
GROUPS = 1024  # commit groups of 4 wgmmas per warpgroup per launch

# (name, defines): MODE selects the issue pattern (probe_wgmma_rate.cu), NWG the warpgroups issuing
CASES = [
    ("RS n64, 4 accumulators, wait<1> (PV pattern, no dequant)", {"MODE": 0}),
    ("RS n64, 4 accumulators, wait<0> after each group", {"MODE": 1}),
    ("RS n64, 4 accumulators, no wait in the loop", {"MODE": 2}),
    ("RS n64, one accumulator, wait<1> (QK pattern, no dequant)", {"MODE": 3}),
    ("SS n64, 4 accumulators, wait<1>", {"MODE": 4}),
    ("RS n256, one accumulator, wait<1>", {"MODE": 6}),
    ("RS n64 + PV dequant (e4m3 -> f16 x sigma), wait<1>", {"MODE": 7}),
    ("RS n64 + QK dequant (e4m3 -> f16 x scale), one acc, wait<1>", {"MODE": 8}),
    ("RS n64 + PV dequant, drained every 4 steps (a PV call)", {"MODE": 7, "DRAIN": 4}),
    ("RS n64 + QK dequant, drained every 9 steps (a QK call)", {"MODE": 8, "DRAIN": 9}),
    (
        "RS n64 + PV dequant, drained every 4 steps, one warpgroup",
        {"MODE": 7, "DRAIN": 4, "NWG": 1},
    ),
    ("RS n64 + PV dequant on the integer pipe", {"MODE": 7, "DEQ": 1}),
    ("RS n64 + PV dequant, half of it on the integer pipe", {"MODE": 7, "DEQ": 2}),
    ("RS n64 + QK dequant on the integer pipe", {"MODE": 8, "DEQ": 1}),
    ("RS n64 + QK dequant, half of it on the integer pipe", {"MODE": 8, "DEQ": 2}),
    ("RS n64 + PV dequant, groups of 2 wgmmas, wait<3>", {"MODE": 7, "PG": 2, "PW": 3}),
    ("RS n64 + PV dequant, groups of 1 wgmma, wait<7>", {"MODE": 7, "PG": 1, "PW": 7}),
    ("RS n64 + QK dequant, groups of 2 wgmmas, wait<3>", {"MODE": 8, "PG": 2, "PW": 3}),
    ("RS n64 + QK dequant, groups of 1 wgmma, wait<7>", {"MODE": 8, "PG": 1, "PW": 7}),
    (
        "RS n64 + PV dequant, groups of 2, wait<3>, one warpgroup",
        {"MODE": 7, "PG": 2, "PW": 3, "NWG": 1},
    ),
    (
        "RS n64 + QK dequant, groups of 2, wait<3>, one warpgroup",
        {"MODE": 8, "PG": 2, "PW": 3, "NWG": 1},
    ),
    ("RS n64 fixed A + PV dequant beside it (XOR-sunk)", {"MODE": 7, "FEED": 1}),
    ("SS n64 + PV dequant beside it (XOR-sunk)", {"MODE": 7, "FEED": 2}),
    ("SS n64 + PV dequant stored to shared memory", {"MODE": 7, "FEED": 3}),
    ("RS n64 fixed A + QK dequant beside it (XOR-sunk)", {"MODE": 8, "FEED": 1}),
    ("SS n64 + QK dequant beside it (XOR-sunk)", {"MODE": 8, "FEED": 2}),
    ("SS n64 + QK dequant stored to shared memory", {"MODE": 8, "FEED": 3}),
    ("SS n64 + QK dequant stored, one warpgroup", {"MODE": 8, "FEED": 3, "NWG": 1}),
    ("RS n64 fixed A + QK dequant beside it, one warpgroup", {"MODE": 8, "FEED": 1, "NWG": 1}),
    ("PV dequant alone (cvt), no wgmma", {"MODE": 7, "NOMMA": 1}),
    ("PV dequant alone (integer), no wgmma", {"MODE": 7, "DEQ": 1, "NOMMA": 1}),
    ("PV dequant alone (half each), no wgmma", {"MODE": 7, "DEQ": 2, "NOMMA": 1}),
    ("QK dequant alone (cvt), no wgmma", {"MODE": 8, "NOMMA": 1}),
    ("QK dequant alone (integer), no wgmma", {"MODE": 8, "DEQ": 1, "NOMMA": 1}),
    ("RS n64, 4 accumulators, wait<1>, one warpgroup", {"MODE": 0, "NWG": 1}),
    ("RS n64 + PV dequant, one warpgroup", {"MODE": 7, "NWG": 1}),
    ("RS n64 + QK dequant, one warpgroup", {"MODE": 8, "NWG": 1}),
    # what a kernel of four consumer warpgroups (128 value columns each) would run: its PV
    # (2 value tiles a step, committed and waited per step) and QK, beside the two-warpgroup rows
    ("RS n64 + PV dequant, 2 tiles (128 columns)", {"MODE": 7, "NT": 2, "PG": 2}),
    ("RS n64 + PV dequant, 2 tiles, four warpgroups", {"MODE": 7, "NT": 2, "PG": 2, "NWG": 4}),
    ("RS n64 + QK dequant, four warpgroups", {"MODE": 8, "NWG": 4}),
    (
        "RS n64 + PV dequant, 2 tiles, drained every 4 steps, four warpgroups",
        {"MODE": 7, "NT": 2, "PG": 2, "NWG": 4, "DRAIN": 4},
    ),
    (
        "RS n64 + QK dequant, drained every 9 steps, four warpgroups",
        {"MODE": 8, "NWG": 4, "DRAIN": 9},
    ),
    # the whole block loop (QK call, minimal softmax, PV calls; the PV accumulators live
    # throughout): the decode kernel's two warpgroups against four in the 112 registers a
    # 640-thread CTA leaves them, where ptxas serialises the wgmmas and spills (EXPECT_SERIALIZED)
    ("block loop (mode 9), two warpgroups of 256 value columns", {"MODE": 9}),
    ("block loop (mode 9), four warpgroups of 128 columns, 112 registers", {"MODE": 9, "NWG": 4}),
    (
        "block loop (mode 9), four warpgroups, 112 registers, row sums in 2 registers",
        {"MODE": 9, "NWG": 4, "L16": 0},
    ),
]
# Rows whose build ptxas cannot keep pipelined without spills (the test holds them to that, so a
# toolchain that fits them shows up): a four-consumer block loop needs ~160 registers a thread
# (CONS_REGS 160 with L16 0 is the first clean build), 4 x 128 x 160 = 80K of the SM's 64K.
EXPECT_SERIALIZED = {
    "block loop (mode 9), four warpgroups of 128 columns, 112 registers",
    "block loop (mode 9), four warpgroups, 112 registers, row sums in 2 registers",
}
MODE9_WGMMAS = 68  # wgmmas a warpgroup an iteration of mode 9 (36 QK + 32 PV)
N_OF_MODE = {6: 256}


def build(defines: dict[str, int], tmp: str) -> tuple[bytes, str]:
    """The cubin of one row's build for sm_90a and ptxas's report (-v) on it."""
    out = os.path.join(tmp, "_".join(f"{k}{v}" for k, v in defines.items()) + ".cubin")
    flags = [f"-D{k}={v}" for k, v in defines.items()]
    cmd = [nvcc_path(), "-cubin", "-arch=sm_90a", "-O3", "-std=c++17", "-Xptxas", "-v", *flags]
    res = subprocess.run([*cmd, "-o", out, SRC], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    return open(out, "rb").read(), res.stderr


def matmul_peak() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(20):
        a @ b
    ev[1].record()
    torch.cuda.synchronize()
    return 20 * 2 * 8192**3 / (ev[0].elapsed_time(ev[1]) * 1e-3) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--match", default="", help="run only the rows whose name has one of these")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    drv = _driver()
    peak = matmul_peak()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        keys = [k for k in args.match.split(",") if k]
        for name, d in CASES:
            if keys and not any(k in name for k in keys):
                continue
            d = {"NWG": 2, **d}
            fn = drv.load(build(d, tmp)[0], "probe", SMEM)
            cyc = torch.zeros(sms, 4, dtype=torch.int64, device="cuda")
            threads = 128 * (max(d["NWG"], 2) + 1)
            a_ptr = ctypes.c_void_p(cyc.data_ptr())
            a_groups = ctypes.c_int(GROUPS)
            stream = torch.cuda.current_stream().cuda_stream
            for _ in range(2):
                drv.launch(fn, (sms, 1), stream, [a_ptr, a_groups], threads, SMEM)
            torch.cuda.synchronize()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            reps = 5
            ev[0].record()
            for _ in range(reps):
                drv.launch(fn, (sms, 1), stream, [a_ptr, a_groups], threads, SMEM)
            ev[1].record()
            torch.cuda.synchronize()
            ms = ev[0].elapsed_time(ev[1]) / reps
            n = N_OF_MODE.get(d["MODE"], 64)
            per_group = d.get("NT", 4) if d["MODE"] == 7 else 4  # wgmmas a group
            units = GROUPS  # the last column: cycles per group (mode 9: per iteration)
            if d["MODE"] == 9:
                per_group, units = MODE9_WGMMAS, GROUPS // 16
            flop_sm = d["NWG"] * units * per_group * 2 * 64 * n * 16  # per SM per launch
            cycles = float(cyc[:, : d["NWG"]].float().mean())
            fpc = flop_sm / cycles
            tflops = flop_sm * sms / (ms * 1e-3) / 1e12
            clk = cycles / (ms * 1e-3) / 1e9
            rows.append({"case": name, **d, "flop_per_sm_cycle": fpc, "of_4096": fpc / 4096,
                         "tflops": tflops, "bf16_matmul_peak": peak, "of_peak": tflops / peak,
                         "ghz": clk, "ms": ms, "cycles_per_group": cycles / units})  # fmt: skip
    print(f"bf16 matmul peak (8192^3, same run): {peak:.0f} TFLOP/s; {sms} SMs")
    print(
        f"{'case':62s} {'FLOP/clk/SM':>11s} {'of 4096':>8s} {'TFLOP/s':>8s} {'of peak':>8s} {'GHz':>5s}"
    )
    for r in rows:
        print(f"{r['case']:62s} {r['flop_per_sm_cycle']:11.0f} {r['of_4096']:8.1%} "
              f"{r['tflops']:8.0f} {r['of_peak']:8.1%} {r['ghz']:5.2f} {r['cycles_per_group']:7.0f}")  # fmt: skip
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
