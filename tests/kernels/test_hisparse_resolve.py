"""Fused HiSparse resolver against the torch reference ``resolve_ref()``: identical slots, src, dest,
miss and counts, and identical hot_pos / hot_lru columns [:H] (column H, the reference's trash
column, is not written by the kernel), over consecutive steps that carry the hot-buffer state:
resident pages, hot hits, misses that evict, −1 positions, LRU ties, step as int and as tensor."""

from __future__ import annotations

import pytest
import torch

from vllm.kernels.hisparse_resolve import resolve_ref


def _state(r, h, pages, bs, groups, g, resident_frac=0.4, old_frac=0.0, now=100, device="cpu"):
    """Page tables, hot slots, and [G, R, H + 1] hot_pos / hot_lru with a partly filled buffer;
    stamps a few steps before `now` (many ties), old_frac of them 0..3 (rows never used since)."""
    resident = torch.rand(r, pages, generator=g) < resident_frac
    blocks = torch.randperm(r * pages, generator=g).view(r, pages).to(torch.int32)
    page_table = torch.where(resident, blocks, -1).to(torch.int32)
    host_table = torch.randperm(r * pages, generator=g).view(r, pages).long()
    hot_slots = (torch.randperm(r * h, generator=g) + 10_000).view(r, h)
    hot_pos = torch.full((groups, r, h + 1), -1, dtype=torch.int64)
    hot_lru = torch.randint(0, 4, (groups, r, h + 1), generator=g)
    old = torch.rand(groups, r, h + 1, generator=g) < old_frac
    hot_lru = torch.where(old, hot_lru, now - 1 - hot_lru)
    for gi in range(groups):
        for ri in range(r):
            n = int(torch.randint(0, h + 1, (1,), generator=g))  # rows 0..n−1 hold positions
            rows = torch.randperm(h, generator=g)[:n]
            hot_pos[gi, ri, rows] = torch.randperm(pages * bs, generator=g)[:n]
    hot_pos[:, :, h] = 7  # trash column: never read
    return [x.to(device) for x in (page_table, host_table, hot_slots, hot_pos, hot_lru)]


def _positions(req_slot, k, hot_pos, max_pos, hit_frac, none_frac, g):
    """[T, K] distinct positions per row: about hit_frac of them from the request's hot rows,
    the rest anywhere; about none_frac of the columns −1."""
    rows = []
    for s in req_slot.tolist():
        held = hot_pos[s, :-1].cpu()
        held = held[held >= 0][torch.randperm(int((held >= 0).sum()), generator=g)]
        n_hot = min(int(k * hit_frac), held.numel())
        rest = torch.randperm(max_pos, generator=g)
        rest = rest[~torch.isin(rest, held[:n_hot])][: k - n_hot]
        row = torch.cat([held[:n_hot], rest])[torch.randperm(k, generator=g)]
        row[torch.rand(k, generator=g) < none_frac] = -1
        rows.append(row)
    return torch.stack(rows)


def _run_steps(
    mod, *, t, k, h, r, pages, bs, steps, device, seed, hit_frac=0.5, none_frac=0.1,
    pos_dtype=torch.int64, step_tensor=(False, True), old_frac=0.0, now=100, **kw,
):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    page_table, host_table, hot_slots, hot_pos, hot_lru = _state(
        r, h, pages, bs, 2, g, old_frac=old_frac, now=now, device=device
    )
    ref_pos, ref_lru = hot_pos.clone(), hot_lru.clone()
    trash = 999_999
    for i in range(steps):
        req_slot = torch.randperm(r, generator=g)[:t].to(device)
        pos = _positions(req_slot, k, hot_pos[1], pages * bs, hit_frac, none_frac, g)
        pos = pos.to(device=device, dtype=pos_dtype)
        step = now + i
        want = resolve_ref(pos, req_slot, page_table, host_table, hot_slots, ref_pos[1], ref_lru[1],
                       step, trash, bs)  # fmt: skip
        use_tensor = step_tensor[i % len(step_tensor)]
        st = torch.tensor([step], device=device) if use_tensor else step
        got = mod.resolve_fused(pos, req_slot, page_table, host_table, hot_slots, hot_pos[1],
                                hot_lru[1], st, trash, bs, **kw)  # fmt: skip
        for name in ("slots", "src", "dest", "miss"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), f"step {i}: {name}"
        for name in ("hits", "num_miss", "num_resident"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.shape == () and a.dtype == torch.int64 and a.device == b.device
            assert int(a) == int(b), f"step {i}: {name} {int(a)} != {int(b)}"
        assert torch.equal(hot_pos[..., :h], ref_pos[..., :h]), f"step {i}: hot_pos"
        assert torch.equal(hot_lru[..., :h], ref_lru[..., :h]), f"step {i}: hot_lru"
        assert torch.equal(hot_pos[0], ref_pos[0]) and torch.equal(hot_lru[0], ref_lru[0])
    return int(want.hits), int(want.num_miss)


# ---- CPU: Triton interpreter, tiny shapes ------------------------------------------------------
@pytest.mark.parametrize(
    "case",
    [
        dict(t=3, k=8, h=16, r=5, pages=12, bs=4),
        dict(t=3, k=8, h=16, r=5, pages=12, bs=4, wide_keys=True, pos_dtype=torch.int32),
        dict(t=2, k=6, h=12, r=3, pages=9, bs=4, hit_frac=0.7),  # K, H not powers of two
        dict(t=3, k=8, h=8, r=4, pages=10, bs=4, hit_frac=0.3, none_frac=0.3),  # K == H
        dict(t=2, k=4, h=16, r=2, pages=6, bs=4, hit_frac=1.0, none_frac=0.0),  # H = 4·K
        # stamps 0..3 and ~2^40: 32-bit victim keys with the recent stamps clamped when the
        # old rows cover the misses, else 64-bit keys
        dict(t=3, k=8, h=16, r=4, pages=12, bs=4, old_frac=0.3, now=1 << 40),
        dict(t=3, k=8, h=16, r=4, pages=12, bs=4, old_frac=0.1, hit_frac=0.2, now=1 << 40),
    ],
)
def test_resolve_fused_interpreter(interp, case):
    _run_steps(interp("hisparse_resolve"), steps=4, device="cpu", seed=len(case) + case["k"],
               num_warps=4, **case)  # fmt: skip


def test_resolve_fused_interpreter_corners(interp):
    mod = interp("hisparse_resolve")
    g = torch.Generator().manual_seed(3)
    page_table, host_table, hot_slots, hot_pos, hot_lru = _state(2, 8, 4, 4, 1, g)
    hp, hl = hot_pos[0], hot_lru[0]
    cases = [
        torch.full((2, 4), -1),  # nothing selected
        torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]),  # pages 0 and 1: whatever is resident
    ]
    page_table[:] = 5  # then everything resident: no hot-buffer work at all
    cases.append(torch.tensor([[8, 9, -1, 15], [3, 2, 1, 0]]))
    for i, pos in enumerate(cases):
        req = torch.tensor([1, 0])
        rp, rl = hp.clone(), hl.clone()
        want = resolve_ref(pos, req, page_table, host_table, hot_slots, rp, rl, i, 77, 4)
        got = mod.resolve_fused(pos, req, page_table, host_table, hot_slots, hp, hl, i, 77, 4)
        for name in ("slots", "src", "dest", "miss", "hits", "num_miss", "num_resident"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (i, name)
        assert torch.equal(hp[:, :8], rp[:, :8]) and torch.equal(hl[:, :8], rl[:, :8])


@pytest.mark.slow
def test_resolve_fused_interpreter_glm_shapes(interp):
    """K = 2048, H = 4096 on the interpreter (~15 s per token): 32-bit keys, partial victim sort;
    old stamps 2^40 back make some steps take the 64-bit victim keys."""
    _run_steps(interp("hisparse_resolve"), t=2, k=2048, h=4096, r=3, pages=2048, bs=64, steps=2,
               device="cpu", seed=2, hit_frac=0.5, old_frac=0.03, now=1 << 40)  # fmt: skip


# ---- GPU: GLM-5.3 shapes (topk 2048, hot buffer 2·topk) ------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("hit_frac", [0.0, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("wide_keys,old_frac", [(None, 0.0), (True, 0.0), (None, 0.03)])
def test_resolve_fused_gpu(hit_frac, wide_keys, old_frac):
    from vllm.kernels.triton import hisparse_resolve as mod

    hits, misses = _run_steps(
        mod, t=64, k=2048, h=4096, r=80, pages=2048, bs=64, steps=4, device="cuda",
        seed=int(hit_frac * 10), hit_frac=hit_frac, none_frac=0.05, wide_keys=wide_keys,
        old_frac=old_frac, now=(1 << 40) if old_frac else 100,
    )  # fmt: skip
    assert hits + misses > 0


@pytest.mark.gpu
def test_resolve_fused_gpu_odd_shapes():
    from vllm.kernels.triton import hisparse_resolve as mod

    _run_steps(mod, t=37, k=1000, h=3000, r=40, pages=700, bs=64, steps=3, device="cuda",
               seed=5, hit_frac=0.8, pos_dtype=torch.int32)  # fmt: skip


@pytest.mark.gpu
def test_resolve_fused_gpu_cuda_graph():
    """Captured once with a device step; replays match the reference step by step."""
    from vllm.kernels.triton import hisparse_resolve as mod

    g = torch.Generator().manual_seed(11)
    t, k, h, r, pages, bs = 16, 2048, 4096, 16, 1024, 64
    page_table, host_table, hot_slots, hot_pos, hot_lru = _state(
        r, h, pages, bs, 1, g, device="cuda"
    )
    ref_pos, ref_lru = hot_pos.clone(), hot_lru.clone()
    req = torch.randperm(r, generator=g)[:t].cuda()
    pos = torch.empty(t, k, dtype=torch.int64, device="cuda")
    step = torch.zeros(1, dtype=torch.int64, device="cuda")
    args = (pos, req, page_table, host_table, hot_slots, hot_pos[0], hot_lru[0], step, 5, bs)
    pos.copy_(_positions(req, k, hot_pos[0], pages * bs, 0.9, 0.05, g))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) on scratch copies of the state
        hp0, hl0 = hot_pos.clone(), hot_lru.clone()
        mod.resolve_fused(*args)
        hot_pos.copy_(hp0), hot_lru.copy_(hl0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mod.resolve_fused(*args)
    hot_pos.copy_(hp0), hot_lru.copy_(hl0)
    for i in range(3):
        pos.copy_(_positions(req, k, hot_pos[0], pages * bs, 0.9, 0.05, g).cuda())
        step.fill_(50 + i)
        graph.replay()
        want = resolve_ref(pos, req, page_table, host_table, hot_slots, ref_pos[0], ref_lru[0],
                       50 + i, 5, bs)  # fmt: skip
        for name in ("slots", "src", "dest", "miss", "hits", "num_miss", "num_resident"):
            assert torch.equal(getattr(out, name), getattr(want, name)), (i, name)
        assert torch.equal(hot_pos[..., :h], ref_pos[..., :h])
        assert torch.equal(hot_lru[..., :h], ref_lru[..., :h])
