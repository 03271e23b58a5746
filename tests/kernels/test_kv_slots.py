"""Cache slots of (request, position) pairs: the reference against a per-token Python reading of
the DCP layout, and the Triton kernel against the reference (interpreter here, compiled on GPU)."""

from __future__ import annotations

import pytest
import torch

from vllm.kernels.kv_cache import cache_slots, cache_slots_ref


def _case(seed: int, dcp: int, rows: int = 5, k: int = 37, width: int = 6, bs: int = 4):
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(-1, 50, (3, width), dtype=torch.int32, generator=g)
    req = torch.randint(0, 3, (rows,), generator=g)
    # positions past the table's reach and -1 padding among them
    pos = torch.randint(-1, bs * dcp * width + 3, (rows, k), generator=g, dtype=torch.int32)
    return table, req, pos, bs


def _by_hand(table, r, p, bs, n, rank, i):
    """One token, read off the layout's definition: token p on DCP rank (p // i) % n, in virtual
    block p // (bs·n), at local offset (off // (i·n))·i + off % i."""
    if p < 0 or (p // i) % n != rank or p // (bs * n) >= table.shape[1]:
        return -1
    vb = int(table[r, p // (bs * n)])
    if vb < 0:
        return -1
    off = p % (bs * n)
    return vb * bs + (off // (i * n)) * i + off % i


@pytest.mark.parametrize("dcp,rank,inter", [(1, 0, 1), (2, 1, 1), (4, 2, 2), (2, 0, 4)])
def test_reference_reads_the_layout(dcp, rank, inter):
    table, req, pos, bs = _case(dcp * 10 + rank, dcp)
    got = cache_slots_ref(table, req, pos, bs, dcp, rank, inter)
    assert got.dtype == torch.int64
    for t in range(pos.shape[0]):
        for j in range(pos.shape[1]):
            want = _by_hand(table, int(req[t]), int(pos[t, j]), bs, dcp, rank, inter)
            assert int(got[t, j]) == want, (t, j)
    # one position per row (a slot mapping): req and pos of the same shape
    flat = cache_slots_ref(table, req, pos[:, 0], bs, dcp, rank, inter, torch.int32)
    assert flat.dtype == torch.int32 and torch.equal(flat.long(), got[:, 0])
    assert (got >= 0).any() and (got == -1).any()  # the case has both


def test_every_token_on_exactly_one_rank():
    table = torch.arange(12, dtype=torch.int32).view(2, 6)
    req = torch.tensor([0, 1])
    pos = torch.arange(40, dtype=torch.int32).repeat(2, 1)
    owners = sum((cache_slots_ref(table, req, pos, 4, 4, r, 2) >= 0).long() for r in range(4))
    assert torch.equal(owners, torch.ones_like(owners))


@pytest.mark.parametrize("dcp,rank,inter", [(1, 0, 1), (4, 3, 2)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_kernel_interpreter(interp, dcp, rank, inter, dtype):
    mod = interp("kv_slots")
    table, req, pos, bs = _case(7 + dcp, dcp, rows=6, k=300)
    want = cache_slots_ref(table, req, pos, bs, dcp, rank, inter, dtype)
    got = mod.cache_slots(table, req, pos, bs, dcp, rank, inter, dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    # 1-D positions (a slot mapping), int64 requests, a strided position row
    col = torch.cat([pos, pos], 1)[:, 5]
    assert torch.equal(mod.cache_slots(table, req, col, bs, dcp, rank, inter, dtype), want[:, 5])


@pytest.mark.gpu
@pytest.mark.parametrize("dcp,rank,inter", [(1, 0, 1), (2, 1, 1), (8, 5, 64)])
def test_kernel_matches_reference_on_cuda(dcp, rank, inter):
    g = torch.Generator().manual_seed(dcp)
    table = torch.randint(-1, 10**6, (64, 200), dtype=torch.int32, generator=g)
    req = torch.randint(0, 64, (256,), generator=g)
    pos = torch.randint(-1, 64 * dcp * 210, (256, 2048), dtype=torch.int32, generator=g)
    for dtype in (torch.int32, torch.int64):
        want = cache_slots_ref(table, req, pos, 64, dcp, rank, inter, dtype)
        got = cache_slots(table.cuda(), req.cuda(), pos.cuda(), 64, dcp, rank, inter, dtype)
        assert torch.equal(got.cpu(), want)
        flat = cache_slots(table.cuda(), req.cuda(), pos[:, 0].cuda(), 64, dcp, rank, inter, dtype)
        assert torch.equal(flat.cpu(), want[:, 0])
