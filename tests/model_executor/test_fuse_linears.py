"""q_a_proj and kv_a_proj_with_mqa, and each MLP's gate_proj and up_proj, run as one stacked GEMM
after loading (`fuse_linears`): the same outputs as the separate Linears, their parameters views of
the stacked weight (names and bytes unchanged), and no stacking where FP8 scale tiles would
straddle two parts or the parts are not one rank's column shards."""

from __future__ import annotations

import torch

from vllm.model_executor.layers.linear import (
    Linear,
    fuse_linears,
    linear_forward,
    quant_block_fp8,
)
from vllm.model_executor.model_loader import build_model
from vllm.model_executor.models import glm_moe_dsa


def _linear(n: int, k: int, fp8: bool, gen: torch.Generator) -> Linear:
    w = torch.randn(n, k, generator=gen) / k**0.5
    if not fp8:
        m = Linear(k, n, dtype=torch.float32)
        m.weight.data.copy_(w)
        return m
    m = Linear(k, n, quant_block=(128, 128))
    q, s = quant_block_fp8(w, (128, 128))
    m.weight.data.copy_(q)
    m.weight_scale_inv.data.copy_(s)
    return m


def test_stacked_equals_separate_fp32_and_fp8():
    gen = torch.Generator().manual_seed(0)
    for fp8 in (False, True):
        parts = [_linear(256, 320, fp8, gen), _linear(72, 320, fp8, gen)]
        x = torch.randn(5, 320, generator=gen)
        want = [p(x) for p in parts]
        before = [p.weight.clone() for p in parts]
        stacked = fuse_linears(parts)
        assert stacked is not None
        w, s = stacked
        assert w.shape == (328, 320) and (s is not None) == fp8
        got = linear_forward(x, w, s, parts[0].block).split([256, 72], -1)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        for p, b in zip(parts, before, strict=True):  # views of the stack, same values
            assert torch.equal(p.weight, b) and p.weight.untyped_storage().data_ptr() == (
                w.untyped_storage().data_ptr()
            )
            torch.testing.assert_close(p(x), want[parts.index(p)], rtol=0, atol=0)


def test_not_stacked_when_a_scale_tile_would_straddle():
    gen = torch.Generator().manual_seed(1)
    # the first part ends inside a 128-row tile: its last scale row cannot serve the next part
    assert fuse_linears([_linear(100, 256, True, gen), _linear(64, 256, True, gen)]) is None
    assert fuse_linears([_linear(64, 256, False, gen), _linear(64, 128, False, gen)]) is None
    assert fuse_linears([_linear(100, 256, False, gen), _linear(64, 256, False, gen)]) is not None


def test_model_stacks_and_keeps_its_parameters(tiny_ckpt):
    model = build_model(tiny_ckpt)
    names = [n for n, _ in model.named_parameters()]
    assert any(n.endswith("self_attn.q_a_proj.weight") for n in names)
    attn = [m for m in model.modules() if isinstance(m, glm_moe_dsa.MLAAttention)]
    assert attn and all(m.fused_qkv_a is not None for m in attn)
    gen = torch.Generator().manual_seed(3)
    for m in attn:
        w = m.fused_qkv_a[0]
        assert m.q_a_proj.weight.data_ptr() == w.data_ptr()
        # a full indexer layer's wk joins between q_a and kv_a (its rows end on a block row)
        wk = m.indexer.wk if m.indexer is not None else None
        parts = [m.q_a_proj] + ([wk] if wk is not None else []) + [m.kv_a_proj_with_mqa]
        assert m.qkv_a_split == [p.out_features for p in parts]
        row = 0
        for p in parts:
            assert p.weight.data_ptr() == w[row:].data_ptr()
            row += p.out_features
        assert row == w.shape[0]
        if wk is not None:  # the indexer's key from the stack equals its own GEMM's
            x = torch.randn(5, m.q_a_proj.in_features, generator=gen).to(w.dtype)
            k = linear_forward(x, *m.fused_qkv_a).split(m.qkv_a_split, -1)[1]
            torch.testing.assert_close(k, wk(x), rtol=1e-6, atol=1e-6)
    assert any(m.indexer is not None for m in attn)


def test_column_shards_of_one_rank_stack():
    """Column shards (each this rank's rows of its own weight) stack like unsharded parts; row
    shards, or parts of different ranks, do not."""

    def part(shard, rank):
        return Linear(64, 256, shard=shard, tp_rank=rank, tp_size=2, dtype=torch.float32)

    assert fuse_linears([part("col", 1), part("col", 1)]) is not None
    assert fuse_linears([part("col", 0), part("col", 1)]) is None
    assert fuse_linears([part("row", 1), part("row", 1)]) is None
    assert fuse_linears([part("col", 1), part(None, 0)]) is None


def test_model_stacks_gate_up(tiny_ckpt):
    """Every MLP (dense layers and shared experts) holds gate and up as views of one stacked
    weight, and its output equals the two separate GEMMs'."""
    model = build_model(tiny_ckpt)
    mlps = [m for m in model.modules() if isinstance(m, glm_moe_dsa.MLP)]
    assert mlps and all(m.gate_up is not None for m in mlps)
    gen = torch.Generator().manual_seed(2)
    for m in mlps:
        w = m.gate_up[0]
        assert m.gate_proj.weight.data_ptr() == w.data_ptr()
        assert m.up_proj.weight.data_ptr() == w[m.gate_proj.out_features :].data_ptr()
        x = torch.randn(3, m.gate_proj.in_features, generator=gen).to(w.dtype)
        sep = m.down_proj(torch.nn.functional.silu(m.gate_proj(x)) * m.up_proj(x))
        torch.testing.assert_close(m(x), sep, rtol=1e-2, atol=1e-3)
