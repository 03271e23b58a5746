"""Top-k selection (k = 2048) over indexer logits: decode rows (64 queries × 128K / 1M
candidates) and a prefill chunk (8192 queries, causal limits, 32K–128K context). Memory-bound
(the row is read once from HBM); the floor compares it with the logits kernel of the same shape,
timed in the same run: top-k must take ≤ 30 % of the logits time."""

from __future__ import annotations

import torch

from benchmarks.kernels.bench_indexer_logits import prefill_inputs
from benchmarks.kernels.common import dump_json, parser, print_rows, row, scaled_ref_ms, time_ms
from vllm.attention.ops.indexer import topk_ref
from vllm.kernels.indexer_logits import indexer_logits, indexer_logits_paged_cost
from vllm.kernels.topk import indexer_topk, topk_cost
from vllm.kernels.triton_utils import resource_report

TOPK = 2048
SHAPES = [(64, 131072, False), (64, 1 << 20, False), (8192, 32768, True), (8192, 131072, True)]


def bench(t, s, causal, sampled=True):
    g = torch.Generator(device="cuda").manual_seed(0)
    if causal:  # the logits kernel's output, so the ratio is for the same shape
        q, qs, w, k, ks = prefill_inputs(t, s)
        logits = indexer_logits(q, qs, w, k, ks)
        logit_ms = time_ms(lambda: indexer_logits(q, qs, w, k, ks))
        limit = torch.arange(s - t + 1, s + 1, device="cuda")
    else:
        logits = torch.randn(t, s, device="cuda", generator=g)
        # decode logits are memory-bound: their time is the key bytes over copy bandwidth
        logit_ms = None
        limit = torch.full((t,), s, device="cuda")
    ms = time_ms(lambda: indexer_topk(logits, limit, TOPK, sampled=sampled))
    sub = min(t, 64)
    ref_ms = scaled_ref_ms(lambda: topk_ref(logits[:sub], limit[:sub], TOPK), sub, t)
    flops, nbytes = topk_cost(t, s, TOPK)
    if logit_ms is None:
        from benchmarks.kernels.common import measure_peaks

        _, kb = indexer_logits_paged_cost(t, s)
        logit_ms = kb / (measure_peaks().copy_tbps * 1e12) * 1e3
        note = f"{ms / logit_ms:.0%} of logits at copy bandwidth"
    else:
        note = f"{ms / logit_ms:.0%} of logits ({logit_ms:.2f} ms)"
    note += " " + resource_report("topk") + ("" if sampled else " no pre-filter")
    return row("topk" if sampled else "topk*", f"T={t} S={s} k=2048{' causal' if causal else ''}", ms, flops, nbytes,
               "fp8", ref_ms, note)  # fmt: skip


def main():
    args = parser(__doc__).parse_args()
    shapes = SHAPES[::2] if args.quick else SHAPES
    rows = [bench(*sh) for sh in shapes]
    if args.sweep:
        rows += [bench(*sh, sampled=False) for sh in shapes[:3]]
    print_rows(rows)
    dump_json(rows, args.json)


if __name__ == "__main__":
    main()
