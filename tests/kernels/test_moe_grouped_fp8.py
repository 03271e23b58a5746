"""FP8 routed experts: the reference's scale layout and error, the grouped Triton kernel against it.

CPU, reference: against the experts with dequantised weights in fp32, relative Frobenius error
below 0.1 (two roundings of the activations to e4m3, x and SiLU·up, ~2.6 % rms each); the scale
layout is checked with gate and up halves 100x apart in magnitude, so a scale row read from the
wrong half would be off by 100x. Interpreter, fp32: 1e-4, as the bf16 kernel's test (the same
per-block products and scale order; fp32 sum order and the SiLU formula differ); bf16 x: 5e-3
relative Frobenius (the output's bf16 rounding, 2^-9 per element; measured 1.7e-3).

GPU, GLM-5.3-like shapes: relative Frobenius 5e-3 in fp32 and 1e-2 in bf16. Why: x is quantised
bit-exactly alike on both sides (test_fp8_gemm's quantiser tests), so gate and up first differ by
the fp32 sum order and Hopper's fp8 tensor cores (~14-bit addition inside a 128-deep block): a
relative δ ~ 1e-4. The e4m3 requantisation of SiLU·up then amplifies δ: a fraction ~δ/step of the
elements lands on the other side of a rounding boundary and moves a whole e4m3 step (2^-4..2^-3
relative), so the output differs by ~sqrt(δ · step) ~ 3e-3, under 5e-3 (the fp32 cases passed it
on the H200, 2026-12-04). bf16 adds the output's rounding (2^-9 per element, ~1e-3 rms): 1e-2.
That run's bf16 cases failed at 0.011-0.017 with no kernel fault: the reference's x scales were
amax · fp32(1/448) (CUDA torch's division by a Python number), one ulp off the kernel's amax / 448
in ~60 % of the groups; 0.1 % of bf16 inputs sit exactly on an e4m3 tie and rounded the other way,
a δ of 3e-3 in gate/up that the intermediate's requantisation made 1.5 % (reproduced on the CPU:
1.49e-2 at T 300, H 6144, I 96, against 1.48e-2 measured; 2e-7 with fp32 inputs, which have no
ties). The reference now divides by a tensor (IEEE, as the kernel).
"""

from __future__ import annotations

import pytest
import torch

from vllm.kernels import moe
from vllm.kernels.fp8_gemm import FP8_DTYPE
from vllm.model_executor.layers.linear import dequant_block_fp8, quant_block_fp8


def _quant_experts(w13, w2):
    """Checkpoint-style quantisation: gate, up and down of each expert separately (128 × 128
    tiles), w13's scales as gate's row blocks then up's (the contract of experts_ref)."""
    inter = w13.shape[1] // 2
    q13, s13, q2, s2 = [], [], [], []
    for e in range(w13.shape[0]):
        (gq, gs), (uq, us) = quant_block_fp8(w13[e, :inter]), quant_block_fp8(w13[e, inter:])
        q13.append(torch.cat([gq, uq]))
        s13.append(torch.cat([gs, us]))
        dq, ds = quant_block_fp8(w2[e])
        q2.append(dq)
        s2.append(ds)
    return torch.stack(q13), torch.stack(q2), torch.stack(s13), torch.stack(s2)


def _dequant_experts(q13, q2, s13, s2):
    inter, gi = q13.shape[1] // 2, s13.shape[1] // 2
    blk = (128, 128)
    w13 = torch.cat(
        [dequant_block_fp8(q13[:, :inter], s13[:, :gi], blk),
         dequant_block_fp8(q13[:, inter:], s13[:, gi:], blk)], dim=1,
    )  # fmt: skip
    return w13, dequant_block_fp8(q2, s2, blk)


def _case(t, e_loc, k, h, i, offset, e_total, seed=0, skip=(), up_gain=1.0):
    """Random FP8 experts and routing; ``skip``: global expert ids no token chooses."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e_loc, 2 * i, h, generator=g) / h**0.5
    w13[:, i:] *= up_gain
    w2 = torch.randn(e_loc, h, i, generator=g) / i**0.5
    pool = torch.tensor([e for e in range(e_total) if e not in skip])
    rows = [pool[torch.randperm(pool.numel(), generator=g)[:k]] for _ in range(t)]
    ids = torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.long)
    w = torch.rand(t, k, generator=g)
    q13, q2, s13, s2 = _quant_experts(w13, w2)
    return x, q13, q2, ids, w, offset, s13, s2


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


# ---- CPU: the reference ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "t,e_loc,k,h,i,offset,e_total",
    [(9, 4, 2, 160, 96, 0, 4), (20, 3, 3, 256, 200, 2, 8), (6, 2, 2, 64, 256, 0, 2)],
)
def test_ref_against_dequantised(t, e_loc, k, h, i, offset, e_total):
    """I = 96 and 200: gate and up blocks split at I, not at multiples of 128 of 2I."""
    x, q13, q2, ids, w, off, s13, s2 = _case(t, e_loc, k, h, i, offset, e_total, seed=t,
                                             up_gain=100.0)  # fmt: skip
    assert s13.shape == moe.fp8_scale_shapes(e_loc, h, i)[0]
    got = moe.experts_ref(x, q13, q2, ids, w, off, s13, s2)
    w13, w2 = _dequant_experts(q13, q2, s13, s2)
    exact = moe.experts_ref(x, w13, w2, ids, w, off)
    assert _rel(got, exact) < 0.1
    assert torch.equal(moe.fused_experts(x, q13, q2, ids, w, off, s13, s2), got)  # CPU: the ref


def test_ref_checks():
    x, q13, q2, ids, w, off, s13, s2 = _case(3, 2, 2, 64, 96, 0, 2)
    with pytest.raises(ValueError, match="w13_scale"):
        moe.fused_experts(x, q13, q2, ids, w, off)
    bad = torch.ones(2, 1, 1)  # ceil(2I/128) rows: the layout this contract rules out
    with pytest.raises(ValueError, match="expected"):
        moe.experts_ref(x, q13, q2, ids, w, off, bad, s2)
    with pytest.raises(ValueError, match="float32"):
        moe.experts_ref(x, q13, q2, ids, w, off, s13.bfloat16(), s2)


# ---- CPU: Triton interpreter, tiny shapes ------------------------------------------------------
@pytest.mark.parametrize(
    "t,e_loc,k,offset,e_total,block_m,skip",
    [
        (1, 4, 2, 0, 4, 16, ()),  # one token
        (40, 6, 3, 0, 6, 64, ()),  # counts not multiples of the block
        (40, 6, 3, 0, 6, 16, ()),  # 16-row tiles: several blocks per expert
        (60, 3, 2, 0, 3, 128, ()),  # the prefill table's 128-row tile
        (23, 5, 1, 0, 5, 16, (2,)),  # k = 1; local expert 2 has no tokens
        (17, 4, 2, 4, 12, 16, (5,)),  # EP slice: offset 4, others' experts; an empty expert
    ],
)
@pytest.mark.parametrize("h,i", [(160, 96), (64, 200), (256, 128)])  # the last: EVEN
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the NaN rows' quantisation, never read
def test_grouped_fp8_interpreter(interp, t, e_loc, k, offset, e_total, block_m, skip, h, i):
    mod = interp("moe_grouped_fp8")
    cfg = {"block_m": block_m, "num_warps": 4, "num_stages": 2}
    x, q13, q2, ids, w, off, s13, s2 = _case(t, e_loc, k, h, i, offset, e_total, seed=t,
                                             skip=skip)  # fmt: skip
    local = ids - off
    # a token with no local expert: its row is never read, so NaN there must not leak
    orphan = ~((local >= 0) & (local < e_loc)).any(1)
    x[orphan] = float("nan")
    ref = moe.experts_ref(x, q13, q2, ids, w, off, s13, s2)
    got = mod.experts_grouped_fp8(x, q13, q2, ids, w, off, s13, s2, cfg)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert got[orphan].eq(0).all()


def test_grouped_fp8_interpreter_all_experts_elsewhere(interp):
    """Every pair belongs to another rank: exactly zero, no NaN from the unwritten rows."""
    mod = interp("moe_grouped_fp8")
    x, q13, q2, ids, w, off, s13, s2 = _case(9, 4, 2, 64, 32, 8, 8, seed=1)  # ids < 8
    assert torch.equal(mod.experts_grouped_fp8(x, q13, q2, ids, w, off, s13, s2), x * 0)


def test_grouped_fp8_interpreter_no_tokens(interp):
    mod = interp("moe_grouped_fp8")
    x, q13, q2, ids, w, off, s13, s2 = _case(0, 4, 2, 64, 32, 0, 4)
    assert mod.experts_grouped_fp8(x, q13, q2, ids, w, off, s13, s2).shape == (0, 64)


def test_grouped_fp8_interpreter_reads_producer_quant(interp):
    """x_quant from the producer (here the quantiser itself, in a row-padded buffer as the
    fused norm may give): the same bits as quantising x inside; a wrong shape is refused."""
    mod = interp("moe_grouped_fp8")
    quant = interp("fp8_gemm").quant_per_token_group
    x, q13, q2, ids, w, off, s13, s2 = _case(10, 4, 2, 128, 128, 0, 4, seed=3)
    want = mod.experts_grouped_fp8(x, q13, q2, ids, w, off, s13, s2)
    xq, sx = quant(x, 128, 16)  # 16 rows: the first 10 are x's
    got = mod.experts_grouped_fp8(x, q13, q2, ids, w, off, s13, s2, x_quant=(xq[:10], sx[:10]))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="x_quant"):
        mod.experts_grouped_fp8(x, q13, q2, ids, w, off, s13, s2, x_quant=(xq, sx))


def test_grouped_fp8_interpreter_k_major_scales(interp):
    """The block scales stored K blocks first (the model's layout after loading, CUTLASS's):
    the same bits through the strides."""
    mod = interp("moe_grouped_fp8")
    x, q13, q2, ids, w, off, s13, s2 = _case(12, 4, 2, 256, 384, 0, 4, seed=5)
    want = mod.experts_grouped_fp8(x, q13, q2, ids, w, off, s13, s2)
    k_major = [s.transpose(1, 2).contiguous().transpose(1, 2) for s in (s13, s2)]
    assert not k_major[0].is_contiguous() and torch.equal(k_major[0], s13)
    assert torch.equal(mod.experts_grouped_fp8(x, q13, q2, ids, w, off, *k_major), want)


def test_grouped_fp8_interpreter_bf16_table_config(interp):
    """bf16 activations with the shipped row-tile table (no cfg): only the output's rounding."""
    mod = interp("moe_grouped_fp8")
    x, q13, q2, ids, w, off, s13, s2 = _case(12, 4, 2, 128, 128, 0, 4, seed=7)
    x = x.to(torch.bfloat16)
    ref = moe.experts_ref(x, q13, q2, ids, w, off, s13, s2)
    got = mod.experts_grouped_fp8(x, q13, q2, ids, w, off, s13, s2)
    assert got.dtype == torch.bfloat16 and _rel(got, ref) < 5e-3


# ---- GPU: GLM-5.3-like shapes ------------------------------------------------------------------
GPU_SHAPES = [
    # t, e_loc, k, h, i, offset, e_total
    (1, 32, 8, 6144, 2048, 32, 256),  # decode, one EP rank's experts
    (64, 32, 8, 6144, 2048, 0, 256),  # decode batch, EP8 share
    (64, 8, 8, 1024, 256, 16, 64),  # EP slice, many tokens without a local expert
    (1000, 32, 8, 1024, 512, 0, 32),  # prefill chunk, several blocks per expert
    (300, 8, 4, 6144, 96, 0, 8),  # I below one block (a TP shard of a small model)
]


def _gpu_case(t, e_loc, k, h, i, offset, e_total, seed):
    """Random e4m3 experts made on the GPU (quantising GLM-size experts on the CPU is slow)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    gi, gh = -(-i // 128), -(-h // 128)
    q13 = (torch.randn(e_loc, 2 * i, h, device=dev, generator=g) * 64).clamp(-448, 448)
    q2 = (torch.randn(e_loc, h, i, device=dev, generator=g) * 64).clamp(-448, 448)
    q13, q2 = q13.to(FP8_DTYPE), q2.to(FP8_DTYPE)
    s13 = (torch.rand(e_loc, 2 * gi, gh, device=dev, generator=g) + 0.5) / (64 * h**0.5)
    s2 = (torch.rand(e_loc, gh, gi, device=dev, generator=g) + 0.5) / (64 * i**0.5)
    x = torch.randn(t, h, device=dev, generator=g)
    ids = torch.rand(t, e_total, device=dev, generator=g).topk(k, dim=-1).indices
    w = torch.rand(t, k, device=dev, generator=g)
    return x, q13, q2, ids, w, offset, s13, s2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 5e-3)])
@pytest.mark.parametrize("t,e_loc,k,h,i,offset,e_total", GPU_SHAPES)
def test_grouped_fp8_gpu(t, e_loc, k, h, i, offset, e_total, dtype, tol):
    from vllm.kernels.triton import moe_grouped_fp8 as mod

    x, *rest = _gpu_case(t, e_loc, k, h, i, offset, e_total, seed=t + i)
    x = x.to(dtype)
    ref = moe.experts_ref(x, *rest)
    got = mod.experts_grouped_fp8(x, *rest)
    assert got.dtype == dtype
    assert _rel(got, ref) < tol
    assert torch.equal(mod.experts_grouped_fp8(x, *rest), got)  # deterministic
    # no K masks (sizes multiples of 128) against the masked form: the same bits
    cfg = mod._config(t * k, e_loc, e_total)
    for bm in {cfg["block_m"], 16, 128}:
        c = cfg | {"block_m": bm}
        even = mod.experts_grouped_fp8(x, *rest, c | {"even": True})
        assert torch.equal(even, mod.experts_grouped_fp8(x, *rest, c | {"even": False}))


@pytest.mark.gpu
def test_fused_experts_fp8_gpu_dispatch_and_graph(monkeypatch):
    """CUDA e4m3 experts go to the grouped FP8 kernel at every batch size (the dense decode form
    is bf16-only) and replay inside a CUDA graph."""
    from vllm.kernels.triton import moe_grouped_fp8 as mod

    x, *rest = _gpu_case(16, 32, 8, 1024, 512, 0, 32, seed=3)
    x = x.to(torch.bfloat16)
    real, calls = mod.experts_grouped_fp8, []
    monkeypatch.setattr(
        mod, "experts_grouped_fp8", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    eager = moe.fused_experts(x, *rest)
    assert calls
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_experts(x, *rest)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, moe.fused_experts(x, *rest)) and not torch.equal(out, eager)
