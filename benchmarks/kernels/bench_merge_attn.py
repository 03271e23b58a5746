"""DCP combine (LSE merge) of N = 8 shards at GLM-5.3 decode shapes (H=64, d_v=512, fp32
partials). Memory-bound."""

from __future__ import annotations

import torch

from benchmarks.kernels.common import dump_json, parser, print_rows, row, time_ms
from vllm.kernels.merge_attn import merge_attn_cost, merge_attn_states, merge_attn_states_ref

SHAPES = [(8, 64), (8, 1024), (2, 1024)]  # (shards, tokens)


def bench(n, t):
    g = torch.Generator(device="cuda").manual_seed(0)
    outs = torch.randn(n, t, 64, 512, device="cuda", generator=g)
    lses = torch.randn(n, t, 64, device="cuda", generator=g)
    ms = time_ms(lambda: merge_attn_states(outs, lses))
    ref_ms = time_ms(lambda: merge_attn_states_ref(outs, lses), rep_ms=100)
    flops, nbytes = merge_attn_cost(n, t * 64, 512)
    return row("merge_attn", f"N={n} T={t} H=64 dv=512", ms, flops, nbytes, "bf16", ref_ms)


def main():
    args = parser(__doc__).parse_args()
    rows = [bench(n, t) for n, t in (SHAPES[:1] if args.quick else SHAPES)]
    print_rows(rows)
    dump_json(rows, args.json)


if __name__ == "__main__":
    main()
