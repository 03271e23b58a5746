"""The CPU KV offload tier on CUDA (one H200): pinned host slots, side-stream copies ordered
against the compute stream, and the engine reloading evicted prefixes with the same outputs."""

from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.distributed.kv_transfer.offload_store import HostKVStore

pytestmark = pytest.mark.gpu


def test_store_then_reuse_the_block_at_once():
    """A block is stored, then overwritten by the compute stream in the very next step (freed
    and reallocated): the guard makes the overwrite wait, so the host copy is the old content;
    a load back into other blocks returns it bit for bit."""
    dev = torch.device("cuda")
    caches = [(torch.randn(64, 64, 656, device=dev), torch.randn(64, 64 * 132, device=dev))]
    st = HostKVStore(32, dev)
    st.register(caches)
    assert st.host[0].is_pinned()
    want = [t[:16].clone() for t in caches[0]]
    torch.cuda._sleep(50_000_000)  # keep the compute stream busy: the store must wait for it
    st.store([(b, b) for b in range(16)])
    st.guard(range(8, 24))  # this step writes blocks 8..23
    for t in caches[0]:
        t[:24].fill_(-1.0)
    h = st.load([(40 + b, b) for b in range(16)])
    while not st.done(h):
        pass
    for t, w in zip(caches[0], want, strict=True):
        assert torch.equal(t[40:56], w)


def test_engine_reloads_evicted_prefixes_on_cuda(tiny_ckpt):
    prompts = [list(range(10 + 7 * i, 10 + 7 * i + 300)) for i in range(4)]
    order = [0, 1, 2, 3, 0, 2]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for extra in ({}, {"kv_offloading_size": 0.05}):
        llm = LLM(tiny_ckpt, device="cuda", num_gpu_blocks_override=10, **extra)
        try:
            outs = [llm.generate([{"prompt_token_ids": prompts[i]}], sp)[0] for i in order]
            runs.append(
                ([o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs])
            )
        finally:
            llm.shutdown()
    (ref, ref_cached), (got, cached) = runs
    assert got == ref
    assert cached[4:] == [256, 256] and ref_cached[4:] != [256, 256]
