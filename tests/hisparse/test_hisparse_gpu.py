"""HiSparse on an H200: the same greedy identity as the CPU test, with the host pool in pinned
memory read zero-copy by the resolver, and the fast kernels."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]


def test_hisparse_identity_on_gpu(tiny_ckpt):
    prompts = [
        [(7 * i + 3 * j) % 1000 + 3 for i in range(n)] for j, n in enumerate((1500, 700, 2100))
    ]
    sp = SamplingParams(temperature=0, max_tokens=66, ignore_eos=True)

    def run(**kw):
        llm = LLM(
            tiny_ckpt,
            device="cuda",
            kv_cache_dtype="fp8_ds_mla",
            max_num_batched_tokens=256,
            kv_cache_memory_bytes=256 * 2**20,
            **kw,
        )
        try:
            outs = [
                o.outputs[0].token_ids
                for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
            ]
            return outs, llm.stats_history
        finally:
            llm.shutdown()

    ref, _ = run()
    got, stats = run(
        attention_config={"hisparse_config": {"host_pool_gib": 0.05}}, num_gpu_blocks_override=14
    )
    assert got == ref
    assert max((s.extra or {}).get("hisparse_pages_dropped_total", 0) for s in stats) > 0
    assert sum((s.extra or {}).get("hisparse_h2d_bytes_per_step", 0) for s in stats) > 0
