"""Shared measurement helpers for the kernel benchmarks (run on a GPU).

Every benchmark prints one row per shape: median time, TFLOP/s, TB/s, the fraction of the
roofline ``max(flops / peak_flops, bytes / peak_bw)`` with the peaks measured in the same process
(device-to-device copy; bf16 matmul; fp8 ``torch._scaled_mm``), and the speed-up over the torch
reference. ``--json PATH`` appends the rows (with the peaks) as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

import torch


@dataclass
class Peaks:
    copy_tbps: float  # device-to-device copy, bytes read + written
    bf16_tflops: float
    fp8_tflops: float

    def flops(self, kind: str) -> float:
        return {"bf16": self.bf16_tflops, "fp8": self.fp8_tflops}[kind] * 1e12


def time_ms(fn, rep_ms: int = 200, warmup_ms: int = 25) -> float:
    """Median wall time of ``fn`` in ms (CUDA events via triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def time_ms_graph(fn, launches: int = 20, rep_ms: int = 200) -> float:
    """GPU time per call of ``fn``: ``launches`` calls captured in one CUDA graph, the replay
    timed like :func:`time_ms`, divided by ``launches``. For kernels of a few tens of µs, whose
    eager time is the host's launch time (a Triton launch from Python takes ~10-20 µs), not the
    GPU's; the engine's decode steps run as graphs too. Kernel nodes still pay their
    back-to-back launch on the GPU, so this is an upper bound on the kernel time."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    ms = time_ms(graph.replay, rep_ms=rep_ms) / launches
    del graph
    return ms


_PEAKS: Peaks | None = None


def measure_peaks() -> Peaks:
    """The ceilings, measured once per process on random data (never zeros)."""
    global _PEAKS
    if _PEAKS is not None:
        return _PEAKS
    n = 1 << 28  # 1 GiB of fp32 per buffer
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    copy = 2 * n * 4 / (ms * 1e-3) / 1e12
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: torch.matmul(a, b))
    bf16 = 2 * m**3 / (ms * 1e-3) / 1e12
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn).t()  # column-major second operand
    one = torch.ones((), device="cuda")
    ms = time_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
    fp8 = 2 * m**3 / (ms * 1e-3) / 1e12
    _PEAKS = Peaks(copy, bf16, fp8)
    return _PEAKS


def row(
    op: str,
    shape: str,
    ms: float,
    flops: float,
    nbytes: float,
    peak_kind: str,
    ref_ms: float | None = None,
    note: str = "",
) -> dict:
    p = measure_peaks()
    floor_s = max(flops / p.flops(peak_kind), nbytes / (p.copy_tbps * 1e12))
    return dict(
        op=op,
        shape=shape,
        ms=ms,
        tflops=flops / (ms * 1e-3) / 1e12,
        tbps=nbytes / (ms * 1e-3) / 1e12,
        roofline=floor_s / (ms * 1e-3),
        bound="flops" if flops / p.flops(peak_kind) >= nbytes / (p.copy_tbps * 1e12) else "bytes",
        speedup=(ref_ms / ms) if ref_ms else math.nan,
        ref_ms=ref_ms,
        note=note,
    )


def print_rows(rows: list[dict]) -> None:
    p = measure_peaks()
    print(
        f"# peaks: copy {p.copy_tbps:.2f} TB/s, bf16 {p.bf16_tflops:.0f} TFLOP/s, "
        f"fp8 {p.fp8_tflops:.0f} TFLOP/s"
    )
    hdr = f"{'op':<22}{'shape':<34}{'ms':>9}{'TFLOP/s':>9}{'TB/s':>7}{'roof':>7}{'bound':>7}{'xref':>8}"
    print(hdr)
    for r in rows:
        print(
            f"{r['op']:<22}{r['shape']:<34}{r['ms']:>9.3f}{r['tflops']:>9.1f}{r['tbps']:>7.2f}"
            f"{r['roofline']:>7.1%}{r['bound']:>7}{r['speedup']:>8.1f}  {r['note']}"
        )
    sys.stdout.flush()


def dump_json(rows: list[dict], path: str | None) -> None:
    if not path:
        return
    peaks = asdict(measure_peaks())
    with open(path, "a") as f:
        for r in rows:
            f.write(
                json.dumps({**r, "peaks": peaks, "device": torch.cuda.get_device_name()}) + "\n"
            )


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--json", default=None, help="append result rows as JSON lines to this file")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    ap.add_argument(
        "--kernels", default="triton,ws,cuda",
        help="sparse-MLA implementations to time, comma-separated: triton (any GPU), ws (the "
        "Gluon kernel, bf16 rows, sm_90), cuda (the CUDA C++ kernel of vllm._C, fp8_ds_mla rows, "
        "sm_90); the op picks ws or cuda on an H200",
    )  # fmt: skip
    return ap


def ws_available() -> bool:
    """The warp-specialised Gluon sparse-MLA kernel runs here (an sm_90 GPU)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def scaled_ref_ms(ref_fn, sub: int, total: int, rep_ms: int = 100) -> float:
    """Time the torch reference on ``sub`` of ``total`` rows and scale linearly (the references
    are chunked loops, linear in rows; running them whole would take minutes)."""
    return time_ms(ref_fn, rep_ms=rep_ms, warmup_ms=10) * total / sub
