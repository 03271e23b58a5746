"""Routed experts for decode batches: the sync-free dense form (`experts_dense`, what CUDA runs for
T <= 256 when T·k >= 2·E_loc) against the grouped reference (`experts_ref`: one host sync and
six launches per chosen expert), at GLM-5.3's expert shape (H 6144, I 2048, k 8, bf16) with the
local experts of one EP8 rank (32) and of TP-only layouts cut to fit (64). Memory-bound: the
bytes are the local experts' weights (read once) plus activations."""

from __future__ import annotations

import torch

from benchmarks.kernels.common import dump_json, parser, print_rows, row, time_ms
from vllm.model_executor.layers.moe import experts_dense, experts_ref

H, INTER, K = 6144, 2048, 8


def bench(t: int, e_loc: int, e_total: int, offset: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(t)
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(t, H, device=dev, dtype=bf, generator=g)
    w13 = torch.randn(e_loc, 2 * INTER, H, device=dev, dtype=bf, generator=g) * H**-0.5
    w2 = torch.randn(e_loc, H, INTER, device=dev, dtype=bf, generator=g) * INTER**-0.5
    ids = torch.rand(t, e_total, device=dev, generator=g).topk(K, dim=-1).indices
    w = torch.rand(t, K, device=dev, generator=g)
    hit = int(torch.unique(ids[(ids >= offset) & (ids < offset + e_loc)]).numel())
    dense_ms = time_ms(lambda: experts_dense(x, w13, w2, ids, w, offset))
    ref_ms = time_ms(lambda: experts_ref(x, w13, w2, ids, w, offset))
    nbytes = e_loc * 3 * INTER * H * 2 + t * H * 2 * 2
    flops = (
        2 * e_loc * t * 3 * INTER * H
    )  # the dense form computes every local expert on every token
    return row(
        "moe_experts_dense",
        f"T={t} E_loc={e_loc} hit={hit}",
        dense_ms,
        flops,
        nbytes,
        "bf16",
        ref_ms=ref_ms,
        note=f"ref {ref_ms:.3f} ms; ref reads {hit}/{e_loc} experts",
    )


def main() -> None:
    args = parser(__doc__).parse_args()
    shapes = [(1, 32), (16, 32), (64, 32), (256, 32), (64, 64)]
    if args.quick:
        shapes = shapes[2:3]
    rows = [bench(t, e, 256, 0) for t, e in shapes]
    print_rows(rows)
    dump_json(rows, args.json)


if __name__ == "__main__":
    main()
