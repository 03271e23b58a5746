"""The compute half of PCP scaling, on one GPU: one GLM-5.3 layer's indexer (FP8 logits + top-k)
and sparse-MLA prefill for the whole prompt, against each of the N ranks' V-shaped shares.

    python benchmarks/parallel/bench_pcp_share.py --lengths 32768 131072 --pcp 8

Per rank r the queries are chunks r and 2N−1−r of 2N; each chunk scores only the keys up to its
last position (what the attention layer does). Printed: the whole prompt's time, each rank's share
(min / max / mean), the balance (max / mean), the ideal speed-up N·T_rank_mean/T_whole, and the
all-gather bytes per layer that PCP (new rows) and DCP (the temporary full context) add, with the
time they take at NVLink's 450 GB/s. Ceilings are measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from vllm.distributed.pcp_manager import v_chunks  # noqa: E402
from vllm.kernels.indexer import indexer_logits, indexer_topk
from vllm.kernels.sparse_mla import sparse_mla_prefill

H, D_QK, D_V, TOPK, HI, DI = 64, 576, 512, 2048, 32, 128
ROW_FP8, IDX_ROW = 656, 132
NVLINK = 450e9


def _timer(dev):
    if dev.type == "cuda":
        from benchmarks.kernels.common import time_ms

        return lambda fn: time_ms(fn, rep_ms=100, warmup_ms=10)
    import time

    def t(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return t


def layer_share(ranges, q, qs, w, k, ks, q_abs, kv, dev):
    """Indexer (logits + top-k) and sparse MLA prefill for the queries in `ranges`."""
    for lo, hi in ranges:
        step = 4096
        for s in range(lo, hi, step):
            e = min(hi, s + step)
            logits = indexer_logits(q[s:e], qs[s:e], w[s:e], k[:e], ks[:e])
            limit = torch.arange(s, e, device=dev) + 1
            sel = indexer_topk(logits, limit, TOPK)
            sparse_mla_prefill(q_abs[s:e], kv[:e], sel, 0.0625, D_V)


def run(length: int, pcp: int, dev: torch.device) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    fp8 = torch.float8_e4m3fn
    q = torch.randn(length, HI, DI, device=dev, generator=g).to(fp8)
    qs = torch.rand(length, HI, device=dev, generator=g)
    w = torch.randn(length, HI, device=dev, generator=g)
    k = torch.randn(length, DI, device=dev, generator=g).to(fp8)
    ks = torch.rand(length, device=dev, generator=g)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    q_abs = torch.randn(length, H, D_QK, device=dev, dtype=dt, generator=g) * 0.05
    kv = torch.randn(length, D_QK, device=dev, dtype=dt, generator=g)
    timer = _timer(dev)
    whole = timer(lambda: layer_share([(0, length)], q, qs, w, k, ks, q_abs, kv, dev))
    ch = v_chunks(length, pcp)
    ranks = [
        timer(
            lambda r=r: layer_share([ch[r], ch[2 * pcp - 1 - r]], q, qs, w, k, ks, q_abs, kv, dev)
        )
        for r in range(pcp)
    ]
    mean = sum(ranks) / pcp
    pcp_bytes = (pcp - 1) / pcp * length * (ROW_FP8 + IDX_ROW)  # received per rank, a full layer
    dcp_bytes = (pcp - 1) / pcp * length * ROW_FP8  # the temporary full copy of the context
    return {
        "length": length,
        "pcp": pcp,
        "whole_ms": whole,
        "rank_min_ms": min(ranks),
        "rank_max_ms": max(ranks),
        "rank_mean_ms": mean,
        "balance": max(ranks) / mean,
        "compute_speedup": whole / max(ranks),
        "efficiency": whole / max(ranks) / pcp,
        "pcp_allgather_MB": pcp_bytes / 1e6,
        "pcp_allgather_ms_nvlink": pcp_bytes / NVLINK * 1e3,
        "dcp_allgather_MB": dcp_bytes / 1e6,
        "dcp_allgather_ms_nvlink": dcp_bytes / NVLINK * 1e3,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--pcp", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda":
        from benchmarks.kernels.common import measure_peaks

        p = measure_peaks()
        print(
            f"ceilings: copy {p.copy_tbps:.2f} TB/s, bf16 {p.bf16_tflops:.0f} TFLOP/s, fp8 {p.fp8_tflops:.0f} TFLOP/s"
        )
    rows = [run(n, args.pcp, dev) for n in args.lengths]
    print(
        f"one layer (indexer logits+top-k, sparse MLA prefill), PCP{args.pcp} V-shaped shares on {dev}"
    )
    print(
        f"{'L':>7} {'whole ms':>9} {'rank min':>9} {'rank max':>9} {'balance':>8} {'speedup':>8} {'eff':>6}"
        f" {'PCP AG MB':>10} {'ms@450':>7} {'DCP AG MB':>10} {'ms@450':>7}"
    )
    for r in rows:
        print(
            f"{r['length']:>7} {r['whole_ms']:>9.2f} {r['rank_min_ms']:>9.2f} {r['rank_max_ms']:>9.2f}"
            f" {r['balance']:>8.3f} {r['compute_speedup']:>8.2f} {r['efficiency']:>6.1%} {r['pcp_allgather_MB']:>10.1f}"
            f" {r['pcp_allgather_ms_nvlink']:>7.2f} {r['dcp_allgather_MB']:>10.1f} {r['dcp_allgather_ms_nvlink']:>7.2f}"
        )
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "pcp_share", "device": str(dev), **r}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
