"""The sync-free dense expert form (decode batches on CUDA) against the grouped reference."""

from __future__ import annotations

import pytest
import torch

from vllm.kernels import moe
from vllm.model_executor.model_loader import build_model
from vllm.model_executor.models import glm_moe_dsa
from vllm.model_executor.simple_forward import prompt_logits


def _case(t, e_loc, k, h, i, offset, e_total, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e_loc, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e_loc, h, i, generator=g) / i**0.5).to(dtype)
    ids = torch.stack([torch.randperm(e_total, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    return x, w13, w2, ids, w, offset


@pytest.mark.parametrize(
    "t,e_loc,k,offset,e_total,max_bytes",
    [
        (1, 4, 2, 0, 4, 256 << 20),  # one token
        (9, 8, 3, 0, 8, 256 << 20),
        (16, 4, 2, 4, 12, 256 << 20),  # EP-style: a slice of the experts, others ignored
        (33, 8, 2, 0, 8, 4096),  # tiny budget: one expert per group
        (5, 6, 2, 2, 16, 9000),  # groups of two, some tokens with no local expert
    ],
)
def test_dense_matches_grouped_fp32(t, e_loc, k, offset, e_total, max_bytes):
    x, w13, w2, ids, w, off = _case(t, e_loc, k, 24, 16, offset, e_total, torch.float32, seed=t)
    ref = moe.experts_ref(x, w13, w2, ids, w, off)
    got = moe.experts_dense(x, w13, w2, ids, w, off, max_bytes=max_bytes)
    assert got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_dense_matches_grouped_bf16():
    x, w13, w2, ids, w, off = _case(12, 8, 2, 64, 32, 0, 8, torch.bfloat16, seed=5)
    ref = moe.experts_ref(x, w13, w2, ids, w, off)
    got = moe.experts_dense(x, w13, w2, ids, w, off)
    assert got.dtype == torch.bfloat16
    # both round the same bf16 intermediates; only the fp32 sum order differs
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_policy_cpu_keeps_reference(monkeypatch):
    """On CPU the grouped reference runs (the dense form is for CUDA decode batches)."""
    calls = []
    monkeypatch.setattr(moe, "experts_dense", lambda *a, **k: calls.append(1))
    x, w13, w2, ids, w, off = _case(8, 4, 2, 16, 8, 0, 4, torch.float32, seed=1)
    out = moe.fused_experts(x, w13, w2, ids, w, off)
    assert out is not None and not calls


def test_model_logits_with_dense_experts(tiny_ckpt, monkeypatch):
    """The tiny model through prefill and decode with every MoE layer in the dense form: the same
    logits as with the grouped reference, within fp32 rounding."""
    model = build_model(tiny_ckpt)
    ids = [(11 * i) % 500 + 3 for i in range(80)]
    ref = prompt_logits(model, ids, "auto", chunk=32, decode_from=60)
    used = []

    def dense(*a, w13_scale=None, w2_scale=None, num_experts=None, x_quant=None):
        assert w13_scale is None and w2_scale is None and x_quant is None  # full precision
        used.append(a[0].shape[0])
        return moe.experts_dense(*a)

    monkeypatch.setattr(glm_moe_dsa, "fused_experts", dense)
    got = prompt_logits(model, ids, "auto", chunk=32, decode_from=60)
    assert used and min(used) == 1  # decode steps went through it
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dense_matches_grouped_cuda_bf16():
    x, w13, w2, ids, w, off = _case(64, 32, 8, 1024, 256, 32, 256, torch.bfloat16, seed=7)
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in (x, w13, w2, ids, w, off)]
    ref = moe.experts_ref(*args)
    got = moe.fused_experts(*args)  # 64 tokens · 8 >= 2 · 32 experts: the dense form
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
