"""FP8 block-scaled linear: the reference against exact arithmetic, the Triton kernels against
the reference.

CPU, reference: quantisation error per element within half an e4m3 step (2^-4 relative, 2^-10 ·
scale in the subnormal range); the product against x · dequant(W)ᵀ in fp64 within
Σ_k |err(x_k)| · |W_nk| (the weights are exact after dequantisation, so activation rounding is the
only error); its scales are the correctly rounded fp32 amax / 448 (on the GPU too: the reference
on CUDA equals the reference on the CPU bit for bit). Interpreter, fp32: the quantiser bit-exact;
the GEMM within 1e-5 (the same per-block products and scale order, only the fp32 sum order inside
a block differs). Decode path (activations quantised inside the GEMM, split-K summed inside it):
the same e4m3 bytes as quantise-then-GEMM (an identity weight returns xq · sx exactly), the same
result at the same config, and split or not within the fp32 sum order of the per-block terms
(bound below); the partials' order is fixed, so repeated calls agree bit for bit, and the arrival
counters are zero after every call. GPU: the quantiser bit-exact with the reference; GLM-5.3
shapes in bf16 against the reference on the same device, rtol 1e-2 with atol 1e-2 · max|y| (the
output's bf16 rounding is 2^-9 relative; Hopper's fp8 tensor cores add with ~14 bits inside a
128-deep block, which is why the scales are applied per block); cuBLAS's block-scaled GEMM the
same, at any M (its rows padded to 16); the decode path's own quantisation bit-exact (identity
weight), against the old path within 1e-5 · max|y|, and replayed in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from vllm.kernels import fp8_gemm
from vllm.kernels.fp8_gemm import (
    FP8_DTYPE,
    fp8_block_linear,
    fp8_block_linear_cost,
    fp8_block_linear_ref,
    per_token_group_quant_fp8_ref,
)
from vllm.model_executor.layers.linear import dequant_block_fp8, quant_block_fp8

# GLM-5.3's linears as (name, N, K) (benchmarks/kernels/bench_fp8_gemm.py times these)
GLM_LINEARS = [
    ("q_a", 2048, 6144),
    ("q_b", 16384, 2048),
    ("kv_a", 576, 6144),
    ("o_proj", 6144, 16384),
    ("mlp_gate|up", 12288, 6144),  # gate or up alone (served stacked: mlp_gate+up)
    ("mlp_down", 6144, 12288),
    ("lm_head", 154880, 6144),
    ("q_a+kv_a", 2048 + 576, 6144),  # one GEMM for both (same input; upstream's fused_qkv_a_proj)
    ("mlp_gate+up", 2 * 12288, 6144),  # the dense MLP's gate and up stacked, as served
    ("shared_gate+up", 2 * 2048, 6144),  # the MoE layers' shared expert, stacked
    ("shared_down", 6144, 2048),
    ("q_a+wk+kv_a", 2048 + 128 + 576, 6144),  # a full indexer layer's stack (with the indexer's wk)
]


def fp8_weight(n, k, block=(128, 128), device="cpu", seed=0):
    """Random e4m3 [N, K] weight with positive block scales; W = wq · s has entries ~ 1/sqrt(K)."""
    g = torch.Generator(device=device).manual_seed(seed)
    wq = (torch.randn(n, k, generator=g, device=device) * 64).clamp(-448, 448).to(FP8_DTYPE)
    gn, gk = -(-n // block[0]), -(-k // block[1])
    scale = (torch.rand(gn, gk, generator=g, device=device) + 0.5) / (64 * k**0.5)
    return wq, scale


def _ieee_scales(x: torch.Tensor, group: int) -> torch.Tensor:
    """max(amax, floor) / 448 per row and group, correctly rounded to fp32 (a float64 quotient of
    fp32 operands rounds to the fp32 quotient exactly: 53 >= 2·24 + 2 bits)."""
    m, k = x.shape
    ng = -(-k // group)
    pad = torch.zeros(m, ng * group, dtype=torch.float64, device=x.device)
    pad[:, :k] = x.double()
    amax = pad.view(m, ng, group).abs().amax(-1).clamp_min(fp8_gemm.AMAX_FLOOR).float()
    return (amax.double() / 448.0).float()


def _quant_err_bound(x: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """Per element: half an e4m3 step, relative 2^-4 for normals, 2^-10 · scale in the
    subnormal range (spacing 2^-9 · scale)."""
    s = scale.repeat_interleave(group, 1)[:, : x.shape[1]]
    return torch.maximum(x.abs().double() * 2**-4, s.double() * 2**-10)


# ---- CPU: the references ----------------------------------------------------------------------
@pytest.mark.parametrize("m,k,group", [(7, 300, 128), (1, 17, 128), (4, 256, 64), (0, 128, 128)])
def test_quant_ref_error_bound(m, k, group):
    g = torch.Generator().manual_seed(m * k)
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 3, k)  # wide dynamic range per row
    if m > 1:
        x[1] = 0.0  # an all-zero row: scale = floor / 448, zeros back
    q, s = per_token_group_quant_fp8_ref(x, group)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (m, -(-k // group))
    assert torch.equal(s, _ieee_scales(x, group))
    deq = q.float() * s.repeat_interleave(group, 1)[:, :k]
    assert ((deq.double() - x.double()).abs() <= _quant_err_bound(x, s, group)).all()
    if m > 1:
        assert q[1].float().eq(0).all()
        assert torch.equal(s[1], torch.full_like(s[1], fp8_gemm.AMAX_FLOOR / 448.0))
    if m:  # the group's amax maps to ±448 exactly
        assert q.float().abs().amax() == 448.0


@pytest.mark.parametrize(
    "lead,n,k,block",
    [((5,), 200, 300, (128, 128)), ((2, 3), 33, 17, (128, 128)), ((1,), 128, 256, (128, 128)),
     ((9,), 70, 96, (32, 64)), ((0,), 64, 130, (128, 128))],
)  # fmt: skip
def test_ref_against_dequantised_weight(lead, n, k, block):
    """fp8_block_linear_ref == x · dequant(W)ᵀ up to the activations' rounding (bound above)."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) / k**0.5
    wq, ws = quant_block_fp8(w, block)
    x = torch.randn(*lead, k, generator=g)
    got = fp8_block_linear_ref(x, wq, ws, block)
    assert got.shape == (*lead, n) and got.dtype == x.dtype
    x2 = x.reshape(-1, k)
    exact = x2.double() @ dequant_block_fp8(wq, ws, block).double().t()
    _, sx = per_token_group_quant_fp8_ref(x2, block[1])
    bound = _quant_err_bound(x2, sx, block[1]) @ dequant_block_fp8(wq, ws, block).double().abs().t()
    err = (got.reshape(-1, n).double() - exact).abs()
    assert (err <= bound + 1e-5 * exact.abs() + 1e-6).all()  # + the fp32 sum's rounding


def test_ref_bf16_input_and_public_on_cpu():
    wq, ws = fp8_weight(96, 200)
    x = torch.randn(4, 200).to(torch.bfloat16)
    ref = fp8_block_linear_ref(x, wq, ws)
    assert ref.dtype == torch.bfloat16
    assert torch.equal(fp8_block_linear(x, wq, ws), ref)  # CPU tensors take the reference


def test_checks():
    wq, ws = fp8_weight(64, 256)
    with pytest.raises(ValueError, match="weight_scale_inv"):
        fp8_block_linear(torch.randn(2, 256), wq, ws[:, :1])
    with pytest.raises(ValueError, match="does not fit"):
        fp8_block_linear(torch.randn(2, 255), wq, ws)
    with pytest.raises(ValueError, match="float8"):
        fp8_block_linear(torch.randn(2, 256), wq.float(), ws)
    with pytest.raises(ValueError, match="float32"):
        fp8_block_linear(torch.randn(2, 256), wq, ws.bfloat16())


def test_cost():
    flops, nbytes = fp8_block_linear_cost(1, 2048, 6144)
    assert flops == 2 * 2048 * 6144
    assert 2048 * 6144 < nbytes < 2048 * 6144 * 1.01  # decode: the e4m3 weight dominates


# ---- CPU: Triton interpreter, tiny shapes ------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,group", [(5, 300, 128), (1, 17, 128), (3, 1024, 128), (2, 96, 32)])
def test_quant_interpreter_bit_exact(interp, m, k, group, dtype):
    mod = interp("fp8_gemm")
    g = torch.Generator().manual_seed(m + k)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-4, 3, k)).to(dtype)
    if m > 2:
        x[2] = 0.0
    q, s = mod.quant_per_token_group(x, group)
    qr, sr = per_token_group_quant_fp8_ref(x, group)
    assert s.shape == sr.shape and s.stride(0) == 1  # M-contiguous scales
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(s, sr)


@pytest.mark.parametrize("m,row_multiple", [(1, 16), (37, 16), (32, 16), (5, 4)])
def test_quant_interpreter_padded_rows(interp, m, row_multiple):
    """Rows padded for cuBLAS: the first M rows as without padding, the others an all-zero row's
    (xq 0, scale floor / 448), scales still M-contiguous over the padded rows."""
    mod = interp("fp8_gemm")
    x = torch.randn(m, 300, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    q, s = mod.quant_per_token_group(x, 128, row_multiple)
    m_pad = -(-m // row_multiple) * row_multiple
    assert q.shape == (m_pad, 300) and s.shape == (m_pad, 3) and s.stride() == (1, m_pad)
    qr, sr = per_token_group_quant_fp8_ref(x, 128)
    assert torch.equal(q[:m].view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s[:m], sr)
    assert q[m:].view(torch.uint8).eq(0).all()
    assert torch.equal(s[m:], torch.full_like(s[m:], fp8_gemm.AMAX_FLOOR / 448.0))


def test_quant_interpreter_no_rows(interp):
    q, s = interp("fp8_gemm").quant_per_token_group(torch.randn(0, 256), 128)
    assert q.shape == (0, 256) and s.shape == (0, 2)


@pytest.mark.parametrize(
    "lead,n,k,split",
    [
        ((5,), 200, 300, None),  # partial N and K tiles
        ((1,), 64, 1024, None),  # M = 1: the table's split-K (2 splits of 4 K blocks)
        ((3,), 33, 17, None),  # K below one block
        ((2, 10), 130, 260, None),  # leading dims, two row tiles of 16
        ((2,), 64, 1024, 3),  # forced uneven split: 3 + 3 + 2 K blocks
        ((0,), 64, 256, None),  # no rows
    ],
)
def test_gemm_interpreter(interp, lead, n, k, split):
    mod = interp("fp8_gemm")
    wq, ws = fp8_weight(n, k, seed=n)
    x = torch.randn(*lead, k, generator=torch.Generator().manual_seed(k))
    cfg = None
    if split:
        m = x.numel() // k
        cfg = mod.gemm_config(m, n, k, 128, 132) | {"split_k": split, "k_blocks_per_split": 3}
    got = mod.fp8_block_gemm(x, wq, ws, (128, 128), cfg)
    ref = fp8_block_linear_ref(x, wq, ws)
    assert got.shape == ref.shape and got.dtype == x.dtype
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_gemm_interpreter_bf16_and_other_block(interp):
    """bf16 in and out (the interpreter's fp32 -> bf16 store may miss by one bf16 step: 2^-8),
    and a (64, 32) block: scale rows by n // 64, one K step per 32 columns."""
    mod = interp("fp8_gemm")
    wq, ws = fp8_weight(100, 160, block=(64, 32), seed=5)
    x = torch.randn(6, 160).to(torch.bfloat16)
    got = mod.fp8_block_gemm(x, wq, ws, (64, 32))
    ref = fp8_block_linear_ref(x, wq, ws, (64, 32))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=1e-3)


def _cdiv(a, b):
    return -(-a // b)


def _split(mod, m, n, k, split, num_sms=132, **over):
    """The table's config with K cut into ``split`` slices (the last one may be shorter)."""
    per = _cdiv(_cdiv(k, 128), split)
    cfg = mod.gemm_config(m, n, k, 128, num_sms)
    return cfg | dict(split_k=_cdiv(_cdiv(k, 128), per), k_blocks_per_split=per, **over)


def _sum_order_atol(x2, wq, ws, block=(128, 128)):
    """How far two fp32 sums of the same per-K-block terms can be apart: each is within
    (nkb - 1) · 2^-24 · Σ|terms| of the exact sum, and Σ|terms| <= (1 + 2^-4) · |x| · |W|ᵀ (the
    activations' rounding; the weight is exact). 4x that keeps clear of any change in an e4m3 byte
    (a step of 2^-4 of one term)."""
    nkb = _cdiv(x2.shape[1], block[1])
    w = dequant_block_fp8(wq, ws, block).double()
    return 4 * nkb * 2**-24 * 1.07 * (x2.abs().double() @ w.abs().t()) + 1e-30


def _identity_fp8(k):
    return torch.eye(k).to(FP8_DTYPE), torch.ones(_cdiv(k, 128), _cdiv(k, 128))


@pytest.mark.parametrize("m,k,split", [(5, 300, 1), (1, 300, 3), (19, 260, 2)])
def test_fused_quant_same_bytes_interpreter(interp, m, k, split):
    """The GEMM's own quantisation gives the quantiser's bytes and scales: with an identity weight
    (scales 1) each output is one product xq · sx · 1 plus zeros, exact in fp32, so y equals the
    reference's xq · sx bit for bit (distinct e4m3 values stay distinct after the scale). Partial K
    (and N) tiles, M = 1, M not a multiple of the 16-row tile, split or not."""
    mod = interp("fp8_gemm")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)) * torch.logspace(-3, 2, k)
    if m > 2:
        x[2] = 0.0
    wq, ws = _identity_fp8(k)
    cfg = _split(mod, m, k, k, split, fuse_quant=True)
    assert cfg["split_k"] == split
    got = mod.fp8_block_gemm(x, wq, ws, (128, 128), cfg)
    q, s = per_token_group_quant_fp8_ref(x, 128)
    assert torch.equal(got, q.float() * s.repeat_interleave(128, 1)[:, :k])


@pytest.mark.parametrize(
    "m,n,k,split",
    [(1, 200, 300, 1), (5, 70, 1024, 3), (19, 130, 260, 2), (37, 64, 512, 4)],
)  # fmt: skip
def test_fused_quant_equals_quant_then_gemm_interpreter(interp, m, n, k, split):
    """Fused quantisation against the separate pass at the same config: the same e4m3 operands
    and scales, the same per-block products summed in the same order, so the same fp32 result
    (tolerance 0). Against the path before issue 35 (separate pass, partials summed by torch):
    within the fp32 sum order of the split partials (:func:`_sum_order_atol`). M = 37 > the
    table's fused rows: forced."""
    mod = interp("fp8_gemm")
    wq, ws = fp8_weight(n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    cfg = _split(mod, m, n, k, split, fuse_quant=True)
    fused = mod.fp8_block_gemm(x, wq, ws, (128, 128), cfg)
    sep = mod.fp8_block_gemm(x, wq, ws, (128, 128), cfg | {"fuse_quant": False})
    torch.testing.assert_close(fused, sep, rtol=0, atol=0)
    old = mod.fp8_block_gemm(
        x, wq, ws, (128, 128), cfg | {"fuse_quant": False, "reduce_in_kernel": False}
    )
    assert ((fused.double() - old.double()).abs() <= _sum_order_atol(x, wq, ws)).all()
    torch.testing.assert_close(fused, fp8_block_linear_ref(x, wq, ws), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fuse", [True, False])
def test_prequantised_input_interpreter(interp, fuse):
    """x_quant (x quantised by its producer): the GEMM alone gives what quantising inside does,
    whatever the config's quantisation choice; a wrong pair gives another result."""
    mod = interp("fp8_gemm")
    m, n, k = 3, 70, 300
    wq, ws = fp8_weight(n, k, seed=5)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6))
    cfg = _split(mod, m, n, k, 2, fuse_quant=fuse)
    want = mod.fp8_block_gemm(x, wq, ws, (128, 128), cfg)
    xq = mod.quant_per_token_group(x, 128)
    got = mod.fp8_block_gemm(x, wq, ws, (128, 128), cfg, x_quant=xq)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    other = mod.quant_per_token_group(x * 2, 128)
    assert not torch.equal(mod.fp8_block_gemm(x, wq, ws, (128, 128), cfg, x_quant=other), want)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("m,n,k", [(1, 70, 1024), (19, 70, 600)])
def test_split_k_in_kernel_interpreter(interp, m, n, k, fuse):
    """K split 2, 3 or one slice per K block, summed by the tile's last split: the unsplit result
    within the fp32 sum order, bit-identical across calls, counters back to zero. A fresh x per
    split, so partials left in reused memory by an earlier call cannot pass for this call's."""
    mod = interp("fp8_gemm")
    wq, ws = fp8_weight(n, k, seed=k)
    g = torch.Generator().manual_seed(n + int(fuse))
    for split in (2, 3, _cdiv(k, 128)):
        x = torch.randn(m, k, generator=g)
        cfg = _split(mod, m, n, k, split, fuse_quant=fuse)
        got = mod.fp8_block_gemm(x, wq, ws, (128, 128), cfg)
        base = mod.fp8_block_gemm(
            x, wq, ws, (128, 128), cfg | dict(split_k=1, k_blocks_per_split=9)
        )
        assert ((got.double() - base.double()).abs() <= _sum_order_atol(x, wq, ws)).all()
        assert torch.equal(mod.fp8_block_gemm(x, wq, ws, (128, 128), cfg), got)
        assert not mod._COUNTERS[x.device].any()


def test_split_counters_interpreter(interp, monkeypatch):
    """The table's decode split (M = 1: 2 splits) uses the device's cached counters and leaves
    them zero; a call needing more slots than the buffer has gets its own zeroed ones."""
    mod = interp("fp8_gemm")
    monkeypatch.setattr(mod, "_COUNTERS", {})
    monkeypatch.setattr(mod, "COUNTER_SLOTS", 4)
    wq, ws = fp8_weight(64, 1024)
    x = torch.randn(1, 1024)
    assert mod.gemm_config(1, 64, 1024, 128, 132)["split_k"] == 2
    ref = fp8_block_linear_ref(x, wq, ws)
    torch.testing.assert_close(mod.fp8_block_gemm(x, wq, ws), ref, rtol=1e-5, atol=1e-5)
    cached = mod._COUNTERS[x.device]
    assert cached.shape == (4,) and not cached.any()
    wq, ws = fp8_weight(330, 1024)  # 6 tiles of 64 columns > 4 slots
    x = torch.randn(3, 1024)
    got = mod.fp8_block_gemm(x, wq, ws, (128, 128), _split(mod, 3, 330, 1024, 2))
    torch.testing.assert_close(got, fp8_block_linear_ref(x, wq, ws), rtol=1e-5, atol=1e-5)
    assert mod._COUNTERS[x.device] is cached and not cached.any()


def test_gemm_config_table():
    from vllm.kernels.triton.fp8_gemm import gemm_config

    c = gemm_config(1, 576, 6144, 128, 132)  # kv_a at decode: 9 tiles, split to fill the GPU
    assert c["block_m"] == 16 and c["split_k"] * c["k_blocks_per_split"] >= 48
    assert c["split_k"] > 1 and (c["split_k"] - 1) * c["k_blocks_per_split"] < 48
    assert gemm_config(8192, 6144, 16384, 128, 132)["split_k"] == 1  # prefill: no split
    # decode, 132 SMs: o_proj's 96 tiles of deep K split to ~4 programs per SM; mlp gate/up's 192
    # tiles (under 1.5 waves) in two; q_b's 256 tiles (a full second wave) not at all; q_a+kv_a's
    # 41 tiles of 48 K blocks stay at ~2 programs per SM (12 splits of 4 blocks were slower)
    assert gemm_config(1, 6144, 16384, 128, 132)["split_k"] == 5
    assert gemm_config(16, 12288, 6144, 128, 132)["split_k"] == 2
    assert gemm_config(64, 16384, 2048, 128, 132)["split_k"] == 1
    assert gemm_config(64, 2624, 6144, 128, 132)["split_k"] == 6
    assert gemm_config(64, 2752, 6144, 128, 132)["split_k"] == 6  # with the indexer's wk
    # 17-32 rows: 32-row tiles, but an unsplit grid of them (q_b's 256, the stacked gate/up's
    # 384) takes the 64-row tile; gate or up alone (192 tiles) splits K and keeps 32 rows
    assert gemm_config(32, 6144, 16384, 128, 132)["block_m"] == 32
    assert gemm_config(17, 12288, 6144, 128, 132)["block_m"] == 32
    for n in (16384, 24576):
        assert gemm_config(32, n, 2048, 128, 132)["block_m"] == 64
        assert gemm_config(32, n, 2048, 128, 132)["split_k"] == 1
        assert gemm_config(16, n, 2048, 128, 132)["block_m"] == 16
    # decode: the quantiser, then one GEMM that sums its own splits (quantising inside the GEMM
    # lost on the H200: FUSED_QUANT_MAX_M)
    assert not c["fuse_quant"] and c["reduce_in_kernel"]
    assert not gemm_config(256, 576, 6144, 128, 132)["fuse_quant"]  # prefill: separate pass


# ---- GPU: GLM-5.3 shapes -----------------------------------------------------------------------
GPU_MS = [1, 16, 32, 64, 256, 4096]


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", GLM_LINEARS)
@pytest.mark.parametrize("m", GPU_MS)
def test_gemm_gpu_glm_shapes(name, n, k, m):
    if name == "lm_head" and m > 256:
        pytest.skip("the lm_head runs on the sampled rows only")
    from vllm.kernels.triton.fp8_gemm import fp8_block_gemm

    wq, ws = fp8_weight(n, k, device="cuda", seed=m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = fp8_block_gemm(x, wq, ws)
    ref = fp8_block_linear_ref(x.float(), wq, ws)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    atol = 1e-2 * ref.abs().max().item()
    torch.testing.assert_close(got.float(), ref, rtol=1e-2, atol=atol)
    assert torch.equal(fp8_block_gemm(x, wq, ws), got)  # deterministic (split-K summed in order)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quant_ref_same_bits_on_cuda(dtype):
    """The reference computes the same bits on CUDA as on the CPU (CUDA torch would turn a division
    by the Python number 448 into a multiplication by its reciprocal: one ulp off in ~60 % of the
    groups, and then 0.1 % of bf16 inputs, sitting exactly on an e4m3 tie, round the other way)."""
    x = torch.randn(300, 6144, device="cuda").to(dtype)
    q, s = per_token_group_quant_fp8_ref(x, 128)
    qc, sc = per_token_group_quant_fp8_ref(x.cpu(), 128)
    assert torch.equal(s.cpu(), sc) and torch.equal(s.cpu(), _ieee_scales(x.cpu(), 128))
    assert torch.equal(q.cpu().view(torch.uint8), qc.view(torch.uint8))


def _assert_same_quant(q, s, qr, sr):
    """Bit equality, naming the first differing values when there are some."""
    bad_s = (s != sr).nonzero()
    assert not len(bad_s), f"{len(bad_s)} scales differ, first {bad_s[0].tolist()}: " + (
        f"{s[tuple(bad_s[0])].item()!r} vs reference {sr[tuple(bad_s[0])].item()!r}"
    )
    bad_q = (q.view(torch.uint8) != qr.view(torch.uint8)).nonzero()
    assert not len(bad_q), f"{len(bad_q)} e4m3 values differ, first {bad_q[0].tolist()}: " + (
        f"{q[tuple(bad_q[0])].item()} vs reference {qr[tuple(bad_q[0])].item()}"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 200, 300), (37, 1000, 1100), (300, 576, 6144)])
def test_gemm_gpu_odd_shapes(m, n, k):
    from vllm.kernels.triton.fp8_gemm import fp8_block_gemm, quant_per_token_group

    wq, ws = fp8_weight(n, k, device="cuda", seed=k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    _assert_same_quant(*quant_per_token_group(x), *per_token_group_quant_fp8_ref(x, 128))
    ref = fp8_block_linear_ref(x.float(), wq, ws)
    got = fp8_block_gemm(x, wq, ws).float()
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 37, 64, 4096])
def test_cublas_block_scaled_gpu(m):
    """torch's block-scaled mm (cuBLASLt, sm_90) computes the same product at any M: rows are
    padded to CUBLAS_ROW_MULTIPLE (M = 1 unpadded is refused: CUBLAS_STATUS_NOT_SUPPORTED)."""
    n, k = 2048, 6144
    wq, ws = fp8_weight(n, k, device="cuda", seed=m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if not fp8_gemm.cublas_supports(x, wq, (128, 128)):
        pytest.skip("cuBLAS block scaling needs sm_90")
    ref = fp8_block_linear_ref(x.float(), wq, ws)
    got = fp8_gemm.fp8_block_linear_cublas(x, wq, ws)
    assert got.shape == (m, n) and got.is_contiguous()
    torch.testing.assert_close(got.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 64, 72])
def test_public_gpu_dispatch_and_graph_capture(m, monkeypatch):
    """CUDA calls take a kernel (never the reference): Triton up to TRITON_MAX_M rows, cuBLAS
    above on sm_90 (72 rows: padded to 80); both replay inside a CUDA graph."""
    wq, ws = fp8_weight(2048, 6144, device="cuda")
    x = torch.randn(m, 6144, device="cuda", dtype=torch.bfloat16)
    real, calls = fp8_gemm.fp8_block_linear_cublas, []
    monkeypatch.setattr(fp8_gemm, "fp8_block_linear_cublas", lambda *a: calls.append(1) or real(*a))
    eager = fp8_block_linear(x, wq, ws)
    want = m > fp8_gemm.TRITON_MAX_M and fp8_gemm.cublas_supports(x, wq, (128, 128))
    assert bool(calls) == want
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_block_linear(x, wq, ws)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, fp8_block_linear(x, wq, ws), rtol=0, atol=0)
    assert not torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", [(1, 1100), (8, 6144), (37, 6144)])
def test_fused_quant_gpu_same_bytes(m, k):
    """On the GPU the GEMM's own quantisation of bf16 x gives the quantiser's bytes too: with an
    identity weight (scales 1; each output one exact product plus zeros, split or not) y is the
    reference's xq · sx rounded to bf16, bit for bit. M = 37: a 64-row wgmma tile, forced fused."""
    from vllm.kernels.triton import fp8_gemm as tri

    wq, ws = (t.cuda() for t in _identity_fp8(k))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 4
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    got = tri.fp8_block_gemm(x, wq, ws, (128, 128), _split(tri, m, k, k, 1, sms, fuse_quant=True))
    q, s = per_token_group_quant_fp8_ref(x, 128)
    want = (q.float() * s.repeat_interleave(128, 1)[:, :k]).bfloat16()
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", [GLM_LINEARS[i] for i in (0, 2, 3, 7)])
@pytest.mark.parametrize("m", [1, 16, 32])
def test_decode_path_gpu_against_old(name, n, k, m):
    """The decode path (quantised in the GEMM, split-K summed in it) against quant + GEMM + torch
    sum at the table's tiles, fp32 x and y: the same e4m3 operands and per-block products; the
    partials' sum order may differ, and the tensor cores' inside a block, so 1e-5 of max |y|
    (the bf16 output's rounding is 2^-9)."""
    from vllm.kernels.triton import fp8_gemm as tri

    wq, ws = fp8_weight(n, k, device="cuda", seed=m)
    x = torch.randn(m, k, device="cuda")
    cfg = tri.gemm_config(m, n, k, 128, torch.cuda.get_device_properties(0).multi_processor_count)
    cfg |= dict(fuse_quant=True, reduce_in_kernel=True)
    new = tri.fp8_block_gemm(x, wq, ws, (128, 128), cfg)
    old = tri.fp8_block_gemm(
        x, wq, ws, (128, 128), cfg | {"fuse_quant": False, "reduce_in_kernel": False}
    )
    torch.testing.assert_close(new, old, rtol=0, atol=1e-5 * old.abs().max().item())
    assert torch.equal(tri.fp8_block_gemm(x, wq, ws, (128, 128), cfg), new)


@pytest.mark.gpu
@pytest.mark.parametrize("warm", [True, False])
def test_decode_path_graph_capture(warm, monkeypatch):
    """kv_a at M = 8 (9 tiles, K split 12, quantised in the GEMM) captured in a CUDA graph and
    replayed twice with new x: each replay equals an eager call bit for bit (fixed sum order), and
    the counters are zero afterwards. Cold: the first counter-using call is inside the capture,
    which then records its own torch.zeros (the cached buffer is made by the eager calls after)."""
    from vllm.kernels.triton import fp8_gemm as tri

    monkeypatch.setattr(tri, "_COUNTERS", {})
    wq, ws = fp8_weight(576, 6144, device="cuda")
    x = torch.randn(8, 6144, device="cuda", dtype=torch.bfloat16)
    cfg = tri.gemm_config(
        8, 576, 6144, 128, torch.cuda.get_device_properties(0).multi_processor_count
    )
    assert cfg["reduce_in_kernel"] and cfg["split_k"] > 1
    tri.fp8_block_gemm(x, wq, ws)  # compiles (never inside a capture)
    if not warm:
        monkeypatch.setattr(tri, "_COUNTERS", {})
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.fp8_block_gemm(x, wq, ws)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, tri.fp8_block_gemm(x, wq, ws), rtol=0, atol=0)
    assert not tri._COUNTERS[x.device].any()
