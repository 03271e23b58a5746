"""Routed experts, decode to prefill: the sync-free dense form (`experts_dense`, what CUDA runs for
T <= 64 when T·k >= 2·E_loc) and the sync-free Triton grouped GEMM (`experts_grouped`, what CUDA
runs otherwise; ``vllm.kernels.moe.fused_experts`` picks) against the grouped reference (`experts_ref`: one host sync and six
launches per chosen expert), at GLM-5.3's expert shape (H 6144, I 2048, k 8, bf16) with the local
experts of one EP8 rank (32) and of TP-only layouts cut to fit (64). Decode is memory-bound: the
bytes are the chosen experts' weights (read once) plus activations; the T=4096 prefill shape is
compute-bound and skips the dense form (it computes every expert on every token).
``--sweep`` also times the grouped kernel with the other row tile (block_m 16 / 64)."""

from __future__ import annotations

import torch

from benchmarks.kernels.common import dump_json, parser, print_rows, row, time_ms
from vllm.kernels.moe import DENSE_MAX_TOKENS, experts_dense, experts_ref, fused_experts_cost
from vllm.kernels.triton import moe_grouped
from vllm.kernels.triton.moe_grouped import experts_grouped

H, INTER, K = 6144, 2048, 8


def bench(t: int, e_loc: int, e_total: int, offset: int, sweep: bool = False) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(t)
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(t, H, device=dev, dtype=bf, generator=g)
    w13 = torch.randn(e_loc, 2 * INTER, H, device=dev, dtype=bf, generator=g) * H**-0.5
    w2 = torch.randn(e_loc, H, INTER, device=dev, dtype=bf, generator=g) * INTER**-0.5
    ids = torch.rand(t, e_total, device=dev, generator=g).topk(K, dim=-1).indices
    w = torch.rand(t, K, device=dev, generator=g)
    local = (ids >= offset) & (ids < offset + e_loc)
    hit = int(torch.unique(ids[local]).numel())
    valid = int(local.sum())
    shape = f"T={t} E_loc={e_loc} hit={hit}"
    ref_ms = time_ms(lambda: experts_ref(x, w13, w2, ids, w, offset))
    rows = []
    if t <= DENSE_MAX_TOKENS:
        dense_ms = time_ms(lambda: experts_dense(x, w13, w2, ids, w, offset))
        nbytes = e_loc * 3 * INTER * H * 2 + t * H * 2 * 2
        flops = 2 * e_loc * t * 3 * INTER * H  # every local expert on every token
        note = f"ref {ref_ms:.3f} ms; ref reads {hit}/{e_loc} experts"
        rows.append(row("moe_experts_dense", shape, dense_ms, flops, nbytes, "bf16", ref_ms, note))
    flops, nbytes = fused_experts_cost(t, K, e_loc, H, INTER, valid, hit)
    default_m = moe_grouped.TUNE["block_m"]
    for block_m in [default_m] + ([16 if default_m != 16 else 64] if sweep else []):
        moe_grouped.TUNE["block_m"] = block_m
        ms = time_ms(lambda: experts_grouped(x, w13, w2, ids, w, offset))
        note = f"ref {ref_ms:.3f} ms; {valid} local pairs; block_m {block_m}"
        rows.append(row("moe_experts_grouped", shape, ms, flops, nbytes, "bf16", ref_ms, note))
    moe_grouped.TUNE["block_m"] = default_m
    return rows


def main() -> None:
    args = parser(__doc__).parse_args()
    shapes = [(1, 32), (16, 32), (64, 32), (256, 32), (64, 64), (4096, 32)]
    if args.quick:
        shapes = shapes[2:3]
    rows = [r for t, e in shapes for r in bench(t, e, 256, 0, args.sweep)]
    print_rows(rows)
    dump_json(rows, args.json)


if __name__ == "__main__":
    main()
