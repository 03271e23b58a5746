"""Indexer scoring and top-k: brute force, tie order, and the DCP global merge."""

from __future__ import annotations

import pytest
import torch

from vllm.kernels.indexer import indexer_logits_ref, merge_topk, topk_partial, topk_ref


def _brute(q, qs, w, k, ks):
    t, h, _ = q.shape
    out = torch.zeros(t, k.shape[0])
    for i in range(t):
        for s in range(k.shape[0]):
            out[i, s] = ks[s] * sum(
                w[i, j] * qs[i, j] * max(float(q[i, j] @ k[s]), 0.0) for j in range(h)
            )
    return out


def test_logits_match_brute_force():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 8, generator=g), torch.randn(9, 8, generator=g)
    w, qs, ks = (
        torch.randn(5, 4, generator=g),
        torch.rand(5, 4, generator=g),
        torch.rand(9, generator=g),
    )
    assert torch.allclose(indexer_logits_ref(q, qs, w, k, ks), _brute(q, qs, w, k, ks), atol=1e-5)


def test_topk_brute_force_and_padding():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 20, generator=g)
    limit = torch.tensor([1, 3, 8, 9, 20, 20])
    got = topk_ref(logits, limit, 8)
    for i in range(6):
        n = min(8, int(limit[i]))
        expect = sorted(range(int(limit[i])), key=lambda s: (-logits[i, s].item(), s))[:n]
        assert got[i, :n].tolist() == expect
        assert got[i, n:].eq(-1).all()


@pytest.mark.parametrize("seed", range(6))
def test_topk_partial_equals_reference(seed):
    """The CPU selection against the sorting reference on fresh inputs: continuous scores, many
    ties (small integers, -0.0 beside 0.0), rows shorter than k, k larger than the row."""
    g = torch.Generator().manual_seed(seed)
    t, s = 33, 97
    for logits in (
        torch.randn(t, s, generator=g),
        torch.randint(-3, 3, (t, s), generator=g).float(),
    ):
        logits[0, :9] = -0.0
        limit = torch.randint(0, s + 1, (t,), generator=g)
        limit[1] = s
        for k in (1, 8, 40, 128):
            assert torch.equal(topk_partial(logits, limit, k), topk_ref(logits, limit, k)), k


def test_topk_ties_go_to_lower_position():
    logits = torch.zeros(1, 10)
    logits[0, 7] = 1.0
    assert topk_ref(logits, torch.tensor([10]), 4).tolist() == [[7, 0, 1, 2]]


def test_global_merge_equals_single_rank_and_union_differs():
    g = torch.Generator().manual_seed(2)
    n_ranks, s, k = 4, 64, 8
    logits = torch.randn(3, s, generator=g)
    logits[:, 10:18] = 5.0 + torch.rand(3, 8, generator=g)  # a hot region owned unevenly
    limit = torch.full((3,), s)
    single = topk_ref(logits, limit, k)
    pos = torch.arange(s)
    cand_s, cand_p = [], []
    for r in range(n_ranks):
        mine = pos[(pos // 2) % n_ranks == r]  # interleave 2
        local = topk_ref(logits[:, mine], torch.full((3,), len(mine)), k)
        cand_p.append(torch.where(local >= 0, mine[local.long().clamp_min(0)], -1))
        cand_s.append(
            torch.where(
                local >= 0, logits[:, mine].gather(1, local.long().clamp_min(0)), float("-inf")
            )
        )
    merged = merge_topk(torch.cat(cand_s, 1), torch.cat(cand_p, 1), k)
    assert torch.equal(merged, single)
    # a union of local top-k's is not the global top-k
    union = [set(torch.cat(cand_p, 1)[i].tolist()) - {-1} for i in range(3)]
    assert all(len(u) > k for u in union) and any(
        u != set(single[i].tolist()) for i, u in enumerate(union)
    )


def test_merge_handles_empty_shards():
    scores = torch.tensor([[1.0, float("-inf"), 0.5, float("-inf")]])
    pos = torch.tensor([[4, -1, 2, -1]])
    assert merge_topk(scores, pos, 3).tolist() == [[4, 2, -1]]
