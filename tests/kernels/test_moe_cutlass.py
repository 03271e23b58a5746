"""FP8 routed experts through CUTLASS's grouped GEMM (``vllm/kernels/moe_cutlass.py``).

CPU: the pair sort (order, inverse, offsets), the grouped GEMM's reference against per-group
dequantised matmuls, and the whole path in torch (reference GEMMs) against ``experts_ref``.
Interpreter: the counting sort, the quantisation into the sorted rows, the gather, the combine
and the activation kernel's skipped rows and group-major scales, exactly; the CUDA path's steps
(``kernels_path``) around the GEMM's reference against the torch path.
GPU (Hopper with ``vllm._C`` built with CUTLASS): the op against its reference, the whole path
against ``experts_ref``, ``fused_experts``' dispatch, a CUDA graph.

Tolerance of the whole path against ``experts_ref`` (relative Frobenius 3e-2): the reference keeps
gate and up in fp32; this path rounds them to bf16 (relative δ ≤ 2^-9, ~1e-3 rms) before SiLU·up
is requantised to e4m3, and an element within δ of an e4m3 rounding boundary moves a whole step
(2^-4..2^-3): the output moves by ~sqrt(δ · step) ≈ 1e-2 (test_moe_grouped_fp8's argument with
this δ); the pair outputs' bf16 rounding adds ~1e-3. Measured on the CPU: 1.3-1.6e-2.
"""

from __future__ import annotations

import pytest
import torch

from vllm import _custom_ops as ops
from vllm.kernels import moe, moe_cutlass
from vllm.kernels.fp8_gemm import FP8_DTYPE, per_token_group_quant_fp8_ref

from .test_moe_grouped_fp8 import _case, _gpu_case, _rel


def _ids(t, k, e_total, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e_total, generator=g)[:k] for _ in range(t)])


# ---- CPU ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "t,k,e_loc,offset,e_total", [(37, 4, 6, 3, 16), (20, 2, 8, 0, 8), (5, 3, 2, 9, 12)]
)
def test_sort_pairs(t, k, e_loc, offset, e_total):
    ids = _ids(t, k, e_total, seed=t)
    order, pos, offsets, grp = moe_cutlass.sort_pairs_ref(ids, offset, e_loc)
    flat = ids.reshape(-1) - offset
    key = torch.where((flat >= 0) & (flat < e_loc), flat, e_loc)
    assert torch.equal(pos[order], torch.arange(t * k))  # pos is order's inverse
    assert torch.equal(key[order], key.sort(stable=True).values)
    assert torch.equal(grp, key[order])
    for e in range(e_loc):  # each expert's rows: its pairs, in pair order
        rows = order[offsets[e] : offsets[e + 1]]
        assert torch.equal(rows, torch.nonzero(key == e).flatten())
    assert offsets.dtype == torch.int32 and offsets[0] == 0
    assert offsets[-1] == ((flat >= 0) & (flat < e_loc)).sum()


def _grouped_case(e, n, k, counts, extra_rows=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = sum(counts) + extra_rows
    a = (torch.randn(p, k, generator=g) * 2).to(FP8_DTYPE)
    sa = torch.rand(k // 128 * p, generator=g) + 0.5  # group-major
    w = (torch.randn(e, n, k, generator=g) * 2).to(FP8_DTYPE)
    sw = torch.rand(e, k // 128, n // 128, generator=g) + 0.5
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    return a, sa, w, sw, offsets


def test_grouped_gemm_ref_against_dequantised():
    counts = [5, 0, 9, 1]
    a, sa, w, sw, offsets = _grouped_case(4, 256, 384, counts)
    out = torch.full((a.shape[0], 256), 7.0, dtype=torch.bfloat16)
    moe_cutlass.grouped_gemm_ref(a, sa, w, sw, offsets, out)
    g = 384 // 128
    for e in range(4):
        r0, r1 = offsets[e].item(), offsets[e + 1].item()
        sae = sa[g * r0 : g * r1].view(g, r1 - r0)  # group e's [K/128, m_e] block
        ad = a[r0:r1].float() * sae.t().repeat_interleave(128, 1)  # [m_e, K]
        wd = w[e].float() * sw[e].t().repeat_interleave(128, 0).repeat_interleave(128, 1)  # [N, K]
        # one bf16 rounding of an fp32 sum (in another order than the block-wise one)
        torch.testing.assert_close(out[r0:r1].float(), ad @ wd.t(), rtol=2**-8, atol=1e-2)
    assert out[offsets[-1] :].eq(7.0).all()  # rows past the groups untouched


@pytest.mark.parametrize(
    "t,e_loc,k,h,i,offset,e_total", [(40, 4, 3, 256, 128, 0, 4), (30, 3, 4, 128, 256, 2, 8)]
)
def test_path_in_torch_against_ref(t, e_loc, k, h, i, offset, e_total):
    x, q13, q2, ids, w, off, s13, s2 = _case(t, e_loc, k, h, i, offset, e_total, seed=t)
    x = x.bfloat16()
    ref = moe.experts_ref(x, q13, q2, ids, w, off, s13, s2)
    got = moe_cutlass.experts_cutlass_fp8(x, q13, q2, ids, w, off, s13, s2)
    assert got.dtype == torch.bfloat16
    assert _rel(got, ref) < 3e-2
    # the producer's quantisation of x: the same bytes, the same result
    xq = per_token_group_quant_fp8_ref(x, 128)
    assert torch.equal(
        moe_cutlass.experts_cutlass_fp8(x, q13, q2, ids, w, off, s13, s2, x_quant=xq), got
    )


def test_path_rejects_odd_sizes():
    x, q13, q2, ids, w, off, s13, s2 = _case(4, 2, 2, 128, 96, 0, 2)
    with pytest.raises(ValueError, match="multiples of 128"):
        moe_cutlass.experts_cutlass_fp8(x, q13, q2, ids, w, off, s13, s2)


def test_unavailable_on_cpu_and_dispatch_keeps_ref():
    x, q13, q2, ids, w, off, s13, s2 = _case(4, 2, 2, 128, 128, 0, 2)
    assert moe_cutlass.unavailable(x, q13, q2) == "needs a CUDA device"
    assert moe_cutlass.takes(torch.zeros(64, 8), 4, None)  # 512 pairs over 4 experts
    assert not moe_cutlass.takes(torch.zeros(63, 8), 8, None)  # 63 pairs an expert: no
    assert not moe_cutlass.takes(torch.zeros(1024, 8), 32, 256)  # EP: the local share is small


# ---- interpreter -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "t,k,e_loc,offset,e_total",
    [(37, 4, 6, 3, 16), (313, 8, 20, 40, 64), (300, 8, 5, 100, 128), (2, 3, 4, 0, 4)],
)
def test_sort_pairs_kernels_interpreter(interp, t, k, e_loc, offset, e_total):
    """The three-launch counting sort gives the torch sort's four tensors exactly: one block and
    three (2,504 pairs: a partial last block), an EP share with empty experts, ranks' shares
    with few local pairs, every pair local."""
    mod = interp("moe_sort")
    ids = _ids(t, k, e_total, seed=t)
    if t == 300:  # skewed: most pairs on one local expert, some on none
        ids[: t // 2, 0] = offset + 1
    got = mod.sort_pairs(ids.to(torch.int32 if t == 313 else torch.int64), offset, e_loc)
    want = moe_cutlass.sort_pairs_ref(ids, offset, e_loc)
    for name, a, b in zip(("order", "pos", "offsets", "grp"), got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_sort_pairs_expert_limit(interp):
    """Past the bins the counting sort holds: refused by the kernel, the torch sort instead in
    the dispatch (on CPU the torch sort always)."""
    mod = interp("moe_sort")
    ids = _ids(4, 2, 8, seed=0)
    with pytest.raises(ValueError, match="local experts"):
        mod.sort_pairs(ids, 0, mod.SORT_MAX_BINS - 1)
    got = moe_cutlass.sort_pairs(ids, 0, mod.SORT_MAX_BINS - 1)
    assert torch.equal(got[0], moe_cutlass.sort_pairs_ref(ids, 0, mod.SORT_MAX_BINS - 1)[0])


def test_gather_interpreter(interp):
    mod = interp("moe_sorted")
    g = torch.Generator().manual_seed(1)
    t, k = 7, 256
    xq = torch.randn(t, k + 128, generator=g).to(FP8_DTYPE)[:, :k]  # a strided view
    sx = torch.rand(2, t, generator=g).t()  # M-contiguous scales, the quantiser's layout
    ids = _ids(t, 2, 8, seed=3)
    order, _, offsets, grp = moe_cutlass.sort_pairs(ids, 1, 4)
    src = order // 2
    n = offsets[-1:]
    a, sa = mod.gather_quantised_rows(xq, sx, src, grp, offsets, n)
    rows = offsets[-1].item()
    assert a.shape == (14, k) and sa.shape == (2 * 14,)
    assert torch.equal(a[:rows].view(torch.uint8), xq[src[:rows]].view(torch.uint8))
    want = moe_cutlass.group_major_ref(sx[src].t(), offsets)
    assert torch.equal(sa[: 2 * rows], want[: 2 * rows])


@pytest.mark.parametrize(
    "t,k,e_loc,offset,e_total,h", [(7, 2, 4, 1, 8, 256), (5, 3, 6, 0, 6, 1152)]
)
def test_quantise_sorted_rows_interpreter(interp, t, k, e_loc, offset, e_total, h):
    """Quantising into the sorted rows gives the bits of the quantiser followed by the gather:
    the local pairs' rows and their group-major scales (1152 columns: a program's 8 groups and
    a masked second block)."""
    mod = interp("moe_sorted")
    quant = interp("fp8_gemm")
    g = torch.Generator().manual_seed(t)
    x = (torch.randn(t, h + 64, generator=g) * 3)[:, :h]  # a strided view
    ids = _ids(t, k, e_total, seed=t + 1)
    order, pos, offsets, grp = moe_cutlass.sort_pairs(ids, offset, e_loc)
    n = offsets[-1:]
    a, sa = mod.quantise_sorted_rows(x, pos, grp, offsets, n)
    xq, sx = quant.quant_per_token_group(x.contiguous(), 128)
    want_a, want_sa = mod.gather_quantised_rows(xq, sx, order // k, grp, offsets, n)
    rows, ng = offsets[-1].item(), h // 128
    assert 0 < rows < t * k or e_loc == e_total
    assert torch.equal(a[:rows].view(torch.uint8), want_a[:rows].view(torch.uint8))
    assert torch.equal(sa[: ng * rows], want_sa[: ng * rows])


@pytest.mark.parametrize(
    "t,e_loc,k,h,i,offset,e_total", [(40, 4, 3, 256, 128, 0, 4), (30, 3, 4, 128, 256, 2, 8)]
)
@pytest.mark.parametrize("producer_quant", [False, True])
def test_kernels_path_interpreter(interp, t, e_loc, k, h, i, offset, e_total, producer_quant):
    """The CUDA path's steps (the Triton kernels: the counting sort, x quantised into the sorted
    rows or the producer's quantisation gathered, SiLU·up with group-major scales, the combine)
    around the GEMM's reference: the torch path's output, within the module docstring's bound.
    Not bit for bit here: the interpreter rounds to bf16 its own way (SiLU·up's product, the
    combine's output; test_activation.py), so most groups' scales move by an ulp and elements
    near an e4m3 boundary by a step (measured 1.6e-2). Wrong rows or scales would be O(1); the
    sort and the quantisation are exact (their own tests), and on the GPU the whole path is."""
    interp("moe_sorted")
    interp("activation")
    x, q13, q2, ids, w, off, s13, s2 = _case(t, e_loc, k, h, i, offset, e_total, seed=t)
    x = x.bfloat16()
    sw = [s.transpose(1, 2).contiguous() for s in (s13, s2)]
    xq = per_token_group_quant_fp8_ref(x, 128) if producer_quant else None
    args = (x, q13, q2, ids, w, off, *sw, xq)
    got = moe_cutlass.kernels_path(*args, gemm=moe_cutlass.grouped_gemm_ref)
    want = moe_cutlass.torch_path(*args)
    assert got.dtype == torch.bfloat16
    assert _rel(got, want) < 3e-2


def test_combine_interpreter(interp):
    mod = interp("moe_sorted")
    g = torch.Generator().manual_seed(2)
    t, k, h, e_loc, offset = 6, 3, 200, 4, 2
    ids = _ids(t, k, 8, seed=5)
    order, pos, offsets, _ = moe_cutlass.sort_pairs(ids, offset, e_loc)
    d = torch.randn(t * k, h, generator=g)
    d[offsets[-1] :] = float("nan")  # other ranks' rows: never read
    w = torch.rand(t, k, generator=g)
    got = mod.combine_sorted(d, pos, ids, w, offset, e_loc, torch.float32)
    want = moe_cutlass.combine_sorted_ref(d, pos, ids, w, offset, e_loc, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not got.isnan().any()


def test_activation_skips_rows_interpreter(interp):
    mod = interp("activation")
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
    h, q, s = mod.silu_and_mul_quant(x, 128)
    none, q2, s2 = mod.silu_and_mul_quant(
        x, 128, store_h=False, n_rows=torch.tensor([3], dtype=torch.int32)
    )
    assert none is None
    assert torch.equal(q2[:3].view(torch.uint8), q[:3].view(torch.uint8))
    assert torch.equal(s2[:3], s[:3])


def _check_group_major_scales(mod, t, k, e_loc, offset, i, device):
    ids = _ids(t, k, max(8, e_loc + offset), seed=i).to(device)
    _, _, offsets, grp = moe_cutlass.sort_pairs(ids, offset, e_loc)
    rows, p = offsets[-1].item(), t * k
    g = torch.Generator(device=device).manual_seed(i)
    x = (torch.randn(p, 2 * i, generator=g, device=device) * 3).to(
        torch.bfloat16 if device == "cuda" else torch.float32
    )
    _, q, s = mod.silu_and_mul_quant(x, 128, store_h=False)
    none, q2, s2 = mod.silu_and_mul_quant(
        x, 128, store_h=False, n_rows=offsets[-1:], groups=(grp, offsets)
    )
    ng = i // 128 + (i % 128 > 0)
    assert none is None and s2.shape == (ng * p,)
    assert torch.equal(q2[:rows].view(torch.uint8), q[:rows].view(torch.uint8))
    want = moe_cutlass.group_major_ref(s.t().contiguous(), offsets)
    assert torch.equal(s2[: ng * rows], want[: ng * rows])


@pytest.mark.parametrize("i", [384, 640])
def test_activation_group_major_scales_interpreter(interp, i):
    """Given the sorted rows' groups, SiLU·up's scales land in the grouped GEMM's group-major
    layout (the row-major scales rearranged by ``group_major_ref``), bytes unchanged; rows past
    the local count (other ranks' pairs) untouched (640 columns: a masked fifth group)."""
    _check_group_major_scales(interp("activation"), 9, 2, 5, 2, i, "cpu")


# ---- GPU ---------------------------------------------------------------------------------------
def _has_cutlass() -> bool:
    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability() == (9, 0)
        and ops.has_moe_grouped_fp8_gemm()
    )


needs_cutlass = pytest.mark.skipif(
    not _has_cutlass(), reason="needs a Hopper GPU and vllm._C built with CUTLASS"
)


@pytest.mark.gpu
@needs_cutlass
@pytest.mark.parametrize(
    "n,k,counts", [(256, 384, [5, 0, 130, 1, 300]), (6144, 2048, [700, 0, 129])]
)
def test_op_against_ref_gpu(n, k, counts):
    a, sa, w, sw, offsets = (x.cuda() for x in _grouped_case(len(counts), n, k, counts, seed=n))
    out = torch.full((a.shape[0], n), 7.0, dtype=torch.bfloat16, device="cuda")
    ops.moe_grouped_fp8_gemm(a, sa, w, sw, offsets, out)
    want = torch.empty_like(out)
    moe_cutlass.grouped_gemm_ref(a, sa, w, sw, offsets, want)
    rows = offsets[-1].item()
    # fp32 sums in another order (and the tensor cores' accumulation within a 128-deep block),
    # each rounded once to bf16
    assert _rel(out[:rows], want[:rows]) < 4e-3
    assert out[rows:].eq(7.0).all()  # rows past the groups untouched
    again = torch.full_like(out, 7.0)
    ops.moe_grouped_fp8_gemm(a, sa, w, sw, offsets, again)
    assert torch.equal(again, out)  # deterministic


@pytest.mark.gpu
@needs_cutlass
def test_op_checks_gpu():
    a, sa, w, sw, offsets = (x.cuda() for x in _grouped_case(2, 256, 256, [3, 4]))
    out = torch.empty(a.shape[0], 256, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="sa: contiguous fp32"):
        ops.moe_grouped_fp8_gemm(a, sa.view(2, -1), w, sw, offsets, out)
    with pytest.raises(RuntimeError, match="offsets"):
        ops.moe_grouped_fp8_gemm(a, sa, w, sw, offsets.long(), out)


@pytest.mark.gpu
@needs_cutlass
@pytest.mark.parametrize(
    "t,e_loc,k,h,i,offset,e_total",
    [(1024, 16, 8, 1024, 512, 0, 16), (600, 8, 8, 6144, 256, 8, 64), (64, 4, 2, 512, 128, 0, 8)],
)
def test_path_against_ref_gpu(t, e_loc, k, h, i, offset, e_total):
    x, *rest = _gpu_case(t, e_loc, k, h, i, offset, e_total, seed=t + i)
    x = x.bfloat16()
    ref = moe.experts_ref(x, *rest)
    got = moe_cutlass.experts_cutlass_fp8(x, *rest)
    assert got.dtype == torch.bfloat16
    assert _rel(got, ref) < 3e-2
    assert torch.equal(moe_cutlass.experts_cutlass_fp8(x, *rest), got)  # deterministic


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t,k,e_loc,offset,h", [(300, 8, 32, 64, 6144), (1000, 8, 256, 0, 2048)])
def test_quantise_sorted_rows_gpu(t, k, e_loc, offset, h):
    """Compiled (16-byte loads, specialised strides): quantising into the sorted rows gives the
    quantiser + gather's bits, EP's other-rank rows untouched."""
    from vllm.kernels.triton import fp8_gemm as tq
    from vllm.kernels.triton import moe_sorted

    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, h, device="cuda", generator=g, dtype=torch.bfloat16) * 4
    ids = _ids(t, k, 256, seed=t).cuda()
    order, pos, offsets, grp = moe_cutlass.sort_pairs(ids, offset, e_loc)
    n = offsets[-1:]
    a, sa = moe_sorted.quantise_sorted_rows(x, pos, grp, offsets, n)
    want_a, want_sa = moe_sorted.gather_quantised_rows(
        *tq.quant_per_token_group(x, 128), order // k, grp, offsets, n
    )
    rows = offsets[-1].item()
    assert torch.equal(a[:rows].view(torch.uint8), want_a[:rows].view(torch.uint8))
    assert torch.equal(sa[: h // 128 * rows], want_sa[: h // 128 * rows])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t,e_loc,offset", [(8192, 256, 0), (8192, 32, 64), (1, 32, 0)])
def test_sort_pairs_kernels_gpu(t, e_loc, offset):
    """Compiled, at GLM's top-8 of 256: the counting sort's tensors equal torch's stable sort's."""
    ids = torch.rand(t, 256, device="cuda").topk(8, dim=-1).indices
    got = moe_cutlass.sort_pairs(ids, offset, e_loc)
    want = moe_cutlass.sort_pairs_ref(ids, offset, e_loc)
    for name, a, b in zip(("order", "pos", "offsets", "grp"), got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t,k,e_loc,offset", [(1000, 8, 256, 0), (300, 8, 32, 64)])
def test_activation_group_major_scales_gpu(t, k, e_loc, offset):
    """Compiled, at GLM's I: the group-major scales are the row-major ones rearranged."""
    from vllm.kernels.triton import activation

    _check_group_major_scales(activation, t, k, e_loc, offset, 2048, "cuda")


@pytest.mark.gpu
@needs_cutlass
def test_path_quantisations_agree_gpu():
    """x quantised into the sorted rows by the path, or by its producer and gathered: same output."""
    from vllm.kernels.fp8_gemm import per_token_group_quant_fp8

    x, *rest = _gpu_case(600, 8, 8, 6144, 256, 8, 64, seed=11)
    x = x.bfloat16()
    got = moe_cutlass.experts_cutlass_fp8(x, *rest)
    via = moe_cutlass.experts_cutlass_fp8(x, *rest, x_quant=per_token_group_quant_fp8(x))
    assert torch.equal(got, via)


@pytest.mark.gpu
@needs_cutlass
def test_fused_experts_dispatch_and_graph_gpu(monkeypatch):
    """Prefill-sized FP8 batches go to the CUTLASS path, decode-sized ones to Triton; the CUTLASS
    path replays inside a CUDA graph (no host sync in its launches)."""
    x, *rest = _gpu_case(512, 16, 8, 1024, 512, 0, 16, seed=4)
    x = x.bfloat16()
    real, calls = moe_cutlass.experts_cutlass_fp8, []
    monkeypatch.setattr(
        moe_cutlass, "experts_cutlass_fp8", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    eager = moe.fused_experts(x, *rest)
    assert calls
    calls.clear()
    moe.fused_experts(x[:8], rest[0], rest[1], rest[2][:8], rest[3][:8], *rest[4:])
    assert not calls  # 64 pairs over 16 experts: the Triton kernel
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_experts(x, *rest)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, moe.fused_experts(x, *rest)) and not torch.equal(out, eager)
