"""Checkpoint loading: single/sharded files, FP8 block weights, and every error message."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm.model_executor.layers.linear import Linear, dequant_block_fp8
from vllm.model_executor.model_loader import CheckpointError, build_model
from vllm.model_executor.models.glm_moe_dsa import Experts
from vllm.model_executor.tiny import TINY_CONFIG, tiny_state_dict, write_checkpoint

IDS = list(range(7, 7 + 90))


@pytest.fixture(scope="module")
def sd():
    return tiny_state_dict(TINY_CONFIG, seed=5)


def _write(tmp_path, sd, **kw):
    path = str(tmp_path)
    write_checkpoint(path, TINY_CONFIG, sd, dtype=torch.float32, tokenizer=False, **kw)
    return path


def test_sharded_equals_single(tmp_path, sd):
    a = build_model(_write(tmp_path / "single", sd))
    b_path = _write(tmp_path / "sharded", sd, max_shard_bytes=200_000)
    assert len([f for f in os.listdir(b_path) if f.endswith(".safetensors")]) > 2
    b = build_model(b_path)
    for (n1, p1), (n2, p2) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)


def test_fp8_checkpoint_within_fp8_error(tmp_path, sd):
    """Weights stored e4m3 with 128×128 `weight_scale_inv` load as e4m3 with their scales (CPU
    too), and each one dequantised is within one e4m3 rounding of the original (relative 2^-4,
    or half the smallest subnormal step of its tile scale). Logit-level checks against the
    dequantised model: tests/model_executor/test_fp8_weights.py."""
    full = build_model(_write(tmp_path / "fp32", sd))
    path = _write(tmp_path / "fp8", sd, fp8=True)
    assert json.load(open(os.path.join(path, "config.json")))["quantization_config"][
        "weight_block_size"
    ] == [128, 128]
    raw = load_file(os.path.join(path, "model.safetensors"))
    assert raw["model.layers.0.self_attn.q_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.0.self_attn.q_b_proj.weight_scale_inv" in raw
    fp8 = build_model(path)
    modules = dict(fp8.named_modules())
    n_quant = 0
    for name, a in full.named_parameters():
        mod_name, _, pname = name.rpartition(".")
        m = modules[mod_name]
        if isinstance(m, Linear) and m.is_fp8:
            b = m.dense_weight(torch.float32)
        elif isinstance(m, Experts) and m.block is not None:
            b = _dequant_experts(m, pname)
        else:
            assert torch.equal(a, dict(fp8.named_parameters())[name]), name
            continue
        n_quant += 1
        tile_step = a.abs().max() / 448 * 2**-9  # e4m3 subnormal step at the largest tile scale
        assert ((a - b).abs() <= a.abs() * 2**-4 + tile_step).all(), name
    assert n_quant > 20


def _dequant_experts(m: Experts, pname: str) -> torch.Tensor:
    if pname == "w2_weight":
        return dequant_block_fp8(m.w2_weight, m.w2_weight_scale_inv, m.block)
    g = m.w13_weight_scale_inv.shape[1] // 2
    w, s = m.w13_weight, m.w13_weight_scale_inv
    return torch.cat(
        [
            dequant_block_fp8(w[:, : m.inter], s[:, :g], m.block),
            dequant_block_fp8(w[:, m.inter :], s[:, g:], m.block),
        ],
        dim=1,
    )


def _mutate(tmp_path, sd, fn):
    path = _write(tmp_path, sd)
    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    fn(t)
    save_file(t, f)
    return path


def test_missing_tensor_named(tmp_path, sd):
    path = _mutate(tmp_path, sd, lambda t: t.pop("model.layers.2.self_attn.indexer.wk.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing tensor model\.layers\.2\.self_attn\.indexer\.wk\.weight"
    ):
        build_model(path)


def test_missing_expert_named(tmp_path, sd):
    path = _mutate(tmp_path, sd, lambda t: t.pop("model.layers.3.mlp.experts.5.up_proj.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing tensor model\.layers\.3\.mlp\.experts\.5\.up_proj\.weight"
    ):
        build_model(path)


def test_missing_mtp_tensor_named(tmp_path, sd):
    path = _mutate(tmp_path, sd, lambda t: t.pop("model.layers.4.eh_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.4\.eh_proj\.weight"):
        build_model(path)
    build_model(path, load_mtp=False)  # not needed without MTP


def test_unexpected_tensor_named(tmp_path, sd):
    path = _mutate(
        tmp_path,
        sd,
        lambda t: t.__setitem__("model.layers.1.self_attn.indexer.wk.weight", torch.zeros(32, 64)),
    )
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor model\.layers\.1\.self_attn\.indexer\.wk\.weight"
    ):
        build_model(path)  # layer 1 is a shared layer: it has no indexer


def test_unexpected_layer_named(tmp_path, sd):
    path = _mutate(
        tmp_path,
        sd,
        lambda t: t.__setitem__("model.layers.9.input_layernorm.weight", torch.ones(64)),
    )
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor model\.layers\.9\.input_layernorm\.weight"
    ):
        build_model(path)


def test_wrong_shape_named(tmp_path, sd):
    path = _mutate(
        tmp_path,
        sd,
        lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.weight", torch.zeros(64, 100)),
    )
    with pytest.raises(
        CheckpointError,
        match=r"model\.layers\.0\.self_attn\.o_proj\.weight has shape \(64, 100\), expected \(64, 128\)",
    ):
        build_model(path)


def test_fp8_without_scale_named(tmp_path, sd):
    path = _write(tmp_path, sd, fp8=True)
    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    t.pop("model.layers.0.mlp.up_proj.weight_scale_inv")
    save_file(t, f)
    with pytest.raises(
        CheckpointError,
        match=r"FP8 tensor model\.layers\.0\.mlp\.up_proj\.weight has no .*weight_scale_inv",
    ):
        build_model(path)


def test_missing_shard_file_named(tmp_path, sd):
    path = _write(tmp_path, sd, max_shard_bytes=200_000)
    victim = sorted(f for f in os.listdir(path) if f.startswith("model-00002-of-"))[0]
    os.remove(os.path.join(path, victim))
    with pytest.raises(CheckpointError, match="model-00002-of-.*missing"):
        build_model(path)


def test_no_weights_file(tmp_path):
    os.makedirs(tmp_path / "empty")
    with open(tmp_path / "empty" / "config.json", "w") as f:
        json.dump(TINY_CONFIG, f)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        build_model(str(tmp_path / "empty"))


def test_unsupported_architecture(tmp_path):
    os.makedirs(tmp_path / "llama")
    with open(tmp_path / "llama" / "config.json", "w") as f:
        json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, f)
    with pytest.raises(ValueError, match="unsupported model"):
        build_model(str(tmp_path / "llama"))
