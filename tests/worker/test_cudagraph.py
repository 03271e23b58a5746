"""Decode CUDA graphs: `--compilation-config` validation, and the graphs' static-buffer decode path
against the eager one. On CPU the static path runs uncaptured (same buffers, same padding), so
batches that shrink, grow, get preempted or hit the prefix cache between replays are checked here;
tests/worker/test_cudagraph_gpu.py replays real graphs on CUDA."""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.config.compilation import (
    CompilationConfig,
    default_capture_sizes,
    default_piecewise_sizes,
)
from vllm.distributed.ep import ep_forward, ep_moe, max_tokens_across_ep
from vllm.engine.arg_utils import EngineArgs
from vllm.worker.gpu.model_runner import ModelRunner


def _cc(value, eager=False, seqs=256):
    return CompilationConfig.from_json(value, enforce_eager=eager, max_num_seqs=seqs)


def test_defaults_follow_upstream():
    c = _cc(None)
    assert c.cudagraph_mode == "FULL_AND_PIECEWISE" and c.use_cudagraph
    assert c.cudagraph_capture_sizes[:5] == (1, 2, 4, 8, 16)
    assert c.max_capture_size == 256
    assert default_capture_sizes(300)[-1] == 288
    # a decode batch never exceeds --max-num-seqs: larger sizes are dropped
    assert _cc(None, seqs=20).cudagraph_capture_sizes == (1, 2, 4, 8, 16)
    assert _cc('{"cudagraph_capture_sizes": [8, 2, 2]}').cudagraph_capture_sizes == (2, 8)
    assert _cc(None, eager=True).cudagraph_mode == "NONE"
    assert not _cc(None, eager=True).use_cudagraph
    assert _cc('{"cudagraph_mode": "full_decode_only"}').cudagraph_mode == "FULL_DECODE_ONLY"
    c = _cc('{"cudagraph_capture_sizes": [1, 3, 6]}')
    assert [c.padded_size(n) for n in (1, 2, 3, 4, 6, 7)] == [1, 3, 3, 6, 6, None]


def test_piecewise_sizes():
    """Piecewise graphs count tokens: 16, 32, 64 then 2^k and 1.5·2^k up to the step budget
    (by default at most 8,192), which is always one; the modes choose which kinds are on."""
    assert default_piecewise_sizes(64) == [16, 32, 64]
    assert default_piecewise_sizes(2048)[-6:] == [384, 512, 768, 1024, 1536, 2048]
    assert default_piecewise_sizes(1000)[-3:] == [512, 768, 1000]
    c = CompilationConfig.from_json(None, enforce_eager=False, max_num_seqs=8,
                                    max_num_batched_tokens=2048)  # fmt: skip
    assert c.use_cudagraph and c.use_piecewise and c.piecewise_capture_sizes[-1] == 2048
    c = CompilationConfig.from_json(None, enforce_eager=False, max_num_seqs=8,
                                    max_num_batched_tokens=1 << 20)  # fmt: skip
    assert c.piecewise_capture_sizes[-1] == 8192
    c = _cc('{"cudagraph_mode": "PIECEWISE", "piecewise_capture_sizes": [64, 8, 8]}')
    assert not c.use_cudagraph and c.piecewise_capture_sizes == (8, 64)
    c = _cc('{"cudagraph_mode": "FULL_DECODE_ONLY"}')
    assert c.use_cudagraph and not c.use_piecewise
    assert not _cc(None, eager=True).use_piecewise


@pytest.mark.parametrize(
    "value, field",
    [
        ('{"cudagraph_mode": "FULL"}', "cudagraph_mode"),
        ('{"cudagraph_mode": "fast"}', "cudagraph_mode"),
        ('{"cudagraph_mode": 3}', "cudagraph_mode"),
        ('{"cudagraph_capture_sizes": [0, 1]}', "cudagraph_capture_sizes"),
        ('{"cudagraph_capture_sizes": "1,2"}', "cudagraph_capture_sizes"),
        ('{"cudagraph_capture_sizes": [true]}', "cudagraph_capture_sizes"),
        ('{"cudagraph_capture_sizes": [512]}', "cudagraph_capture_sizes"),
        ('{"max_cudagraph_capture_size": 0}', "max_cudagraph_capture_size"),
        ('{"max_cudagraph_capture_size": "8"}', "max_cudagraph_capture_size"),
        ('{"piecewise_capture_sizes": [0]}', "piecewise_capture_sizes"),
        ('{"piecewise_capture_sizes": 512}', "piecewise_capture_sizes"),
        ('{"piecewise_capture_sizes": [4096]}', "piecewise_capture_sizes"),  # over the budget
        ('{"level": 3}', "unknown keys"),
        ("[1, 2]", "JSON object"),
        ("{not json", "JSON object"),
    ],
)
def test_bad_values_name_the_field(value, field):
    with pytest.raises(ValueError, match=field) as e:
        _cc(value)
    assert "--compilation-config" in str(e.value)


def test_engine_args_wire_the_flag(tiny_ckpt):
    cfg = EngineArgs(model=tiny_ckpt).create_engine_config()
    assert cfg.compilation_config.cudagraph_mode == "NONE"  # CPU, no flag: eager
    cfg = EngineArgs(
        model=tiny_ckpt, compilation_config={"cudagraph_capture_sizes": [1, 4]}
    ).create_engine_config()
    assert cfg.compilation_config.cudagraph_capture_sizes == (1, 4)
    cfg = EngineArgs(
        model=tiny_ckpt, compilation_config='{"cudagraph_capture_sizes": [1]}', enforce_eager=True
    ).create_engine_config()
    assert not cfg.compilation_config.use_cudagraph
    with pytest.raises(ValueError, match="cudagraph_mode"):
        EngineArgs(
            model=tiny_ckpt, compilation_config='{"cudagraph_mode": "FULL"}'
        ).create_engine_config()
    cfg = EngineArgs(
        model=tiny_ckpt,
        max_num_batched_tokens=256,
        compilation_config={"cudagraph_mode": "PIECEWISE"},
    ).create_engine_config()
    assert cfg.compilation_config.piecewise_capture_sizes[-1] == 256


def _sizes_kept(sizes, k=0, ep=1, tp=1):
    runner = NS(
        config=NS(num_spec_tokens=k),
        pc=NS(ep=NS(world_size=ep) if ep > 1 else None, tp=NS(world_size=tp)),
    )
    return ModelRunner._capture_sizes(runner, tuple(sizes))


def test_capture_sizes():
    """Rows of 1 + k tokens within the largest size; under EP every graph's MoE passes — B·q
    tokens in the verify forward and the first drafting pass — fit EP's fixed capacity."""
    sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert _sizes_kept(sizes) == sizes
    assert _sizes_kept(sizes, k=3) == sizes[:7]
    assert _sizes_kept(sizes, ep=2) == sizes
    assert _sizes_kept(sizes, k=3, ep=2) == sizes[:7]
    assert _sizes_kept((256,), k=3) == (256,)  # one size: kept without EP (no capacity)
    assert _sizes_kept((256,), k=3, ep=2) == ()  # 1,024 tokens: over EP's fixed capacity
    assert _sizes_kept((256,), k=3, ep=2, tp=4) == (256,)  # 256 per TP rank
    assert _sizes_kept((300,), ep=2) == ()


def test_graph_forward_reads_nothing_on_the_host():
    """Inside a decode graph's forward (``ep_forward(..., graph=True)``) the MoE may not take
    EP's counts path nor agree a bound by a host all-reduce; checked on CPU, where nothing is
    captured and neither would fail by itself."""
    pc = NS(ep=None, tp=NS(world_size=1))
    x, w, ids = torch.zeros(2, 8), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long)
    with ep_forward(4096, graph=True):
        with pytest.raises(AssertionError, match="counts path"):
            ep_moe(pc, x, w, ids, None)
        with pytest.raises(AssertionError, match="host all-reduce"):
            max_tokens_across_ep(pc, 2)
    assert max_tokens_across_ep(pc, 2) == 2


# ---- the static-buffer decode path against eager, on the tiny checkpoint --------------------
PROMPTS = [list(range(7 + 3 * i, 7 + 3 * i + n)) for i, n in enumerate((5, 40, 70, 130, 33, 9))]
# different lengths: the batch shrinks 6 -> 1 while decoding, so padded rows change every few steps
MAX_TOKENS = [3, 30, 9, 17, 24, 5]


def _run(m: LLM, seeds: bool = False):
    params = [
        SamplingParams(
            temperature=0.8 if seeds and i % 2 else 0.0,
            top_p=0.9,
            seed=100 + i,
            max_tokens=n,
            ignore_eos=True,
            logprobs=2 if i == 1 else None,
        )
        for i, n in enumerate(MAX_TOKENS)
    ]
    outs = m.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    toks = [o.outputs[0].token_ids for o in outs]
    lps = outs[1].outputs[0].logprobs
    return toks, [{t: d[t].logprob for t in d} for d in lps]


@pytest.fixture(scope="module")
def pair(tiny_ckpt):
    kw = dict(max_num_batched_tokens=64, max_num_seqs=8, device="cpu")  # exact: see the docstring
    eager = LLM(tiny_ckpt, enforce_eager=True, **kw)
    graphs = LLM(tiny_ckpt, compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]}, **kw)
    yield eager, graphs
    eager.shutdown()
    graphs.shutdown()


def _graph_steps(m: LLM, since: int) -> int:
    return sum(s.num_cudagraph_steps for s in m.stats_history[since:])


def test_static_decode_equals_eager(pair):
    """Chunked prompts join while others decode (in mixed steps the decode rows take the static
    path and the prompt chunks run eagerly after them; decode-only steps take the static path),
    requests finish at different steps (padding changes), greedy and seeded sampled rows,
    logprobs; the prefix-cache rerun hits and must give the same tokens."""
    eager, graphs = pair
    since = len(graphs.stats_history)
    ref, got = _run(eager, seeds=True), _run(graphs, seeds=True)
    assert _graph_steps(graphs, since) >= 15
    split = sum(s.num_cudagraph_split_steps for s in graphs.stats_history[since:])
    assert split >= 3
    # the split steps' prompt chunks (most past index_topk 32: the sparse prefill) take the
    # piecewise graphs
    assert sum(s.num_piecewise_steps for s in graphs.stats_history[since:]) >= split
    assert _graph_steps(eager, 0) == 0
    assert got[0] == ref[0]
    for g, r in zip(got[1], ref[1], strict=True):
        assert g.keys() == r.keys()
        np.testing.assert_allclose([g[t] for t in r], list(r.values()), atol=1e-4)
    again = _run(graphs, seeds=True)  # every prompt's full blocks are cached now
    assert again[0] == ref[0]


def test_static_decode_under_preemption(tiny_ckpt, pair):
    """A KV budget too small for the batch forces recompute mid-decode; the replayed rows after
    a preemption must still read the right slots and blocks."""
    from vllm.kv_cache_interface import kv_bytes_per_token

    eager, _ = pair
    mc = eager.config.model_config
    per_block = 64 * kv_bytes_per_token(mc.arch, "auto", mc.dtype, num_mtp_layers=0)
    tight = LLM(
        tiny_ckpt,
        device="cpu",
        kv_cache_memory_bytes=7 * per_block,
        max_num_batched_tokens=64,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
    )
    try:
        got = _run(tight)
        assert sum(s.num_preemptions for s in tight.stats_history) > 0
        assert _graph_steps(tight, 0) > 0
    finally:
        tight.shutdown()
    assert got[0] == _run(eager)[0]


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("num_prompts", [1, 6])
def test_static_decode_dp_ep_equals_eager(tiny_ckpt, num_prompts):
    """DP2 + EP2: both replicas agree on one size per step (an idle replica replays an all-padding
    step beside the other's); the MoE dispatch takes EP's fixed-capacity path inside it."""
    kw = dict(
        max_num_batched_tokens=64,
        max_num_seqs=8,
        data_parallel_size=2,
        enable_expert_parallel=True,
        device="cpu",
    )
    prompts = PROMPTS[:num_prompts]
    max_tokens = MAX_TOKENS if num_prompts > 1 else [20]

    def run(**extra):
        m = LLM(tiny_ckpt, **kw, **extra)
        try:
            outs = m.generate(
                [{"prompt_token_ids": p} for p in prompts],
                [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens],
            )
            return [o.outputs[0].token_ids for o in outs], _graph_steps(m, 0)
        finally:
            m.shutdown()

    ref, eager_steps = run(enforce_eager=True)
    got, graph_steps = run(compilation_config={"cudagraph_capture_sizes": [1, 2, 4]})
    assert eager_steps == 0 and graph_steps >= 10
    assert got == ref
