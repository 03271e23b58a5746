"""The worker keeps aside `activation_bytes(...)` for a max_num_batched_tokens chunk when it sizes
the KV cache: on CUDA, the estimate must cover the measured peak of a whole-chunk prefill of the
GLM-5.3 slice (real attention and indexer dimensions) on the sparse path."""

from __future__ import annotations

import pytest
import torch

from vllm.config.arch import ModelArch
from vllm.model_executor.model_loader import build_model
from vllm.model_executor.simple_forward import SimpleKV
from vllm.model_executor.tiny import GLM_SLICE, TINY_CONFIG, tiny_state_dict, write_checkpoint
from vllm.worker.gpu.model_runner import activation_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [4096, 32768])
def test_estimate_covers_measured_prefill_peak(tmp_path, tokens):
    cfg = {**TINY_CONFIG, **GLM_SLICE}
    write_checkpoint(str(tmp_path), cfg, tiny_state_dict(cfg, seed=0), tokenizer=False)
    model = build_model(str(tmp_path), dtype=torch.bfloat16, device="cuda")
    kv = SimpleKV(model, "fp8_ds_mla", tokens, 1, "cuda")
    ids = torch.randint(3, 1000, (tokens,), device="cuda")
    meta, pos = kv.metadata([(0, 0, tokens)], [False])
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        model(ids, pos, meta)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    est = activation_bytes(ModelArch.from_dict(cfg), torch.bfloat16, tokens)
    assert peak <= est, f"measured {peak / 2**30:.2f} GiB > estimate {est / 2**30:.2f} GiB"
