"""Parity with an independent implementation: HF transformers' GlmMoeDsaForCausalLM.

Semantic differences we found and how the test handles them:
  * HF builds q_a_layernorm / kv_a_layernorm with eps 1e-6 while config.rms_norm_eps is 1e-5; we
    (like upstream vLLM) use rms_norm_eps. The test sets HF's two norms to rms_norm_eps.
  * HF's indexer runs in full precision with no Hadamard rotation; ours rotates q and k (an
    orthonormal transform: dot products are unchanged in exact arithmetic) and, with the FP8 KV
    cache only, quantises q and k to e4m3 with power-of-two scales.
  * HF's interleaved RoPE returns the rotated pairs de-interleaved ([evens | odds]); we keep the
    pairs in place. Both q and k use the same layout, so every dot product is the same.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.24")

from vllm.model_executor.model_loader import build_model  # noqa: E402
from vllm.model_executor.simple_forward import prompt_logits  # noqa: E402

TOPK = 16


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(1234)
    cfg = GlmMoeDsaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        kv_lora_rank=128,
        q_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        index_topk=TOPK,
        index_head_dim=32,
        index_n_heads=16,
        first_k_dense_replace=1,
        index_topk_freq=2,
        index_skip_topk_offset=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    hf = GlmMoeDsaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.05)
    for name, m in hf.named_modules():
        if name.endswith(("q_a_layernorm", "kv_a_layernorm")):
            m.variance_epsilon = cfg.rms_norm_eps
    assert cfg.indexer_types == ["full", "shared", "full", "shared"]
    path = str(tmp_path_factory.mktemp("hf") / "ckpt")
    hf.save_pretrained(path)
    return hf, build_model(path)


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _rel(a, b):
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


@pytest.mark.parametrize("mode", ["prefill", "chunked", "decode", "force_mqa"])
def test_fp32_auto_kv_matches_transformers(hf_pair, mode):
    hf, ours = hf_pair
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(
        0, 256, (75,), generator=g
    ).tolist()  # > index_topk: sparse on both layer kinds
    ref = _hf_logits(hf, ids)
    if mode == "force_mqa":
        for attn in ours.attention_layers():
            attn.force_mqa = True
    try:
        kw = {
            "prefill": {},
            "chunked": {"chunk": 13},
            "decode": {"decode_from": 9},
            "force_mqa": {"chunk": 13},
        }[mode]
        got = prompt_logits(ours, ids, "auto", **kw)
    finally:
        for attn in ours.attention_layers():
            attn.force_mqa = False
    # fp32 rounding: different but equivalent summation orders (absorbed MLA, RoPE layout)
    assert _rel(got, ref).max() < 2e-5
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_topk_selection_matches_transformers_indexer(hf_pair):
    """Our per-layer top-k sets equal HF's indexer selections (full layers) for every query past
    index_topk, and shared layers reuse the previous full layer's set."""
    hf, ours = hf_pair
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    hf_sel = {}

    def hook(layer_idx):
        def fn(mod, args, out):
            hf_sel[layer_idx] = out[0]

        return fn

    hs = [
        layer.self_attn.indexer.register_forward_hook(hook(i))
        for i, layer in enumerate(hf.model.layers)
        if layer.self_attn.indexer is not None
    ]
    ours_sel = {}
    oh = [
        layer.self_attn.attn.register_forward_hook(
            lambda m, a, o, i=i: ours_sel.__setitem__(i, o[1].clone())
        )
        for i, layer in enumerate(ours.model.layers)
    ]
    try:
        _hf_logits(hf, ids)
        prompt_logits(ours, ids, "auto")
    finally:
        for h in hs + oh:
            h.remove()
    for layer_idx in (0, 2):
        for t in range(TOPK, len(ids)):
            assert set(hf_sel[layer_idx][t].tolist()) == set(ours_sel[layer_idx][t].tolist()), (
                layer_idx,
                t,
            )
    assert torch.equal(ours_sel[1], ours_sel[0]) and torch.equal(ours_sel[3], ours_sel[2])


def test_fp8_kv_within_fp8_error(hf_pair):
    """FP8 KV (e4m3 latent with per-128 scales, bf16 rope, FP8 indexer).

    Tolerance: e4m3 keeps 3 mantissa bits, so each cached latent value carries up to 2^-4
    relative rounding error of its tile's scale (about 3 % on average). On a prompt no longer than
    index_topk (every position attended) that error is all there is: we allow 6 % mean relative
    logit error. Past index_topk the FP8 indexer may also swap positions at the top-k boundary;
    we allow 15 % mean and require most greedy tokens to agree.
    """
    hf, ours = hf_pair
    ids = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(11)).tolist()
    short = ids[:TOPK]
    rel_short = _rel(prompt_logits(ours, short, "fp8_ds_mla"), _hf_logits(hf, short))
    assert rel_short.mean() < 0.06
    ref = _hf_logits(hf, ids)
    got = prompt_logits(ours, ids, "fp8_ds_mla")
    assert _rel(got, ref).mean() < 0.15
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8
    # and it is genuinely quantised: not bit-equal to the full-precision cache
    assert not torch.allclose(got, prompt_logits(ours, ids, "auto"))
