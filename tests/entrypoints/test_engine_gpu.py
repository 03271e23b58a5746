"""The engine on CUDA (one H200): fast kernels in the real runner, FP8 weights kept in FP8."""

from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_ds_mla"])
def test_engine_on_cuda_generates(tiny_ckpt, cache_dtype):
    llm = LLM(
        tiny_ckpt, device="cuda", kv_cache_dtype=cache_dtype, kv_cache_memory_bytes=256 * 2**20
    )
    try:
        prompts = [list(range(10, 10 + n)) for n in (5, 40, 150, 700)]
        sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
        a = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        b = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        assert [o.outputs[0].token_ids for o in a] == [
            o.outputs[0].token_ids for o in b
        ]  # deterministic
        assert all(len(o.outputs[0].token_ids) == 24 for o in a)
        assert all(o.outputs[0].logprobs[0] for o in a)
    finally:
        llm.shutdown()


def test_fp8_checkpoint_stays_fp8_on_cuda(tiny_ckpt_fp8):
    from vllm.model_executor.model_loader import build_model
    from vllm.model_executor.simple_forward import prompt_logits

    gpu = build_model(tiny_ckpt_fp8, dtype=torch.bfloat16, device="cuda")
    lin = gpu.model.layers[0].self_attn.q_b_proj
    assert lin.weight.dtype == torch.float8_e4m3fn and lin.weight_scale_inv is not None
    cpu = build_model(tiny_ckpt_fp8, dtype=torch.float32, device="cpu")  # e4m3 too (references)
    ids = list(range(20, 60))
    a = prompt_logits(gpu, ids, device="cuda").float().cpu()
    b = prompt_logits(cpu, ids)
    rel = ((a - b).norm(dim=-1) / b.norm(dim=-1)).mean()
    # bf16 activations vs fp32 on the same FP8 weights; both sides round activations to e4m3 per
    # 128-group, and a bf16 difference that crosses an e4m3 rounding boundary moves a value by a
    # whole e4m3 step (2^-4 relative), which this random toy model amplifies (measured on an
    # H200: 0.107; tests/model_executor/test_fp8_weights.py states the whole-model bound)
    assert rel < 0.2
