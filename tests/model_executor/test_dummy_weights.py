"""`--load-format dummy` (random weights of the config's shapes, no checkpoint read) and
`--hf-overrides` (config.json fields replaced): what a user times an architecture with."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from vllm.config.arch import ModelArch
from vllm.engine.arg_utils import EngineArgs
from vllm.kv_cache_interface import FP8_DTYPE
from vllm.model_executor.layers.linear import Linear, dequant_block_fp8
from vllm.model_executor.model_loader import build_model


def _config_only(src: str, dst: str) -> str:
    """A model folder without weights: config.json and the tokenizer files only."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and not name.endswith(".index.json"):
            shutil.copy(os.path.join(src, name), dst)
    return dst


@pytest.mark.parametrize("fp8", [False, True])
def test_dummy_weights_shapes_and_scales(tiny_ckpt, tiny_ckpt_fp8, tmp_path, fp8):
    """No weight file is read; FP8 stays e4m3 with positive scales; linear weights have the
    spread N(0, 1/in) the rule states; norms sit near 1; everything finite."""
    path = _config_only(tiny_ckpt_fp8 if fp8 else tiny_ckpt, str(tmp_path / "cfg"))
    with pytest.raises(Exception):  # noqa: B017 - the real loader finds no weights here
        build_model(path)
    m = build_model(path, load_format="dummy")
    ref = build_model(tiny_ckpt_fp8 if fp8 else tiny_ckpt)
    ours, theirs = dict(m.named_parameters()), dict(ref.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert p.shape == theirs[name].shape and p.dtype == theirs[name].dtype, name
        assert torch.isfinite(p.float()).all(), name
    n_fp8 = 0
    for name, mod in m.named_modules():
        if not isinstance(mod, Linear) or mod.weight.shape[1] < 32:
            continue
        if mod.is_fp8:
            n_fp8 += 1
            assert (mod.weight_scale_inv > 0).all(), name
        w = mod.dense_weight(torch.float32)
        std = w.std().item() * mod.weight.shape[1] ** 0.5
        want = 3.0 if name == "lm_head" else 1.0
        assert 0.8 * want < std < 1.2 * want, (name, std)
    assert (n_fp8 > 0) == fp8
    norm = ours["model.norm.weight"]
    assert abs(norm.mean().item() - 1.0) < 0.1 and 0.05 < norm.std().item() < 0.2
    if fp8:  # experts per expert: each half of w13 quantised with its own scales
        e = m.model.layers[-1].mlp.experts
        w13 = dequant_block_fp8(e.w13_weight[0], e.w13_weight_scale_inv[0], e.block)
        assert e.w13_weight.dtype == FP8_DTYPE
        assert 0.8 < w13.std().item() * e.w13_weight.shape[2] ** 0.5 < 1.2


def test_dummy_model_serves(tiny_ckpt, tmp_path):
    """The engine generates from dummy weights with nothing but config.json and a tokenizer,
    deterministically (the same seed), and routing reaches several experts."""
    from vllm import LLM, SamplingParams

    path = _config_only(tiny_ckpt, str(tmp_path / "cfg"))
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 70)]
    outs = []
    for _ in range(2):
        llm = LLM(path, load_format="dummy", hf_overrides={"num_hidden_layers": 2})
        try:
            got = llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            )
            outs.append([o.outputs[0].token_ids for o in got])
        finally:
            llm.shutdown()
    assert outs[0] == outs[1] and all(len(t) == 6 for t in outs[0])
    m = build_model(path, load_format="dummy")
    moe = next(layer.mlp for layer in m.model.layers if hasattr(layer.mlp, "gate"))
    x = torch.randn(64, m.arch.hidden_size)
    logits = torch.nn.functional.linear(x, moe.gate.weight.float())
    assert len(set(logits.argmax(-1).tolist())) > 1


def test_hf_overrides(tiny_ckpt):
    """Fields replaced; a smaller depth cuts the per-layer lists; bad JSON and a bad load format
    are start-up errors naming the flag."""
    with open(os.path.join(tiny_ckpt, "config.json")) as f:
        raw = json.load(f)
    base = ModelArch.from_pretrained(tiny_ckpt)
    cfg = EngineArgs(
        model=tiny_ckpt, hf_overrides='{"num_hidden_layers": 2, "n_routed_experts": 16}'
    ).create_engine_config()
    arch = cfg.model_config.arch
    assert arch.num_hidden_layers == 2 and arch.n_routed_experts == 16
    assert arch.indexer_types == base.indexer_types[:2]
    assert base.num_hidden_layers == raw["num_hidden_layers"] > 2
    with pytest.raises(ValueError, match="--hf-overrides must be a JSON object"):
        EngineArgs(model=tiny_ckpt, hf_overrides="{nope").create_engine_config()
    with pytest.raises(ValueError, match="--hf-overrides must be a JSON object"):
        EngineArgs(model=tiny_ckpt, hf_overrides="[1, 2]").create_engine_config()
    with pytest.raises(ValueError, match="--load-format 'pt' is not supported"):
        EngineArgs(model=tiny_ckpt, load_format="pt").create_engine_config()
    with pytest.raises(ValueError, match="indexer_types has 3 entries for 2 layers"):
        # a depth the per-layer lists cannot be cut to: given explicitly, they must match
        EngineArgs(
            model=tiny_ckpt,
            hf_overrides={"num_hidden_layers": 2, "indexer_types": ["full"] * 3},
        ).create_engine_config()


def test_cli_flags(tiny_ckpt):
    import argparse

    from vllm.engine.arg_utils import add_engine_args

    p = add_engine_args(argparse.ArgumentParser())
    a = p.parse_args(["--load-format", "dummy", "--hf-overrides", '{"num_hidden_layers": 2}'])
    ea = EngineArgs.from_cli_args(a)
    ea.model = tiny_ckpt
    cfg = ea.create_engine_config()
    assert cfg.model_config.load_format == "dummy" and cfg.model_config.arch.num_hidden_layers == 2
