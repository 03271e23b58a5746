"""HiSparse resolve for GLM-5.3 decode (K = 2048 selected positions, H = 4096 hot rows, 128K
context, 20 % of the selected positions resident, ~90 % of the rest hot-buffer hits): the fused
kernel (one launch + a 3-element sum) against the torch reference ``resolve_ref()`` (~40 launches),
eager and replayed from a CUDA graph, at B decode tokens. Latency-bound (in-program sorts; the
bytes are a few MB): the column to read is ``xref``, the speed-up over the reference. Every timed
call first restores the hot-buffer state (two small copies, timed alone and subtracted), so each
call sees the same hits and misses."""

from __future__ import annotations

import torch

from benchmarks.kernels.common import dump_json, parser, print_rows, row, time_ms
from vllm.kernels.hisparse_resolve import resolve_cost, resolve_ref
from vllm.kernels.triton.hisparse_resolve import resolve_fused
from vllm.kernels.triton.utils import resource_report

K, H, BLOCK, PAGES, NOW = 2048, 4096, 64, 2048, 10_000
SHAPES = [1, 64, 256]


def inputs(b: int, hit: float = 0.9, resident: float = 0.2):
    """State and positions for b requests (one decode token each) at the given hit rate."""
    g = torch.Generator().manual_seed(b)
    n_pos = PAGES * BLOCK
    page_res = torch.rand(b, PAGES, generator=g) < resident
    page_table = torch.where(page_res, torch.randperm(b * PAGES, generator=g).view(b, PAGES), -1)
    host_table = torch.randperm(b * PAGES, generator=g).view(b, PAGES)
    hot_slots = torch.randperm(b * H, generator=g).view(b, H) + b * PAGES * BLOCK
    hot_pos = torch.full((1, b, H + 1), -1, dtype=torch.int64)
    hot_lru = NOW - torch.randint(1, 64, (1, b, H + 1), generator=g)
    positions = torch.empty(b, K, dtype=torch.int64)
    n_res = int(K * resident)
    n_hit = round((K - n_res) * hit)
    for i in range(b):
        pos = torch.randperm(n_pos, generator=g)
        is_res = page_res[i, pos // BLOCK]
        res, dropped = pos[is_res], pos[~is_res]
        hot_pos[0, i, :H] = dropped[:H]
        sel = torch.cat([res[:n_res], dropped[:n_hit], dropped[H : H + K - n_res - n_hit]])
        positions[i] = sel[torch.randperm(K, generator=g)]
    req_slot = torch.randperm(b, generator=g)
    positions = positions[req_slot]  # token i belongs to request req_slot[i]
    t = (positions, req_slot, page_table.int(), host_table, hot_slots, hot_pos, hot_lru)
    return [x.cuda() for x in t]


def _timed(fn, restore, graph: bool) -> float:
    """ms of fn alone: (restore + fn) minus restore, eager or as CUDA-graph replays."""
    both = lambda: (restore(), fn())  # noqa: E731
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            both()
        torch.cuda.current_stream().wait_stream(side)
        g_both, g_rest = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_both):
            both()
        with torch.cuda.graph(g_rest):
            restore()
        both, restore = g_both.replay, g_rest.replay
    return time_ms(both) - time_ms(restore)


def bench(b: int, graph: bool, num_warps: int = 8, tag: str = "") -> dict:
    pos, req, pt, ht, hs, hot_pos, hot_lru = inputs(b)
    hp0, hl0 = hot_pos.clone(), hot_lru.clone()
    step = torch.full((1,), NOW, dtype=torch.int64, device="cuda")

    def restore():
        hot_pos.copy_(hp0)
        hot_lru.copy_(hl0)

    def fused():
        return resolve_fused(pos, req, pt, ht, hs, hot_pos[0], hot_lru[0], step, 0, BLOCK,
                             num_warps=num_warps)  # fmt: skip

    def ref():
        return resolve_ref(pos, req, pt, ht, hs, hot_pos[0], hot_lru[0], NOW, 0, BLOCK)

    restore()
    res = fused()
    hits, misses = int(res.hits), int(res.num_miss)
    restore()
    want = ref()
    assert torch.equal(res.slots, want.slots) and torch.equal(res.dest, want.dest)
    ms = _timed(fused, restore, graph)
    ref_ms = _timed(ref, restore, False)  # the reference is timed eagerly (its int step is a
    # host scalar written into a device tensor: not capturable)
    _, nbytes = resolve_cost(b, K, H)
    note = (f"{'graph' if graph else 'eager'} hit {hits / max(hits + misses, 1):.0%} "
            f"ref (eager) {ref_ms:.3f} ms w{num_warps} {resource_report('hisparse_resolve')}")  # fmt: skip
    shape = f"B={b} K={K} H={H}{tag}"
    return row("hisparse_resolve" + ("[graph]" if graph else ""), shape, ms, 0, nbytes, "bf16",
               ref_ms, note)  # fmt: skip


def main():
    args = parser(__doc__).parse_args()
    shapes = [64] if args.quick else SHAPES
    rows = [bench(b, graph) for graph in (False, True) for b in shapes]
    if args.sweep:
        rows += [bench(b, True, w, f" w{w}") for w in (4, 16) for b in shapes]
    print_rows(rows)
    dump_json(rows, args.json)


if __name__ == "__main__":
    main()
