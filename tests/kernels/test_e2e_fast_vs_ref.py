"""End to end: a GLM-5.3-shaped slice (real attention dims: 64 heads, 576/512 MLA, indexer
32×128, top-k 2048; 4 layers F F F S; hidden 1024 and 4 experts to stay small; random weights)
decodes past the top-k with the fast kernels and with the references on the same GPU.

Checks: logits within 3e-2 relative (bf16 model; the kernels round q, the dequantised rows and P
to bf16 where the references stay fp32) and the same greedy token wherever the reference's top-2
margin exceeds the observed logit error (random weights leave near-ties that no kernel can be
asked to break the same way).
"""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.tiny import GLM_SLICE  # noqa: E402


def _model(path, overrides, device):
    from vllm.model_executor.model_loader import build_model
    from vllm.model_executor.tiny.checkpoint import TINY_CONFIG, tiny_state_dict, write_checkpoint

    cfg = {**TINY_CONFIG, **overrides}
    write_checkpoint(str(path), cfg, tiny_state_dict(cfg, seed=5), tokenizer=False)
    return build_model(str(path), dtype=torch.bfloat16, device=device)


@pytest.fixture(scope="module")
def glm_slice(tmp_path_factory):
    return _model(tmp_path_factory.mktemp("glm-slice"), GLM_SLICE, "cuda")


def _fast_vs_ref(model, n_prompt, n_decode, cache_dtype, device, monkeypatch):
    from vllm.model_executor.simple_forward import prompt_logits

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, model.arch.vocab_size, (n_prompt + n_decode,), generator=g).tolist()
    kw = dict(cache_dtype=cache_dtype, chunk=1024, decode_from=n_prompt, device=device)
    fast = prompt_logits(model, ids, **kw)[n_prompt:]
    monkeypatch.setenv("VLLM_USE_REF_KERNELS", "1")
    ref = prompt_logits(model, ids, **kw)[n_prompt:]
    monkeypatch.delenv("VLLM_USE_REF_KERNELS")
    err = (fast - ref).abs().max(dim=-1).values  # [n_decode]
    rel = ((fast - ref).norm() / ref.norm()).item()
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * err
    same = fast.argmax(-1) == ref.argmax(-1)
    return rel, bool(same[clear].all()), int(clear.sum())


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
def test_glm_slice_decode_fast_equals_ref(glm_slice, monkeypatch, cache_dtype):
    rel, same, n_clear = _fast_vs_ref(glm_slice, 2100, 6, cache_dtype, "cuda", monkeypatch)
    assert rel < 3e-2, rel
    assert same and n_clear >= 3


def test_tiny_slice_plumbing_on_cpu(tmp_path, monkeypatch):
    """The same harness at toy size on CPU (both sides are references there): the plumbing the
    GPU test relies on stays importable and runs."""
    small = {"num_hidden_layers": 2, "num_nextn_predict_layers": 0, "index_topk": 16}
    model = _model(tmp_path, small, "cpu")
    rel, same, _ = _fast_vs_ref(model, 40, 3, "fp8_ds_mla", "cpu", monkeypatch)
    assert rel == 0.0 and same
