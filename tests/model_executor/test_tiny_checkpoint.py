"""The built-in tiny checkpoint: a real HF folder with the GLM-5.3 architecture at toy size."""

from __future__ import annotations

import json
import os

import torch

from vllm.config.arch import ModelArch
from vllm.model_executor.model_loader import build_model
from vllm.model_executor.simple_forward import SimpleKV, prompt_logits


def test_tiny_checkpoint_is_a_real_hf_folder(tiny_ckpt):
    files = set(os.listdir(tiny_ckpt))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    arch = ModelArch.from_pretrained(tiny_ckpt)
    assert "full" in arch.indexer_types and "shared" in arch.indexer_types
    assert arch.first_k_dense_replace >= 1 and arch.n_routed_experts > arch.num_experts_per_tok
    assert arch.num_nextn_predict_layers == 1 and arch.index_topk <= 32
    tok_cfg = json.load(open(os.path.join(tiny_ckpt, "tokenizer_config.json")))
    assert "<|assistant|>" in tok_cfg["chat_template"]
    transformers = __import__("pytest").importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_ckpt)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "[gMASK]<sop><|user|>\nhi<|assistant|>\n"


def test_tiny_checkpoint_is_deterministic(tmp_path):
    from vllm.model_executor.tiny import write_tiny_checkpoint

    a = write_tiny_checkpoint(str(tmp_path / "a"))
    b = write_tiny_checkpoint(str(tmp_path / "b"))
    assert (
        open(os.path.join(a, "model.safetensors"), "rb").read()
        == open(os.path.join(b, "model.safetensors"), "rb").read()
    )


def test_long_prompt_is_sparse_and_bf16_runs(tiny_ckpt):
    model = build_model(tiny_ckpt, dtype=torch.bfloat16)
    ids = list(range(10, 130))  # 120 tokens > index_topk 32
    sel = {}
    hook = model.model.layers[0].self_attn.attn.register_forward_hook(
        lambda m, a, o: sel.update(k=o[1])
    )
    logits = prompt_logits(model, ids)
    hook.remove()
    assert logits.shape == (120, model.arch.vocab_size) and torch.isfinite(logits).all()
    assert (sel["k"][-1] >= 0).sum() == model.arch.index_topk  # last token attends 32 of 120


def test_mtp_layer_is_callable_as_draft_step(tiny_ckpt):
    model = build_model(tiny_ckpt)
    ids = torch.tensor(list(range(20, 60)))
    kv = SimpleKV(model, "auto", 64)
    meta, pos = kv.metadata([(0, 0, 40)])
    hidden = model(ids, pos, meta)
    # draft (as upstream's MTP proposer): at position t, token t+1's embedding with hidden state t
    meta, pos = kv.metadata([(0, 0, 39)])
    draft_h = model.mtp_forward(ids[1:], hidden[:-1], pos, meta)
    logits = model.mtp_logits(draft_h)
    assert logits.shape == (39, model.arch.vocab_size) and torch.isfinite(logits).all()
    assert (
        model.model.mtp[0].block.self_attn.attn.kv_cache.abs().sum() > 0
    )  # it wrote its own cache
