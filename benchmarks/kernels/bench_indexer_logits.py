"""Indexer logits at GLM-5.3 shapes (32 heads × 128, FP8 e4m3 q and keys with power-of-two
scales). Prefill: a chunk of T queries against an S-token context (a 32K–128K-token prefill);
FLOP-bound, the floor is 40 % of the measured FP8 peak. Decode: T queries, each against its own
request's paged FP8 keys (128K context); memory-bound."""

from __future__ import annotations

import torch

from benchmarks.kernels.common import dump_json, parser, print_rows, row, scaled_ref_ms, time_ms
from vllm.kernels.indexer import (
    indexer_logits_cost,
    indexer_logits_paged_cost,
    indexer_logits_paged_ref,
    indexer_logits_ref,
)
from vllm.kernels.kv_cache import quantize_indexer_fp8
from vllm.kernels.triton.indexer_logits import indexer_logits, indexer_logits_paged
from vllm.kernels.triton.utils import resource_report
from vllm.kv_cache_interface import KVCacheLayout

PREFILL = [(8192, 32768), (8192, 65536), (8192, 131072)]
DECODE = [(64, 131072), (256, 131072)]
H, D = 32, 128


def prefill_inputs(t, s):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, qs = quantize_indexer_fp8(torch.randn(t, H, D, device="cuda", generator=g))
    k, ks = quantize_indexer_fp8(torch.randn(s, D, device="cuda", generator=g))
    w = torch.randn(t, H, device="cuda", generator=g) * (H * D) ** -0.5
    return q, qs, w, k, ks


def bench_prefill(t, s, cfg=None, ref=True, tag=""):
    q, qs, w, k, ks = prefill_inputs(t, s)
    kw = cfg or {}
    ms = time_ms(lambda: indexer_logits(q, qs, w, k, ks, **kw))
    ref_ms = None
    if ref:
        sub = 256
        ref_ms = scaled_ref_ms(
            lambda: indexer_logits_ref(q[:sub], qs[:sub], w[:sub], k, ks), sub, t
        )
    flops, nbytes = indexer_logits_cost(t, s, H, D)
    note = " ".join(f"{a}={b}" for a, b in kw.items()) + " " + resource_report("indexer_logits")
    return row(f"indexer_prefill{tag}", f"T={t} S={s} 32x128 fp8", ms, flops, nbytes, "fp8",
               ref_ms, note)  # fmt: skip


def bench_decode(t, ctx, q_fp8=True):
    g = torch.Generator(device="cuda").manual_seed(1)
    layout = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, D)
    bpr = ctx // layout.block_size
    nb = t * bpr
    cache = torch.randint(0, 256, layout.indexer_cache_shape(nb), device="cuda", dtype=torch.uint8)
    cache.view(nb, -1)[:, : 64 * D] &= 0x77
    sc = torch.full((nb, 64), 2.0**-6, device="cuda")
    cache.view(nb, -1)[:, 64 * D :] = sc.view(torch.uint8)
    block_table = torch.randperm(nb, device="cuda", generator=g).view(t, bpr).to(torch.int32)
    token_req = torch.arange(t, device="cuda")
    ctx_lens = torch.full((t,), ctx, device="cuda")
    q, qs = quantize_indexer_fp8(torch.randn(t, H, D, device="cuda", generator=g))
    if not q_fp8:
        q = q.float()
    w = torch.randn(t, H, device="cuda", generator=g)
    args = (q, qs, w, cache, layout, block_table, token_req, ctx_lens, ctx)
    ms = time_ms(lambda: indexer_logits_paged(*args))
    sub = 8
    sub_args = (q[:sub], qs[:sub], w[:sub], cache, layout, block_table, token_req[:sub],
                ctx_lens[:sub], ctx)  # fmt: skip
    ref_ms = scaled_ref_ms(lambda: indexer_logits_paged_ref(*sub_args), sub, t)
    flops, nbytes = indexer_logits_paged_cost(t, ctx, H, D)
    return row("indexer_decode", f"T={t} ctx={ctx} q={'fp8' if q_fp8 else 'fp32'}", ms, flops,
               nbytes, "fp8", ref_ms)  # fmt: skip


def main():
    args = parser(__doc__).parse_args()
    pre = PREFILL[:1] if args.quick else PREFILL
    rows = [bench_prefill(t, s) for t, s in pre]
    rows += [bench_decode(t, c) for t, c in (DECODE[:1] if args.quick else DECODE)]
    rows.append(bench_decode(64, 131072, q_fp8=False))
    if args.sweep:
        for bt, bs, warps, stages in ((128, 128, 8, 2), (128, 128, 8, 4), (64, 128, 4, 3),
                                      (128, 256, 8, 2)):  # fmt: skip
            cfg = dict(block_t=bt, block_s=bs, num_warps=warps, num_stages=stages)
            try:
                rows.append(bench_prefill(8192, 65536, cfg, ref=False, tag="*"))
            except Exception as e:
                print(f"config {cfg}: {type(e).__name__}: {str(e)[:120]}")
    print_rows(rows)
    dump_json(rows, args.json)


if __name__ == "__main__":
    main()
