"""RMSNorm and rotary embedding: the references against independent formulas, the Triton kernels
(CPU interpreter; compiled on the GPU) against the references, in place inside a larger head."""

from __future__ import annotations

import pytest
import torch

from vllm.kernels.norm_rope import (
    QUANT_MAX_ROWS,
    add_rms_norm,
    add_rms_norm_quant,
    apply_rope,
    apply_rope_ref,
    rms_norm,
    rms_norm_quant,
    rms_norm_ref,
)

FP32 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=2**-7, atol=1e-3)  # one bf16 unit in the last place


def _angles(t: int, half: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(t, half, generator=g) * 50
    return a.cos(), a.sin()


def test_rope_reference_is_a_complex_rotation():
    """Pairs (interleaved) or halves (NeoX) rotate as complex numbers times e^{i·angle}."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 8, generator=g, dtype=torch.float64).float()
    cos, sin = _angles(5, 4)
    e = torch.complex(cos, sin).unsqueeze(1)  # [T, 1, 4]
    pairs = torch.view_as_complex(x.view(5, 3, 4, 2).contiguous())
    want = torch.view_as_real(pairs * e).flatten(-2)
    torch.testing.assert_close(apply_rope_ref(x, cos, sin, True), want, rtol=1e-5, atol=1e-5)
    halves = torch.complex(x[..., :4], x[..., 4:]) * e
    want = torch.cat([halves.real, halves.imag], -1)
    torch.testing.assert_close(apply_rope_ref(x, cos, sin, False), want, rtol=1e-5, atol=1e-5)


def test_rms_norm_reference():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 16, generator=g, dtype=torch.float64)
    w = torch.randn(16, generator=g, dtype=torch.float64)
    want = w * x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6), want)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))  # CPU: the reference


def test_op_writes_in_place_on_the_reference_path():
    """``out`` a view of a larger tensor (the rope half of each head): only it changes."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(6, 4, 24, generator=g)
    before = q.clone()
    cos, sin = _angles(6, 4)
    r = apply_rope(q[..., 16:], cos, sin, True, out=q[..., 16:])
    assert r.data_ptr() == q[..., 16:].data_ptr()
    assert torch.equal(q[..., :16], before[..., :16])
    assert torch.equal(q[..., 16:], apply_rope_ref(before[..., 16:], cos, sin, True))


def _rope_cases(dtype):
    g = torch.Generator().manual_seed(4)
    for t, h, d, interleave in [(7, 5, 16, True), (3, 1, 8, False), (1, 17, 64, True)]:
        base = torch.randn(t, h, d + 12, generator=g).to(dtype)
        cos, sin = _angles(t, d // 2, seed=t)
        yield base, cos, sin, d, interleave


def _check_rope(mod, dtype, tol, dev="cpu"):
    for base, cos, sin, _d, interleave in _rope_cases(dtype):
        base, cos, sin = base.to(dev), cos.to(dev), sin.to(dev)
        x = base[..., 12:]  # strided [T, H, d]: the rope dims after 12 others in each head
        want = apply_rope_ref(x, cos, sin, interleave)
        out = mod.apply_rope(x, cos, sin, interleave)  # a new tensor
        torch.testing.assert_close(out.float(), want.float(), **tol)
        inplace = base.clone()
        mod.apply_rope(inplace[..., 12:], cos, sin, interleave, out=inplace[..., 12:])
        assert torch.equal(inplace[..., :12], base[..., :12])
        torch.testing.assert_close(inplace[..., 12:].float(), want.float(), **tol)
        k = base[:, 0, 12:]  # [T, d] with a row stride: a key's rope slice
        torch.testing.assert_close(
            mod.apply_rope(k, cos, sin, interleave).float(),
            apply_rope_ref(k, cos, sin, interleave).float(),
            **tol,
        )


def _check_norm(mod, dtype, tol, dev="cpu"):
    g = torch.Generator().manual_seed(5)
    for n, d in [(5, 16), (1, 48), (9, 64), (3, 6144)]:
        wide = torch.randn(n, d + 8, generator=g).to(dtype).to(dev)
        x = wide[:, :d]  # row-strided (a split of a fused projection)
        w = (torch.randn(d, generator=g) * 0.5 + 1).to(dtype).to(dev)
        got = mod.rms_norm(x, w, 1e-5)
        assert got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got.float(), rms_norm_ref(x, w, 1e-5).float(), **tol)
    x3 = torch.randn(2, 3, 32, generator=g).to(dtype).to(dev)
    w = torch.ones(32, dtype=dtype, device=dev)
    torch.testing.assert_close(
        mod.rms_norm(x3, w, 1e-5).float(), rms_norm_ref(x3, w, 1e-5).float(), **tol
    )


def test_kernels_interpreter(interp):
    """fp32 (the interpreter's bf16 arithmetic is not the GPU's): equal to rounding."""
    mod = interp("norm_rope")
    _check_rope(mod, torch.float32, FP32)
    _check_norm(mod, torch.float32, FP32)


def test_rope_bf16_pairs_interpreter(interp):
    """bf16 interleaved pairs as 32-bit words (unpacked, rotated in fp32, rounded to nearest
    even by integer arithmetic): bit-equal to the reference's rotation and cast, in place and
    not; an odd offset (pairs not word-aligned) takes the element path."""
    mod = interp("norm_rope")
    g = torch.Generator().manual_seed(6)
    for t, h, d, off in [(5, 3, 16, 12), (2, 64, 64, 192), (9, 1, 8, 0)]:
        base = torch.randn(t, h, off + d, generator=g).bfloat16()
        cos, sin = _angles(t, d // 2, seed=t)
        x = base[..., off:]
        want = apply_rope_ref(x, cos, sin, True)
        assert torch.equal(mod.apply_rope(x, cos, sin, True), want)
        inplace = base.clone()
        mod.apply_rope(inplace[..., off:], cos, sin, True, out=inplace[..., off:])
        assert torch.equal(inplace[..., :off], base[..., :off])
        assert torch.equal(inplace[..., off:], want)
    # rounding: values halfway between two bf16 numbers (ties to even) and NaN survive as torch's
    x = torch.tensor([[1.0, 0.0, float("nan"), 1.0, 3.0, -0.0, 1.0, 1.0]]).bfloat16()
    cos = torch.tensor([[1.0 + 2**-8, 1.0, 1.0 + 3 * 2**-8, 0.5]])
    sin = torch.tensor([[0.0, 0.25, 0.0, -0.5]])
    # a NaN angle whose payload is all ones (a carry out of it would read as a number)
    cos[0, 3] = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)[0]
    want = apply_rope_ref(x, cos, sin, True)
    got = mod.apply_rope(x, cos, sin, True)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    odd = torch.randn(3, 2, 17, generator=g)[..., 1:]  # fp32 with an odd offset: element path
    cos, sin = _angles(3, 8)
    torch.testing.assert_close(
        mod.apply_rope(odd, cos, sin, True), apply_rope_ref(odd, cos, sin, True), **FP32
    )


@pytest.mark.gpu
def test_kernels_on_gpu():
    """Compiled, bf16: within one bf16 unit of the reference (FMA contraction, sum order)."""
    from vllm.kernels.triton import norm_rope as mod

    _check_rope(mod, torch.bfloat16, BF16, "cuda")
    _check_norm(mod, torch.bfloat16, BF16, "cuda")
    _check_rope(mod, torch.float32, FP32, "cuda")
    # the packed bf16 pairs compiled, in place at the MLA query's rope offset
    g = torch.Generator().manual_seed(7)
    x = torch.randn(300, 64, 256, generator=g).bfloat16().cuda()
    cos, sin = (a.cuda() for a in _angles(300, 32))
    want = apply_rope_ref(x[..., 192:], cos, sin, True)
    mod.apply_rope(x[..., 192:], cos, sin, True, out=x[..., 192:])
    torch.testing.assert_close(x[..., 192:].float(), want.float(), **BF16)


@pytest.mark.parametrize(
    "n,d,row_multiple,split_g",
    [(3, 256, 1, None), (5, 300, 16, None), (1, 384, 1, 4), (4, 1000, 8, 2), (2, 640, 1, 1)],
)
def test_rms_norm_quant_interpreter(interp, n, d, row_multiple, split_g):
    """RMSNorm fused with the per-token-group quantisation of its output: the same norm output
    and the same e4m3 bytes and scales as the two kernels one after the other (a partial last
    group at D = 300 and 1,000; rows padded as cuBLAS's path pads them; a row's groups split over
    programs, the last chunk partial at D = 1,000 in chunks of 2; odd row counts on a row-strided
    view)."""
    nr = interp("norm_rope")
    fq = interp("fp8_gemm")
    g = torch.Generator().manual_seed(n + d)
    x = (torch.randn(n, d + 64, generator=g) * 3)[:, :d]
    if n % 2 == 0:  # odd n: the row-strided view, as the q_a part of the q_a+kv_a output
        x = x.contiguous()
    w = torch.rand(d, generator=g) + 0.5
    y, q, s = nr.rms_norm_quant(x, w, 1e-6, 128, row_multiple, split_g)
    y2 = nr.rms_norm(x, w, 1e-6)
    q2, s2 = fq.quant_per_token_group(y2, 128, row_multiple)
    assert torch.equal(y, y2)
    assert q.shape == q2.shape and s.shape == s2.shape and s.stride() == s2.stride()
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(s, s2)


def test_rms_norm_quant_needs_two_groups(interp, monkeypatch):
    """One group a row would make the one program's quantised stores decide the sum's layout
    (rms_norm_quant's comment): refused by the kernel, not fused by the op (the interpreter's
    kernel standing in for CUDA's, as in the dispatch test below)."""
    from vllm.kernels import norm_rope as op

    nr = interp("norm_rope")
    monkeypatch.setattr(op, "kernel_module", lambda name, t, ok=True: nr if ok else None)
    x, w = torch.randn(2, 128), torch.rand(128) + 0.5
    with pytest.raises(ValueError, match="two groups"):
        nr.rms_norm_quant(x, w, 1e-6)
    assert op.rms_norm_quant(x, w, 1e-6)[1] is None
    assert op.rms_norm_quant(torch.randn(2, 256), torch.rand(256) + 0.5, 1e-6)[1] is not None


def test_rms_norm_quant_dispatch(interp, monkeypatch):
    """The op fuses the quantisation only at decode sizes (up to QUANT_MAX_ROWS rows) with groups
    of 128: the interpreter's kernel stands in for CUDA's there, and gives the quantiser's bytes;
    with more rows, another group, or CPU tensors it is rms_norm alone (the GEMM quantises)."""
    from vllm.kernels import norm_rope as op

    nr, fq = interp("norm_rope"), interp("fp8_gemm")
    g = torch.Generator().manual_seed(3)
    w = torch.rand(256, generator=g) + 0.5
    x = torch.randn(4, 256, generator=g)
    y, xq = rms_norm_quant(x, w, 1e-6)  # CPU tensors: no kernel
    assert xq is None and torch.equal(y, rms_norm_ref(x, w, 1e-6))
    monkeypatch.setattr(op, "kernel_module", lambda name, t, ok=True: nr if ok else None)
    for rows, group, fused in ((1, 128, True), (QUANT_MAX_ROWS, 128, True),
                               (QUANT_MAX_ROWS + 1, 128, False), (4, 64, False)):  # fmt: skip
        x = torch.randn(rows, 256, generator=g)
        y, xq = rms_norm_quant(x, w, 1e-6, group)
        assert (xq is not None) == fused, (rows, group)
        if fused:
            q2, s2 = fq.quant_per_token_group(y, 128)
            assert torch.equal(xq[0].view(torch.uint8), q2.view(torch.uint8))
            assert torch.equal(xq[1], s2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "n,d,row_multiple,split_g",
    [
        (1, 6144, 1, None),
        (64, 6144, 1, None),
        (37, 7168, 16, 2),
        (64, 6144, 1, 64),
        (9, 2048, 1, 4),
    ],
)
def test_rms_norm_quant_gpu(n, d, row_multiple, split_g):
    """Compiled, bf16: the fused norm + quantisation gives the two kernels' bits."""
    from vllm.kernels.triton import fp8_gemm as fq
    from vllm.kernels.triton import norm_rope as nr

    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16) * 3
    w = (torch.rand(d, device="cuda") + 0.5).to(torch.bfloat16)
    y, q, s = nr.rms_norm_quant(x, w, 1e-6, 128, row_multiple, split_g)
    y2 = nr.rms_norm(x, w, 1e-6)
    q2, s2 = fq.quant_per_token_group(y2, 128, row_multiple)
    assert torch.equal(y, y2)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)


def _check_add_norm(nr, fq, dtype, dev="cpu"):
    """The residual forms against the add then the plain kernels: the same bits (the sum rounded
    to x's dtype as torch's add, then the same tile and warps), row-strided inputs included."""
    g = torch.Generator().manual_seed(11)
    for n, d in [(5, 16), (1, 256), (3, 300), (4, 6144)]:
        x = (torch.randn(n, d + 8, generator=g) * 3).to(dtype).to(dev)[:, :d]
        r = (torch.randn(n, d, generator=g) * 3).to(dtype).to(dev)
        w = (torch.rand(d, generator=g) + 0.5).to(dtype).to(dev)
        s_want = x + r
        y, s = nr.rms_norm(x, w, 1e-6, r)
        assert torch.equal(s, s_want) and s.dtype == dtype
        assert torch.equal(y, nr.rms_norm(s_want, w, 1e-6))
        if d >= 128:
            for split in (None, 1):
                y, q, sc, s = nr.rms_norm_quant(x, w, 1e-6, 128, 16, split, residual=r)
                y2, q2, sc2 = nr.rms_norm_quant(s_want, w, 1e-6, 128, 16, split)
                assert torch.equal(s, s_want) and torch.equal(y, y2)
                assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
                assert torch.equal(sc, sc2)
                qq, ss = fq.quant_per_token_group(y2, 128, 16)
                assert torch.equal(q.view(torch.uint8), qq.view(torch.uint8))


def test_add_norm_interpreter(interp):
    _check_add_norm(interp("norm_rope"), interp("fp8_gemm"), torch.float32)


def test_add_norm_ops_reference_and_dispatch(interp, monkeypatch):
    """CPU tensors: the add then the reference; the interpreter's kernel in the kernels' place
    gives the same (y, s) and, at decode sizes, the quantiser's bytes of y."""
    from vllm.kernels import norm_rope as op

    g = torch.Generator().manual_seed(4)
    x, r = torch.randn(4, 256, generator=g), torch.randn(4, 256, generator=g)
    w = torch.rand(256, generator=g) + 0.5
    y, s = add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, x + r) and torch.equal(y, rms_norm_ref(x + r, w, 1e-6))
    y, s, xq = add_rms_norm_quant(x, r, w, 1e-6)
    assert xq is None and torch.equal(s, x + r) and torch.equal(y, rms_norm_ref(x + r, w, 1e-6))
    nr, fq = interp("norm_rope"), interp("fp8_gemm")
    monkeypatch.setattr(op, "kernel_module", lambda name, t, ok=True: nr if ok else None)
    for rows, fused in ((3, True), (QUANT_MAX_ROWS + 1, False)):
        x, r = torch.randn(rows, 256, generator=g), torch.randn(rows, 256, generator=g)
        y, s, xq = add_rms_norm_quant(x, r, w, 1e-6)
        assert torch.equal(s, x + r) and torch.equal(y, nr.rms_norm(x + r, w, 1e-6))
        assert (xq is not None) == fused
        if fused:
            q2, s2 = fq.quant_per_token_group(y, 128)
            assert torch.equal(xq[0].view(torch.uint8), q2.view(torch.uint8))
            assert torch.equal(xq[1], s2)
    # a residual of another shape or dtype: the add then the norm, not the kernel
    y, s = add_rms_norm(x, r[:1], w, 1e-6)
    assert torch.equal(s, x + r[:1])


@pytest.mark.gpu
def test_add_norm_gpu():
    """Compiled, bf16: the residual forms give the add then the plain kernels' bits."""
    from vllm.kernels.triton import fp8_gemm as fq
    from vllm.kernels.triton import norm_rope as nr

    _check_add_norm(nr, fq, torch.bfloat16, "cuda")
