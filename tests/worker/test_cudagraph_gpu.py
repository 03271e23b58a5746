"""Decode CUDA graphs on one GPU: the engine with graphs gives the greedy tokens of the eager
engine on a GLM-5.3-shaped slice (real attention and indexer dims, so the production decode
kernels run inside the graphs), while batches shrink, grow, hit the prefix cache and get
preempted between replays; a batch larger than every captured size still runs (eagerly).

"The same greedy tokens" is checked up to near-ties: a graph pads the batch to its captured size,
so its GEMMs run at another M than the eager step's, and bf16 results differ in the last bits
(the eager engine itself is not batch-invariant: the same prompts scheduled differently, e.g.
with prefix hits, flip near-ties of this random-weight model). A sequence may leave the reference
only where the reference's top-2 logprobs were within NEAR_TIE; after that the sequences no longer
share a context and are not compared. A stale or misplaced input row gives garbage from its first
token, far outside that margin."""

from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.model_executor.tiny import GLM_SLICE

pytestmark = pytest.mark.gpu

# prompts past top-k 2048 so the indexer's selection is genuinely sparse for some rows
LENGTHS = (5, 300, 2100, 2600, 900, 40)
MAX_TOKENS = (3, 30, 9, 17, 24, 5)


@pytest.fixture(scope="module")
def slice_ckpt(tmp_path_factory):
    from vllm.model_executor.tiny import TINY_CONFIG, tiny_state_dict, write_checkpoint

    path = str(tmp_path_factory.mktemp("glm-slice-graphs"))
    cfg = {**TINY_CONFIG, **GLM_SLICE}
    write_checkpoint(path, cfg, tiny_state_dict(cfg, seed=5), tokenizer=False)
    return path


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(10, 1000, (n,), generator=g).tolist() for n in LENGTHS]


# nats: logits are bf16, whose step at this model's magnitudes (8-16) is 0.0625-0.125; a padded
# batch moved one by a step on the H200 (gap 0.0625 at the first divergence)
NEAR_TIE = 0.25


def _run(m: LLM, prompts=None):
    prompts = prompts or _prompts()
    sp = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
        for n in MAX_TOKENS[: len(prompts)]
    ]
    outs = m.generate([{"prompt_token_ids": p} for p in prompts], sp)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def assert_same_greedy(ref, got) -> int:
    """Every sequence equals its reference until a near-tie of the reference; returns the
    number of tokens compared."""
    compared = 0
    for (rt, rlp), (gt, _) in zip(ref, got, strict=True):
        assert len(rt) == len(gt)
        for j, (a, b) in enumerate(zip(rt, gt, strict=True)):
            if a != b:
                top = sorted((v.logprob for v in rlp[j].values()), reverse=True)
                assert top[0] - top[1] < NEAR_TIE, (j, a, b, top)
                break
            compared += 1
    return compared


def _graph_steps(m: LLM) -> int:
    return sum(s.num_cudagraph_steps for s in m.stats_history)


@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
def test_graphs_equal_eager(slice_ckpt, cache_dtype):
    kw = dict(
        device="cuda",
        kv_cache_dtype=cache_dtype,
        skip_tokenizer_init=True,
        max_num_batched_tokens=1024,
        max_num_seqs=8,
        max_model_len=4096,
        kv_cache_memory_bytes=2 << 30,
    )
    eager = LLM(slice_ckpt, enforce_eager=True, **kw)
    try:
        ref = _run(eager)
        ref_again = _run(eager)  # prefix hits: other step compositions
    finally:
        eager.shutdown()
    # 6 decoding requests exceed the largest captured size (4): those steps run eagerly
    graphs = LLM(slice_ckpt, compilation_config={"cudagraph_capture_sizes": [1, 2, 4]}, **kw)
    try:
        got = _run(graphs)
        assert _graph_steps(graphs) >= 10
        # the prompt chunks replayed piecewise graphs (FULL_AND_PIECEWISE, the default)
        assert sum(s.num_piecewise_steps for s in graphs.stats_history) >= 3
        got_again = _run(graphs)
    finally:
        graphs.shutdown()
    assert assert_same_greedy(ref, got) >= sum(MAX_TOKENS) // 2
    assert assert_same_greedy(ref_again, got_again) >= sum(MAX_TOKENS) // 2


def test_graphs_under_preemption(slice_ckpt):
    kw = dict(
        device="cuda",
        kv_cache_dtype="fp8_ds_mla",
        skip_tokenizer_init=True,
        max_num_batched_tokens=1024,
        max_model_len=4096,
        num_gpu_blocks_override=80,
        kv_cache_memory_bytes=1 << 30,
    )
    eager = LLM(slice_ckpt, enforce_eager=True, **kw)
    try:
        ref = _run(eager)
    finally:
        eager.shutdown()
    m = LLM(slice_ckpt, compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]}, **kw)
    try:
        got = _run(m)
        assert sum(s.num_preemptions for s in m.stats_history) > 0
        assert _graph_steps(m) > 0
    finally:
        m.shutdown()
    assert assert_same_greedy(ref, got) >= sum(MAX_TOKENS) // 2


def test_async_scheduling_pipelined_on_cuda(slice_ckpt):
    """--async-scheduling on the GPU: the worker launches step N + 1 before it reads step N (real
    events, the two staging arenas, slots freed and reused while a step is in flight, preemption)
    and decodes the greedy tokens of the synchronous engine."""
    kw = dict(
        device="cuda",
        kv_cache_dtype="fp8_ds_mla",
        skip_tokenizer_init=True,
        max_num_batched_tokens=1024,
        max_model_len=4096,
        num_gpu_blocks_override=80,
        kv_cache_memory_bytes=1 << 30,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
    )
    sync = LLM(slice_ckpt, **kw)
    try:
        ref = _run(sync)
        # prefix hits change the steps' composition: the second runs are compared together
        ref_again = _run(sync)
    finally:
        sync.shutdown()
    m = LLM(slice_ckpt, async_scheduling=True, **kw)
    try:
        got = _run(m)
        got_again = _run(m)  # prefix hits
        assert sum(s.num_pipelined_steps for s in m.stats_history) >= 10
        assert _graph_steps(m) > 0
    finally:
        m.shutdown()
    assert assert_same_greedy(ref, got) >= sum(MAX_TOKENS) // 2
    assert assert_same_greedy(ref_again, got_again) >= sum(MAX_TOKENS) // 2


def test_piecewise_only_on_cuda(slice_ckpt):
    """PIECEWISE: every forward, decode steps included, replays captured pieces (projections,
    MoE, norms, TP reduces) around eager attention layers; chunks from 5 to 1,024 tokens pad to
    other captured token counts every step."""
    kw = dict(
        device="cuda",
        kv_cache_dtype="fp8_ds_mla",
        skip_tokenizer_init=True,
        max_num_batched_tokens=1024,
        max_num_seqs=8,
        max_model_len=4096,
        kv_cache_memory_bytes=2 << 30,
    )
    eager = LLM(slice_ckpt, enforce_eager=True, **kw)
    try:
        ref = _run(eager)
        # prefix hits change the steps' composition: the second runs are compared together
        ref_again = _run(eager)
    finally:
        eager.shutdown()
    m = LLM(slice_ckpt, compilation_config={"cudagraph_mode": "PIECEWISE"}, **kw)
    try:
        got = _run(m)
        got_again = _run(m)  # prefix hits
        assert _graph_steps(m) == 0
        assert sum(s.num_piecewise_steps for s in m.stats_history) >= 20
    finally:
        m.shutdown()
    assert assert_same_greedy(ref, got) >= sum(MAX_TOKENS) // 2
    assert assert_same_greedy(ref_again, got_again) >= sum(MAX_TOKENS) // 2
