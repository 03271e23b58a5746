"""With the same per-rank KV budget, DCP N admits an N× longer context."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.config.arch import ModelArch
from vllm.kv_cache_interface import kv_bytes_per_token

pytestmark = pytest.mark.distributed


def test_prompt_refused_at_dcp1_is_served_at_dcp4(tiny_ckpt):
    arch = ModelArch.from_pretrained(tiny_ckpt)
    import torch

    per_block = kv_bytes_per_token(arch, "auto", torch.float32, num_mtp_layers=0) * 64
    budget = 4 * per_block  # 4 blocks = 256 tokens per rank
    prompt = {"prompt_token_ids": [(7 * i) % 1000 + 3 for i in range(700)]}
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    small = LLM(tiny_ckpt, kv_cache_memory_bytes=budget)
    try:
        assert small.client.info["max_request_tokens"] == 256
        with pytest.raises(ValueError, match="KV cache holds at most 256 tokens"):
            small.generate(prompt, sp)
    finally:
        small.shutdown()
    big = LLM(
        tiny_ckpt,
        kv_cache_memory_bytes=budget,
        prefill_context_parallel_size=4,
        decode_context_parallel_size=4,
    )
    try:
        assert big.client.info["max_request_tokens"] == 1024
        got = big.generate(prompt, sp)[0].outputs[0].token_ids
    finally:
        big.shutdown()
    ref = LLM(tiny_ckpt)
    try:
        assert got == ref.generate(prompt, sp)[0].outputs[0].token_ids
    finally:
        ref.shutdown()
