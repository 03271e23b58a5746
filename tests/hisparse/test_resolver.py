"""The HiSparse resolver against a straightforward per-position model of residency and LRU."""

from __future__ import annotations

import torch

from vllm.hisparse.resolver import apply_copies
from vllm.kernels.hisparse_resolve import resolve_ref


def _setup(h=8, pages=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    page_table = torch.tensor([[5, -1, -1, 7, -1, 9]])  # pages 1, 2, 4 dropped
    host_table = torch.tensor([[0, 1, 2, 3, 4, 5]])
    hot_slots = torch.arange(h).view(1, h) + 100 * 4  # hot rows live in blocks 100.. (slot 400+)
    hot_pos = torch.full((1, h + 1), -1, dtype=torch.int64)
    hot_lru = torch.zeros((1, h + 1), dtype=torch.int64)
    gpu = torch.zeros(200 * 4, 3)  # 4-token "pages" to keep it small
    host = torch.randn(6 * 4, 3, generator=g)
    for blk in (5, 7, 9):
        pg = {5: 0, 7: 3, 9: 5}[blk]
        gpu[blk * 4 : blk * 4 + 4] = host[pg * 4 : pg * 4 + 4]
    return page_table, host_table, hot_slots, hot_pos, hot_lru, gpu, host


def test_resident_hit_miss_and_lru():
    page_table, host_table, hot_slots, hot_pos, hot_lru, gpu, host = _setup()
    trash = 199 * 4
    stamps = {}
    for step, sel in enumerate(
        [[0, 5, 9, 13], [5, 9, 6, 10, 17, 14], [5, 18, 19, 8, 2, 12]], start=1
    ):
        pos = torch.tensor([sel])
        res = resolve_ref(
            pos,
            torch.tensor([0]),
            page_table,
            host_table,
            hot_slots,
            hot_pos,
            hot_lru,
            step,
            trash,
            4,
        )
        apply_copies(res, [gpu], [host])
        # every selected position reads its own row
        assert torch.equal(gpu[res.slots[0]], host[pos[0]])
        for p, sl in zip(sel, res.slots[0].tolist(), strict=True):
            if page_table[0, p // 4] >= 0:
                assert sl == page_table[0, p // 4].item() * 4 + p % 4  # read in place
            else:
                assert 400 <= sl < 408  # a hot row
                stamps[p] = step
        assert res.num_resident.item() == sum(page_table[0, p // 4].item() >= 0 for p in sel)
    # step 2: 5 and 9 were fetched in step 1 -> hits; 6, 10, 17 new
    # hot buffer holds 8 rows; every position ever missed is still there (≤ 8 distinct)
    held = {int(x) for x in hot_pos[0, :-1].tolist() if x >= 0}
    assert held == {p for p in stamps}
    assert len(held) <= 8


def test_eviction_prefers_least_recent_and_never_a_current_hit():
    page_table, host_table, hot_slots, hot_pos, hot_lru, gpu, host = _setup(h=4)
    page_table[:] = -1
    r = lambda step, sel: resolve_ref(
        torch.tensor([sel]),
        torch.tensor([0]),
        page_table,
        host_table,
        hot_slots,  # noqa: E731
        hot_pos,
        hot_lru,
        step,
        199 * 4,
        4,
    )
    apply_copies(r(1, [0, 1]), [gpu], [host])
    apply_copies(r(2, [2, 3]), [gpu], [host])  # buffer full: 0, 1 (step 1), 2, 3 (step 2)
    res = r(3, [1, 20])  # 1 hits; 20 evicts the LRU row not hit now: position 0
    apply_copies(res, [gpu], [host])
    assert res.hits.item() == 1 and res.num_miss.item() == 1
    assert sorted(hot_pos[0, :-1].tolist()) == [1, 2, 3, 20]
    assert torch.equal(gpu[res.slots[0]], host[[1, 20]])


def test_invalid_positions_and_trash():
    page_table, host_table, hot_slots, hot_pos, hot_lru, gpu, host = _setup()
    res = resolve_ref(
        torch.tensor([[-1, 0, -1]]),
        torch.tensor([0]),
        page_table,
        host_table,
        hot_slots,
        hot_pos,
        hot_lru,
        1,
        199 * 4,
        4,
    )
    assert res.slots[0].tolist() == [-1, 20, -1]
    assert (res.dest[~res.miss] == 199 * 4).all()
