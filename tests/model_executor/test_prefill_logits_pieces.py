"""Prefill cuts a run's [queries, keys] indexer logits into row pieces under a byte cap (each
piece scores keys up to its own last position): the selections and the logits are unchanged."""

from __future__ import annotations

import pytest
import torch

from vllm.attention import layer as attn_layer
from vllm.model_executor.model_loader import build_model
from vllm.model_executor.simple_forward import prompt_logits


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_ds_mla"])
def test_capped_logits_pieces_match_whole_runs(tiny_ckpt, monkeypatch, cache_dtype):
    model = build_model(tiny_ckpt)
    ids = [(7 * i) % 500 + 3 for i in range(200)]  # 200 tokens > index_topk 32: scored
    whole = prompt_logits(model, ids, cache_dtype, chunk=96)
    calls = []
    real = attn_layer.indexer_logits

    def spy(q, *a):
        calls.append((q.shape[0], a[-2].shape[0]))
        return real(q, *a)

    # 4 bytes · 40 keys · 7 rows: pieces of a few rows, each scoring fewer keys than the run
    monkeypatch.setattr(attn_layer, "PREFILL_LOGITS_MAX_BYTES", 4 * 40 * 7)
    monkeypatch.setattr(attn_layer, "indexer_logits", spy)
    pieces = prompt_logits(model, ids, cache_dtype, chunk=96)
    assert torch.equal(pieces, whole)
    assert max(r for r, _ in calls) < 96 and len({k for _, k in calls}) > 3


def test_attention_pieces_match_whole_chunk(tiny_ckpt, monkeypatch):
    """Sparse prefill attention runs in PREFILL_ATTN_MAX_TOKENS pieces of a chunk (bounding the
    fp32 absorbed queries): same logits as one call per chunk."""
    model = build_model(tiny_ckpt)
    ids = [(5 * i) % 500 + 3 for i in range(200)]
    monkeypatch.setattr(attn_layer, "PREFILL_ATTN_MAX_TOKENS", 1 << 20)
    whole = prompt_logits(model, ids, "auto", chunk=96)
    sizes = []
    real = attn_layer.sparse_mla_prefill

    def spy(q, *a):
        sizes.append(q.shape[0])
        return real(q, *a)

    monkeypatch.setattr(attn_layer, "PREFILL_ATTN_MAX_TOKENS", 13)
    monkeypatch.setattr(attn_layer, "sparse_mla_prefill", spy)
    pieces = prompt_logits(model, ids, "auto", chunk=96)
    torch.testing.assert_close(pieces, whole, rtol=1e-5, atol=1e-5)
    assert sizes and max(sizes) == 13 and min(sizes) < 13


def test_bf16_model_prefill_and_decode_paths(tiny_ckpt):
    """A bf16 model (the dtype served on GPUs) through sparse prefill, chunked prefill and the
    decode path: outputs keep the model's dtype and stay close to the fp32 model."""
    ids = [(3 * i) % 500 + 3 for i in range(120)]
    ref = prompt_logits(build_model(tiny_ckpt), ids, "auto", chunk=64, decode_from=40)
    got = prompt_logits(
        build_model(tiny_ckpt, dtype=torch.bfloat16), ids, "auto", chunk=64, decode_from=40
    )
    assert got.shape == ref.shape and torch.isfinite(got).all()
    # bf16 activations and bf16 absorbed W_UK/W_UV: most rows within ~1-2 % of the logits' scale
    # (a few rows differ more where a rounding flips an expert choice or a top-k member of this
    # random toy model, so the medians are over 80 decode rows: over 20 they swung 1.0-2.9 %
    # between prompts, for fp32 and bf16 absorption alike)
    err = (got.float() - ref).abs().amax(-1) / ref.abs().amax(-1)
    assert err.median() < 0.02 and err[40:].median() < 0.02
