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


def test_tokens_of_one_request_resolve_in_order():
    """Verify rows: 3 tokens of request 0, 2 of request 1 and 1 of request 2 in one call, with the
    minimum hot buffer (3 × K rows). The same as one call per token rank (the other ranks masked):
    a later token hits what an earlier one fetched and never evicts a row an earlier one reads;
    after the copies every token reads its own positions. Two steps: the second evicts."""
    bs, pages, h = 4, 12, 12  # K = 4
    g = torch.Generator().manual_seed(1)
    page_table = torch.full((3, pages), -1, dtype=torch.int64)
    page_table[:, 0] = torch.tensor([1, 2, 3])  # page 0 resident, the rest host only
    host_table = torch.arange(3 * pages).view(3, pages)
    hot_slots = (torch.arange(3 * h) + 40 * bs).view(3, h)
    host = torch.randn(3 * pages * bs, 2, generator=g)
    trash = 99 * bs
    req = torch.tensor([0, 0, 0, 1, 1, 2])
    ranks = ([0, 3, 5], [1, 4], [2])  # rows of the 1st, 2nd, 3rd token of each request
    steps = [
        [[1, 8, 9, 10], [8, 9, 11, 12], [13, 14, 15, 16], [20, 21, -1, 22], [22, 23, 24, 25],
         [30, 31, 32, 33]],
        [[1, 20, 21, 22], [20, 21, 23, 9], [24, 25, 26, 27], [32, 33, 34, -1], [35, 36, 37, 38],
         [40, 41, 42, 43]],
    ]  # fmt: skip
    state = [torch.full((3, h + 1), -1), torch.zeros((3, h + 1), dtype=torch.int64)]
    per_rank = [x.clone() for x in state]
    gpu = torch.zeros(100 * bs, 2)
    gpu[bs : 2 * bs] = host[0:bs]  # request 0's resident page 0
    hits = 0
    for step, sel in enumerate(map(torch.tensor, steps), start=1):
        res = resolve_ref(sel, req, page_table, host_table, hot_slots, *state, step, trash, bs, 3)
        apply_copies(res, [gpu], [host])
        for t, s in enumerate(req.tolist()):
            for c, p in enumerate(sel[t].tolist()):
                if p < 0:
                    assert res.slots[t, c] == -1
                elif page_table[s, p // bs] < 0:
                    want = host[host_table[s, p // bs] * bs + p % bs]
                    assert torch.equal(gpu[res.slots[t, c]], want), (step, t, p)
        for rows in ranks:
            m = torch.full_like(sel, -1)
            m[rows] = sel[rows]
            w = resolve_ref(m, req, page_table, host_table, hot_slots, *per_rank, step, trash, bs)
            assert torch.equal(res.slots[rows], w.slots[rows])
            assert torch.equal(res.miss[rows], w.miss[rows])
            hits += int(w.hits)
        assert torch.equal(state[0][:, :h], per_rank[0][:, :h])
        assert torch.equal(state[1][:, :h], per_rank[1][:, :h])
    assert hits > 0 and int(res.hits) > 0  # later tokens hit the rows earlier ones fetched
