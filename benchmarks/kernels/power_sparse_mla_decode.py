"""SM clock and board power while the FP8 sparse-MLA decode kernel runs back to back (GPU).

Replays a CUDA graph of 20 decode calls (the benchmark's inputs: 16 requests x 128K tokens,
random top-k 2048) for ``--seconds`` per build variant, and the bf16 8192^3 matmul that
``measure_peaks`` times, while ``nvidia-smi`` samples the SM clock, the power draw and the
active clock-event (throttle) reasons every 100 ms. Prints the medians beside each one's time per
call: whether the kernel runs at the clock the matmul peak was measured at, and whether it is
power-capped (reason bit 0x4: SW power cap)."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

from benchmarks.kernels.bench_sparse_mla_decode import make_inputs
from vllm.kernels import sparse_mla_cuda
from vllm.kernels.sparse_mla_decode import sparse_mla_decode

FIELDS = "clocks.sm,power.draw,clocks_event_reasons.active"


def sample(fn, seconds: float) -> tuple[float, float, float, str]:
    """Runs fn() back to back for ``seconds``; (ms per fn call, median SM MHz, median W, the
    reasons seen)."""
    fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", "100"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(0.3)
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / calls
    smi.terminate()
    out, _ = smi.communicate()
    rows = [r.split(", ") for r in out.strip().splitlines() if r.count(",") == 2]
    rows = rows[3:-1] or rows  # (samples from inside the run)
    mhz = statistics.median(float(r[0]) for r in rows)
    watts = statistics.median(float(r[1]) for r in rows)
    reasons = sorted({r[2] for r in rows})
    return ms, mhz, watts, "/".join(reasons)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("variants", nargs="*", default=[""], help="build knobs 'NAME=V,...' per variant")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args()
    lim = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,power.limit,clocks.max.sm", "--format=csv,noheader"],
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    print(f"# {lim} (name, power limit, max SM clock)")
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ms, mhz, w, why = sample(lambda: torch.matmul(a, b), args.seconds)
    print(f"bf16 matmul {m}^3: {ms:.3f} ms/call ({2 * m**3 / ms / 1e9:.0f} TFLOP/s), "
          f"SM {mhz:.0f} MHz, {w:.0f} W, reasons {why}")  # fmt: skip
    a = b = None  # (free them)
    layout, cache, slots, q = make_inputs(args.tokens, "fp8_ds_mla")
    for spec in args.variants:
        sparse_mla_cuda.DEFINES = sparse_mla_cuda.parse_defines(spec)
        run = lambda: sparse_mla_decode(q, cache, slots, layout, 1 / 16, kernel="cuda")  # noqa: E731
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                run()
        ms, mhz, w, why = sample(graph.replay, args.seconds)
        print(f"decode T={args.tokens} [{spec}]: {ms / 20:.4f} ms/call, SM {mhz:.0f} MHz, "
              f"{w:.0f} W, reasons {why}")  # fmt: skip
        del graph
    sparse_mla_cuda.DEFINES = {}


if __name__ == "__main__":
    main()
