"""Grouped-GEMM routed experts against experts_ref.

CPU: the padded expert-sorted layout (torch only), then the kernel in the Triton interpreter in
fp32 (its bf16 arithmetic is wrong): 1e-4, the fp32 sum order and the routing-weight product
(the reference rounds before weighting) differ. GPU: GLM-5.3-like shapes in bf16, 2e-2: both
round gate/up and SiLU·up to bf16, so an accumulation-order flip moves a value by a bf16 ulp.
"""

from __future__ import annotations

import pytest
import torch

from vllm.kernels import moe


def _case(t, e_loc, k, h, i, offset, e_total, dtype=torch.float32, seed=0, skip=()):
    """Random experts and routing; ``skip``: global expert ids no token chooses."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e_loc, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e_loc, h, i, generator=g) / i**0.5).to(dtype)
    pool = torch.tensor([e for e in range(e_total) if e not in skip])
    rows = [pool[torch.randperm(pool.numel(), generator=g)[:k]] for _ in range(t)]
    ids = torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.long)
    w = torch.rand(t, k, generator=g)
    return x, w13, w2, ids, w, offset


# ---- CPU: the padded layout (no kernel) --------------------------------------------------------
@pytest.mark.parametrize("form", ["sort", "scan"])
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize(
    "t,e_loc,k,offset,e_total",
    [(1, 4, 2, 0, 4), (40, 6, 3, 0, 6), (37, 4, 3, 4, 16), (9, 4, 2, 8, 8), (300, 3, 2, 0, 3)],
)
def test_layout_invariants(t, e_loc, k, offset, e_total, block_m, form):
    pytest.importorskip("triton")
    from vllm.kernels.triton.moe_grouped import sort_pairs_by_expert

    _, _, _, ids, _, _ = _case(t, e_loc, k, 8, 8, offset, e_total, seed=t + block_m)
    pairs, block_expert = sort_pairs_by_expert(ids, offset, e_loc, block_m, form)
    p = t * k
    nb = min(-(-p // block_m) + e_loc, p)
    assert pairs.dtype == block_expert.dtype == torch.int32
    assert pairs.shape == (nb * block_m,) and block_expert.shape == (nb,)
    local = ids.reshape(-1) - offset
    valid = ((local >= 0) & (local < e_loc)).tolist()
    slots = pairs.view(nb, block_m).tolist()
    be = block_expert.tolist()
    used = [b for b in be if b >= 0]
    assert be == used + [-1] * (nb - len(used))  # -1 only past the end
    assert used == sorted(used)  # experts in order, each a run of whole blocks
    seen = []
    for b, row in enumerate(slots):
        filled = [q for q in row if q < p]
        assert all(q == p for q in row[len(filled) :])  # pairs first, then empty slots
        if be[b] < 0:
            assert not filled
            continue
        assert filled  # no block without a pair
        assert all(valid[q] and local[q] == be[b] for q in filled)
        seen += filled
    assert sorted(seen) == [q for q in range(p) if valid[q]]  # each valid pair exactly once
    for e in range(e_loc):  # stable: a run keeps pair order
        run = [q for q in seen if local[q] == e]
        assert run == sorted(run)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["cpu", "cuda"]
)
@pytest.mark.parametrize("seed", range(6))
def test_layout_scan_equals_sort(seed, device):
    """The one-hot prefix-sum ranking and the stable sort give the same slots, on random
    routings with experts of other ranks, unchosen experts and 256 local experts."""
    pytest.importorskip("triton")
    from vllm.kernels.triton.moe_grouped import sort_pairs_by_expert

    g = torch.Generator().manual_seed(seed)
    t = int(torch.randint(1, 700, (1,), generator=g))
    e_loc = [3, 32, 256][seed % 3]
    k = min(8, e_loc)
    offset = [0, e_loc, 2 * e_loc][seed % 3]
    e_total = 4 * e_loc
    ids = torch.randint(0, e_total, (t, k), generator=g)
    if seed % 2:  # a skewed routing: most pairs on a few experts
        ids = torch.where(torch.rand(t, k, generator=g) < 0.7, offset + ids % 3, ids)
    ids = ids.to(device)
    for block_m in (16, 64):
        a = sort_pairs_by_expert(ids, offset, e_loc, block_m, form="sort")
        b = sort_pairs_by_expert(ids, offset, e_loc, block_m, form="scan")
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _one_program_cases():
    g = torch.Generator().manual_seed(7)
    cases = []
    for t, e_loc, k, offset, block_m in [(1, 4, 2, 0, 16), (37, 4, 3, 4, 16), (64, 32, 8, 32, 16),
                                         (256, 32, 8, 0, 16), (9, 256, 8, 256, 64),
                                         (512, 256, 8, 0, 64), (300, 3, 2, 0, 16)]:  # fmt: skip
        ids = torch.randint(0, 4 * e_loc, (t, k), generator=g)
        if t % 2:  # skewed: most pairs on a few experts
            ids = torch.where(torch.rand(t, k, generator=g) < 0.7, offset + ids % 3, ids)
        cases.append((ids, offset, e_loc, block_m))
    return cases


def _check_kernel_forms(device, forms=("one_program", "counting")):
    from vllm.kernels.triton.moe_grouped import sort_pairs_by_expert

    for ids, offset, e_loc, block_m in _one_program_cases():
        ids = ids.to(device)
        ref = sort_pairs_by_expert(ids, offset, e_loc, block_m, form="sort")
        for form in forms:
            got = sort_pairs_by_expert(ids, offset, e_loc, block_m, form=form)
            assert torch.equal(got[0], ref[0]), (form, ids.shape, e_loc, block_m)
            assert torch.equal(got[1], ref[1]), (form, ids.shape, e_loc, block_m)


def test_layout_one_program_interpreter(interp):
    """The one-program layout (histogram, one sort of packed keys, ranks by gather) gives the
    torch form's slots, skewed routings and other ranks' experts included."""
    interp("moe_grouped")
    _check_kernel_forms("cpu", ("one_program",))


def test_layout_counting_interpreter(interp):
    """The counting sort's layout (its three launches, then a program per padded block) gives
    the torch form's slots on the same routings, and on ones past the one program's limits:
    more than a sort block of pairs (blocks ranked across programs) and 600 local experts."""
    interp("moe_grouped")
    _check_kernel_forms("cpu", ("counting",))
    from vllm.kernels.triton.moe_grouped import sort_pairs_by_expert

    g = torch.Generator().manual_seed(11)
    for t, e_loc, e_total, block_m in [(300, 8, 16, 16), (160, 600, 1200, 64)]:
        ids = torch.randint(0, e_total, (t, 8), generator=g)
        ids = torch.where(torch.rand(t, 8, generator=g) < 0.5, ids % 3, ids)  # skewed
        ref = sort_pairs_by_expert(ids, 0, e_loc, block_m, form="sort")
        got = sort_pairs_by_expert(ids, 0, e_loc, block_m, form="counting")
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (t, e_loc)


def test_layout_form_errors():
    from vllm.kernels.triton.moe_grouped import ONE_PROGRAM_MAX_PAIRS, sort_pairs_by_expert

    ids = torch.zeros(ONE_PROGRAM_MAX_PAIRS + 1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="one-program layout holds"):
        sort_pairs_by_expert(ids, 0, 4, 16, form="one_program")
    with pytest.raises(ValueError, match="form 'radix'"):
        sort_pairs_by_expert(ids, 0, 4, 16, form="radix")


@pytest.mark.gpu
def test_layout_kernel_forms_gpu():
    _check_kernel_forms("cuda")


def test_forward_on_cpu_is_the_reference():
    """CPU tensors take the reference (the kernels are for CUDA tensors)."""
    args = _case(6, 4, 2, 16, 8, 0, 4, seed=3)
    assert torch.equal(moe.fused_experts(*args), moe.experts_ref(*args))


# ---- CPU: Triton interpreter, tiny shapes, fp32 ------------------------------------------------
@pytest.mark.parametrize(
    "t,e_loc,k,offset,e_total,block_m,skip",
    [
        (1, 4, 2, 0, 4, 64, ()),  # one token
        (40, 6, 3, 0, 6, 64, ()),  # counts not multiples of the block
        (40, 6, 3, 0, 6, 16, ()),  # 16-row tiles: several blocks per expert
        (23, 5, 1, 0, 5, 16, (2,)),  # k = 1; local expert 2 has no tokens
        (17, 4, 2, 4, 12, 16, (5,)),  # EP slice: offset 4, others' experts; an empty expert
        (30, 2, 3, 2, 8, 16, ()),  # two local experts of eight
    ],
)
def test_grouped_interpreter(interp, monkeypatch, t, e_loc, k, offset, e_total, block_m, skip):
    mod = interp("moe_grouped")
    monkeypatch.setitem(mod.TUNE, "block_m", block_m)
    x, w13, w2, ids, w, off = _case(t, e_loc, k, 32, 16, offset, e_total, seed=t, skip=skip)
    local = ids - off
    # a token with no local expert: its row is never read, so NaN there must not leak
    orphan = ~((local >= 0) & (local < e_loc)).any(1)
    x[orphan] = float("nan")
    ref = moe.experts_ref(x, w13, w2, ids, w, off)
    got = mod.experts_grouped(x, w13, w2, ids, w, off)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert got[orphan].eq(0).all()


def test_grouped_interpreter_all_experts_elsewhere(interp):
    """Every pair belongs to another rank: exactly zero, no NaN from the unwritten rows."""
    mod = interp("moe_grouped")
    x, w13, w2, ids, w, off = _case(9, 4, 2, 32, 16, 8, 8, seed=1)  # ids < 8, local 8..11
    got = mod.experts_grouped(x, w13, w2, ids, w, off)
    assert torch.equal(got, torch.zeros_like(x))


def test_grouped_interpreter_no_tokens(interp):
    mod = interp("moe_grouped")
    x, w13, w2, ids, w, off = _case(0, 4, 2, 32, 16, 0, 4)
    assert mod.experts_grouped(x, w13, w2, ids, w, off).shape == (0, 32)


# ---- GPU: GLM-5.3-like shapes, bf16 ------------------------------------------------------------
GPU_SHAPES = [
    # t, e_loc, k, h, i, offset, e_total
    (1, 32, 8, 1024, 2048, 32, 256),  # decode, one EP rank's experts
    (64, 32, 8, 1024, 2048, 0, 32),  # decode batch, every expert local
    (64, 8, 8, 1024, 256, 16, 64),  # EP slice, many tokens without a local expert
    (1000, 32, 8, 1024, 512, 0, 32),  # prefill chunk, several blocks per expert
    (1000, 8, 4, 6144, 256, 0, 8),  # model hidden size
]


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("t,e_loc,k,h,i,offset,e_total", GPU_SHAPES)
def test_grouped_gpu_bf16(monkeypatch, t, e_loc, k, h, i, offset, e_total, block_m):
    from vllm.kernels.triton import moe_grouped as mod

    monkeypatch.setitem(mod.TUNE, "block_m", block_m)
    case = _case(t, e_loc, k, h, i, offset, e_total, torch.bfloat16, seed=t + e_loc)
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in case]
    ref = moe.experts_ref(*args)
    got = mod.experts_grouped(*args)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(mod.experts_grouped(*args), got)  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("t", [65, 1000])
def test_forward_grouped_gpu(monkeypatch, t):
    """CUDA batches past DENSE_MAX_TOKENS go through the grouped kernel."""
    from vllm.kernels.triton import moe_grouped as mod

    case = _case(t, 32, 8, 1024, 512, 32, 256, torch.bfloat16, seed=t)
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in case]
    direct = mod.experts_grouped(*args)
    real, calls = mod.experts_grouped, []
    monkeypatch.setattr(mod, "experts_grouped", lambda *a: calls.append(1) or real(*a))
    got = moe.fused_experts(*args)
    assert calls and torch.equal(got, direct)
    torch.testing.assert_close(got.float(), moe.experts_ref(*args).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_pairs_interpreter(interp, dtype):
    """The k-slot sum reads only this rank's pairs: other ranks' rows hold NaN (the unset rows of
    the [T·k, H] buffer) and must not reach the output; slots summed in order, then cast."""
    mod = interp("moe_grouped")
    g = torch.Generator().manual_seed(5)
    t, k, h, off, e_loc = 7, 3, 1500, 4, 4  # H past one column block
    ids = torch.randint(0, 12, (t, k), generator=g)
    ids[0] = torch.tensor([0, 1, 11])  # no local slot
    ids[1] = torch.tensor([4, 5, 7])  # every slot local
    part = torch.randn(t * k, h, generator=g)
    local = ((ids >= off) & (ids < off + e_loc)).reshape(-1)
    part[~local] = float("nan")
    ref = part.nan_to_num(0.0).view(t, k, h).sum(1).to(dtype)
    got = mod.combine_pairs(part, ids, off, e_loc, dtype)
    assert got.dtype == dtype and not got.isnan().any()
    # fp32 exact to the sum order; bf16 within one ulp (the interpreter's cast truncates)
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got, ref, rtol=tol, atol=1e-6)
    assert got[0].eq(0).all()
