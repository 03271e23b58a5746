"""Per-phase timeline of the Gluon sparse-MLA kernel (seesaw schedule, bf16 rows) on an H200:
where a token's time goes beyond its steady-state pairs of blocks.

The kernel, built with ``trace=...``, stamps the GPU's nanosecond timer at fixed points of
every program (``sparse_mla_ws._stamp``): start, query loaded, the producer's first block issued
and its last, each consumer warpgroup's first block landed, warpgroup 0's first pair done, its
last pair done, and each warpgroup's epilogue done; plus the SM. This prints the medians of the
phases and the gap between consecutive programs on an SM. The stamps cost a few registers and
stores, so the traced run is a little slower than the plain one (both are printed).

    PYTHONPATH=. python benchmarks/kernels/trace_sparse_mla_ws.py [--t 8192] [--s 32768] [--topk 2048]

``--fp8-decode T`` instead traces the split schedule on fp8_ds_mla rows (the decode benchmark's
inputs: 16 requests × 128K, random top-k 2048) and prints SM cycles per 64-row block, summed over
each program by ``%clock64`` reads in the staged FP8 producer (waiting for a free stage, issuing
the copies, waiting for them, expanding to bf16 and signalling) and in the consumers (waiting for
a ready block; with ``consumer_expand=1`` expanding the next block; waiting for PV, then for QK;
the whole loop). The traced build runs the producer at 56 registers (at 40 the
counters spill).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.kernels.common import time_ms
from vllm.kernels.sparse_mla_ws import TRACE_SLOTS, sparse_mla_ws

PHASES = [  # (name, from slot, to slot)
    ("query load (all warps)", 0, 1),
    ("producer: first block issued", 1, 2),
    ("wg0: first block landed", 1, 4),
    ("wg1: first block landed", 1, 8),
    ("wg0: first pair", 4, 5),
    ("wg0: pairs 2..n", 5, 6),
    ("wg0: epilogue", 6, 7),
    ("producer: all blocks issued", 1, 3),
    ("program: start to last epilogue", 0, 99),
]


FP8_COUNTERS = [  # (name, slot): cycles summed over a program's blocks
    ("producer: wait for a free stage", 10),
    ("producer: issue the copies", 11),
    ("producer: wait for the copies", 12),
    ("producer: expand to bf16, signal", 13),
    ("consumers: wait for a ready block", 14),
    ("consumers: expand the next block", 6),  # consumer_expand=1
    ("consumers: wait for PV (and release)", 8),
    ("consumers: wait for QK", 9),
    ("consumers: whole loop", 5),
]
ASYM_COUNTERS = [  # schedule=asym: the producer only issues; the expander and the scorer
    ("producer: wait for a free stage", 10),
    ("producer: issue the copies", 11),
    ("expander: wait for the copies", 9),
    ("expander: expand the next block", 6),
    ("expander: wait for P and alpha", 8),
    ("scorer: wait for an expanded block", 14),
    ("scorer: whole loop", 5),
]


def fp8_decode(t: int, tune: dict) -> None:
    from benchmarks.kernels import bench_sparse_mla_decode as bd

    _, cache, slots, q = bd.make_inputs(t, "fp8_ds_mla")
    rows = cache.view(-1, cache.shape[-1])

    def run(**kw):
        return sparse_mla_ws(q, rows, True, 656, slots, 1 / 16, torch.bfloat16, 1, **kw)

    trace = torch.zeros(t, TRACE_SLOTS, dtype=torch.int64, device="cuda")
    traced_tune = {"producer_regs": 56, **tune}
    plain_ms = time_ms(lambda: run(**tune))
    traced_ms = time_ms(lambda: run(trace=trace, **traced_tune))
    trace.zero_()
    run(trace=trace, **traced_tune)
    torch.cuda.synchronize()
    tr = trace.cpu().double()
    n_64 = 2048 // 64  # counts per 64 rows, whatever the block (asym_block_n=32: two blocks)
    print(f"fp8 decode T={t} {tune}: plain {plain_ms:.3f} ms, traced {traced_ms:.3f} ms "
          f"({n_64} × 64 rows per token)")  # fmt: skip
    for name, slot in ASYM_COUNTERS if tune.get("schedule") == "asym" else FP8_COUNTERS:
        c = tr[:, slot].median().item()
        print(f"  {name:36s} {c / n_64:8.0f} cycles per 64 rows (program median)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", type=int, default=8192)
    ap.add_argument("--s", type=int, default=32768)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--tune", default="", help="launch_config knobs, e.g. q_async=0,idx_smem=1")
    ap.add_argument("--fp8-decode", type=int, default=0, metavar="T",
                    help="trace the FP8 split schedule on T decode queries instead")  # fmt: skip
    a = ap.parse_args()
    pairs = (kv.split("=") for kv in a.tune.split(",") if kv)
    tune = {k: int(v) if v.isdigit() else v for k, v in pairs}
    if a.fp8_decode:
        return fp8_decode(a.fp8_decode, tune)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(a.t, 64, 576, device="cuda", generator=g).to(torch.bfloat16)
    kv = torch.randn(a.s, 576, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.randint(0, a.s, (a.t, a.topk), device="cuda", generator=g, dtype=torch.int32)
    run = lambda **kw: sparse_mla_ws(
        q, kv, False, 1152, idx, 0.04, torch.bfloat16, 1, schedule="seesaw", **tune, **kw
    )  # noqa: E731
    trace = torch.zeros(a.t, TRACE_SLOTS, dtype=torch.int64, device="cuda")
    plain_ms = time_ms(run)
    traced_ms = time_ms(lambda: run(trace=trace))
    trace.zero_()
    run(trace=trace)
    torch.cuda.synchronize()
    tr = trace.cpu().double()
    end = torch.maximum(tr[:, 7], tr[:, 9])
    n_pairs = a.topk // 128
    print(f"T={a.t} S={a.s} topk={a.topk} {a.tune}: plain {plain_ms:.3f} ms, traced {traced_ms:.3f} ms "
          f"({n_pairs} pairs of 64-row blocks per token)")  # fmt: skip
    for name, lo, hi in PHASES:
        d = (end if hi == 99 else tr[:, hi]) - tr[:, lo]
        extra = (
            f"  ({d.median().item() / 1e3 / (n_pairs - 1):.2f} µs per pair)"
            if (lo, hi) == (5, 6)
            else ""
        )
        print(
            f"  {name:34s} median {d.median().item() / 1e3:8.2f} µs  p90 {d.quantile(0.9).item() / 1e3:8.2f}{extra}"
        )
    # consecutive programs on one SM: the gap between one's last epilogue and the next's start
    sm = tr[:, 15].long()
    gaps = []
    for s in sm.unique():
        rows = (sm == s).nonzero().flatten()
        order = rows[tr[rows, 0].argsort()]
        gaps.append(tr[order[1:], 0] - end[order[:-1]])
    gaps = torch.cat(gaps)
    print(f"  {'gap between programs on an SM':34s} median {gaps.median().item() / 1e3:8.2f} µs  "
          f"p90 {gaps.quantile(0.9).item() / 1e3:8.2f}")  # fmt: skip
    per_pair = ((tr[:, 6] - tr[:, 5]) / (n_pairs - 1)).median().item()
    total = (end - tr[:, 0]).median().item() + gaps.median().item()
    print(f"  per token {total / 1e3:.2f} µs = {n_pairs} pairs at the steady rate "
          f"({n_pairs * per_pair / 1e3:.2f} µs) + {(total - n_pairs * per_pair) / 1e3:.2f} µs fixed")  # fmt: skip


if __name__ == "__main__":
    main()
