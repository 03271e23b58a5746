"""The residual stream's adds run inside the next norm's pass (``add_rms_norm``): a layer's output
and the next layer's attention inputs are the separate add-then-norm path's, bit for bit, on the
GLM-5.3-shaped slice (bf16 and FP8, decode and prefill sizes, dense and MoE layers)."""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.model_loader import build_model
from vllm.model_executor.models.glm_moe_dsa import norm_for_gemm


def _separate_post(layer, x, out):
    """DecoderLayer.post_attention as it was: the add, then the norm."""
    x = x + layer.self_attn.output(out)
    gemm = layer.mlp.input_gemm()
    if gemm is None:
        h = layer.mlp(layer.post_attention_layernorm(x))
    else:
        h = layer.mlp(*norm_for_gemm(layer.post_attention_layernorm, x, *gemm))
    return x + (h if layer.is_moe else layer.tp.all_reduce(h))


def _check(model, device, dtype, sizes):
    layers = model.model.layers
    attn = layers[0].self_attn
    g = torch.Generator().manual_seed(2)
    for m in sizes:
        x = torch.randn(m, attn.o_proj.out_features, generator=g).to(device, dtype)
        out = torch.randn(m, attn.num_heads, attn.v, generator=g).to(device, dtype)
        pos = torch.arange(m, device=device)
        for i, layer in enumerate(layers):
            want = _separate_post(layer, x, out)
            mid, h = layer.post_attention_parts(x, out)
            assert torch.equal(mid + h, want), (m, i)
            assert torch.equal(layer.post_attention(x, out), want), (m, i)
            if i + 1 < len(layers):
                nxt = layers[i + 1]
                s, fused = nxt.add_pre_attention(mid, h, pos)
                plain = nxt.pre_attention(want, pos)
                assert torch.equal(s, want), (m, i)
                for name in ("q_nope", "q_pe", "kv_c", "k_pe"):
                    assert torch.equal(getattr(fused, name), getattr(plain, name)), (m, i, name)
                if plain.idx is not None:
                    for name in ("q", "w", "k"):
                        assert torch.equal(getattr(fused.idx, name), getattr(plain.idx, name))
        final = model.model._final_norm(mid, h)
        assert torch.equal(final, model.model.norm(mid + h)), m


def test_add_norm_layers_cpu(tmp_path):
    from vllm.model_executor.tiny import write_slice_checkpoint

    model = build_model(write_slice_checkpoint(str(tmp_path / "s"), seed=6), dtype=torch.float32)
    _check(model, "cpu", torch.float32, (3,))


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_add_norm_layers_gpu(tmp_path, fp8):
    from vllm.model_executor.tiny import write_slice_checkpoint

    path = write_slice_checkpoint(str(tmp_path / "s"), fp8=fp8, seed=6)
    model = build_model(path, dtype=torch.bfloat16, device="cuda")
    _check(model, "cuda", torch.bfloat16, (1, 64, 300))
