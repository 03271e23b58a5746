"""Where a consumer warpgroup of the CUDA FP8 sparse-MLA decode kernel spends its cycles (GPU).

Builds the kernel with DIAG_TRACE=1 (plus the build knobs given as 'NAME=V,...' arguments, one
variant each), runs the benchmark's inputs (16 requests x 128K tokens, random top-k 2048) at
``--tokens`` queries with one token per CTA, and prints per-step medians of the clock64 stamps
that thread 0 of each consumer warpgroup wrote (sparse_mla_fp8_seesaw.cuh): per own block,
wait for the stage, QK, the wait for the other warpgroup's P^T (with the pempty wait and the
score scaling before it), PV of the other's block, the softmax, PV of its own block; per piece,
the query prologue and the epilogue. Cycles are SM cycles; the kernel's CUDA-event time is
printed beside them."""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks.kernels.bench_sparse_mla_decode import make_inputs
from vllm.kernels import sparse_mla_cuda
from vllm.kernels.sparse_mla_decode import sparse_mla_decode

STEPS = ["wait stage", "QK", "to P^T(other)", "PV other", "softmax", "PV own"]


def med(x: torch.Tensor) -> float:
    return float(x.float().median()) if x.numel() else float("nan")


def trace(t: int, spec: str) -> None:
    sparse_mla_cuda.DEFINES = {**sparse_mla_cuda.parse_defines(spec), "DIAG_TRACE": 1}
    layout, cache, slots, q = make_inputs(t, "fp8_ds_mla")
    scale = 1 / math.sqrt(256)
    run = lambda: sparse_mla_decode(q, cache, slots, layout, scale, kernel="cuda")  # noqa: E731
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    run()
    ev[1].record()
    torch.cuda.synchronize()
    ms = ev[0].elapsed_time(ev[1])
    ctas = sparse_mla_cuda.default_ctas(t, 32, sparse_mla_cuda._num_sms(0))
    tr = sparse_mla_cuda.last_trace.view(torch.int64).flatten()
    tr = tr[: ctas * 2 * 20 * 8].view(ctas, 2, 20, 8).cpu()
    it = tr[:, :, :18]  # [cta, wg, iteration, stamp]
    piece = tr[:, :, 19]
    total = piece[:, :, 2] - piece[:, :, 0]
    print(f"== [{spec}] T={t}: {ctas} CTAs, kernel {ms * 1e3:.1f} us (events, one call); "
          f"per CTA median {med(total):.0f} cycles")  # fmt: skip
    print(f"   prologue (query) {med(piece[:, :, 1] - piece[:, :, 0]):.0f}, "
          f"first stamp after it {med(it[:, :, 0, 0] - piece[:, :, 1]):.0f}")  # fmt: skip
    # steady state: iterations 2..13 of each warpgroup (own blocks 4..27 of 32)
    ss = it[:, :, 2:14]
    d = [ss[..., 1] - ss[..., 0], ss[..., 2] - ss[..., 1], ss[..., 3] - ss[..., 2],
         ss[..., 4] - ss[..., 3], ss[..., 5] - ss[..., 4], ss[..., 6] - ss[..., 5]]  # fmt: skip
    period = it[:, :, 3:15, 0] - it[:, :, 2:14, 0]
    cells = "  ".join(f"{n} {med(x):.0f}" for n, x in zip(STEPS, d, strict=True))
    print(f"   per own block (2 blocks of the CTA): {cells}  | period {med(period):.0f}")
    last = it.flatten(2).max(dim=2).values  # each warpgroup's last block stamp
    print(f"   epilogue (last block's stamp to the piece's end) {med(piece[:, :, 2] - last):.0f}")
    first = it[:, :, 0]
    print(f"   first block: wait stage {med(first[..., 1] - first[..., 0]):.0f}, "
          f"QK {med(first[..., 2] - first[..., 1]):.0f}")  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("variants", nargs="*", default=[""], help="build knobs 'NAME=V,...' per variant")
    p.add_argument("--tokens", type=int, default=1024)
    args = p.parse_args()
    for spec in args.variants:
        trace(args.tokens, spec)
    sparse_mla_cuda.DEFINES = {}


if __name__ == "__main__":
    main()
