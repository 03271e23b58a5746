"""HiSparse on CPU: the "host pool" is ordinary memory and the GPU cache deliberately tiny
(10 blocks = 640 tokens). Greedy output must equal the run without HiSparse for 64+ tokens on
prompts many times longer than the GPU cache."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams

pytestmark = pytest.mark.distributed  # starts engine + worker processes

TOKENS = 66


def _prompts(lengths, salt=0):
    return [[(7 * i + 3 * j + salt) % 1000 + 3 for i in range(n)] for j, n in enumerate(lengths)]


def _greedy(llm, prompts):
    sp = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    return [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    ]


@pytest.fixture(scope="module")
def ref(tiny_ckpt):
    llm = LLM(tiny_ckpt, max_num_batched_tokens=256)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def hs(tiny_ckpt):
    llm = LLM(
        tiny_ckpt,
        attention_config={"hisparse_config": {"host_pool_gib": 0.05}},
        num_gpu_blocks_override=14,
        max_num_batched_tokens=256,
    )
    yield llm
    llm.shutdown()


def _sum(llm, key, since=0):
    return sum((s.extra or {}).get(key, 0) for s in llm.stats_history[since:])


def test_long_prompts_with_eviction_and_misses_every_step(ref, hs):
    prompts = _prompts([1500, 900])  # ~2.4K tokens of context vs 896 tokens of GPU pages
    since = len(hs.stats_history)
    assert _greedy(hs, prompts) == _greedy(ref, prompts)
    steps = hs.stats_history[since:]
    dropped = [(s.extra or {}).get("hisparse_pages_dropped_total", 0) for s in steps]
    assert max(dropped) > 20  # pages were dropped from HBM without preempting
    decode = [s for s in steps if (s.extra or {}).get("hisparse_h2d_bytes_per_step", 0) > 0]
    assert len(decode) >= TOKENS - 5  # rows came from the host pool on (nearly) every decode step
    assert sum(s.num_preemptions for s in steps) == 0


def test_many_concurrent_requests_mixed_residency(ref, hs):
    prompts = _prompts([700, 64, 300, 1000, 120, 500, 40, 800], salt=5)
    since = len(hs.stats_history)
    assert _greedy(hs, prompts) == _greedy(ref, prompts)
    rates = [(s.extra or {}).get("hisparse_hot_hit_rate", 1.0) for s in hs.stats_history[since:]]
    assert min(rates) < 1.0  # misses happened...
    assert _sum(hs, "hisparse_h2d_bytes_per_step", since) > 0
    usage = max(
        (s.extra or {}).get("hisparse_host_pool_usage_perc", 0) for s in hs.stats_history[since:]
    )
    assert 0 < usage < 1


def test_host_only_prefix_reused_by_second_request(ref, hs):
    shared = _prompts([1300], salt=9)[0]
    first = _greedy(hs, [shared + [5]])
    # the first request's pages were dropped from HBM; they survive in the host pool's prefix cache
    out = hs.generate(
        {"prompt_token_ids": shared + [6, 7]},
        SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True),
    )[0]
    assert out.num_cached_tokens == (len(shared) // 64) * 64
    assert out.outputs[0].token_ids == _greedy(ref, [shared + [6, 7]])[0]
    assert first == _greedy(ref, [shared + [5]])


def test_request_beyond_host_capacity_is_refused(hs):
    cap = hs.client.info["max_request_tokens"]
    with pytest.raises(ValueError, match="holds at most"):
        hs.generate({"prompt_token_ids": [5] * cap}, SamplingParams(max_tokens=1))


def test_hisparse_flag_validation(tiny_ckpt):
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="hisparse_config.*decode-context-parallel-size"):
        EngineArgs(
            model=tiny_ckpt,
            decode_context_parallel_size=2,
            tensor_parallel_size=2,
            attention_config={"hisparse_config": {"host_pool_gib": 1}},
        ).create_engine_config()
    with pytest.raises(ValueError, match="host_pool_gib must be > 0"):
        EngineArgs(
            model=tiny_ckpt, attention_config={"hisparse_config": {"host_pool_gib": 0}}
        ).create_engine_config()
    with pytest.raises(ValueError, match="hot_buffer_rows must be >= 32"):
        EngineArgs(
            model=tiny_ckpt,
            attention_config={"hisparse_config": {"host_pool_gib": 1, "hot_buffer_rows": 8}},
        ).create_engine_config()


def test_host_pool_larger_than_the_host_is_refused(tiny_ckpt):
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="host_pool_gib.*GiB of host memory; this host has"):
        EngineArgs(
            model=tiny_ckpt,
            data_parallel_size=2,
            attention_config={"hisparse_config": {"host_pool_gib": 2**20}},
        ).create_engine_config()


def test_valid_with_dp_and_ep(ref, tiny_ckpt):
    prompts = _prompts([900, 400, 1100], salt=13)
    llm = LLM(
        tiny_ckpt,
        attention_config={"hisparse_config": {"host_pool_gib": 0.05}},
        num_gpu_blocks_override=14,
        max_num_batched_tokens=256,
        data_parallel_size=2,
        enable_expert_parallel=True,
    )
    try:
        assert _greedy(llm, prompts) == _greedy(ref, prompts)
        assert (
            max((s.extra or {}).get("hisparse_pages_dropped_total", 0) for s in llm.stats_history)
            > 0
        )
    finally:
        llm.shutdown()


def test_default_token_budget_chunks_prefill_to_fit_the_gpu_pool(ref, tiny_ckpt):
    """With the default 2048-token budget a 1,500-token prompt needs more pages than the 14-block GPU
    pool holds: prefill chunks are capped to what fits next to a hot buffer instead of waiting."""
    llm = LLM(
        tiny_ckpt,
        attention_config={"hisparse_config": {"host_pool_gib": 0.05}},
        num_gpu_blocks_override=14,
    )
    try:
        prompts = _prompts([1500, 200], salt=21)
        assert _greedy(llm, prompts) == _greedy(ref, prompts)
    finally:
        llm.shutdown()


def test_metrics_endpoint_reports_hisparse(tiny_ckpt):
    import requests

    from tests.utils import RemoteServer

    with RemoteServer(
        [
            tiny_ckpt,
            "--attention-config",
            '{"hisparse_config": {"host_pool_gib": 0.05}}',
            "--num-gpu-blocks-override",
            "12",
        ]
    ) as s:
        r = requests.post(
            s.base_url + "/completions",
            json={"prompt": _prompts([1200], salt=3)[0], "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code == 200
        text = requests.get(s.url + "/metrics").text
        values = {
            line.split("{")[0]: float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("vllm:hisparse")
        }
        assert values["vllm:hisparse_pages_dropped_total"] > 0
        assert 0 <= values["vllm:hisparse_hot_hit_rate"] <= 1
        assert (
            "vllm:hisparse_h2d_bytes_per_step" in values
            and "vllm:hisparse_host_pool_usage_perc" in values
        )


def test_fp8_cache_identity(tiny_ckpt):
    """The host pool holds rows in the cache's own format: with fp8_ds_mla (656-byte-layout rows,
    FP8 indexer keys) HiSparse gives the same greedy tokens as the FP8 cache without it."""
    prompts = _prompts([1200, 300], salt=11)
    outs = []
    for extra in ({}, dict(attention_config={"hisparse_config": {"host_pool_gib": 0.05}},
                           num_gpu_blocks_override=14)):  # fmt: skip
        llm = LLM(tiny_ckpt, kv_cache_dtype="fp8_ds_mla", max_num_batched_tokens=256, **extra)
        try:
            outs.append(_greedy(llm, prompts))
            if extra:
                assert _sum(llm, "hisparse_h2d_bytes_per_step") > 0  # rows came from the host
        finally:
            llm.shutdown()
    assert outs[0] == outs[1]


_NO_TRITON_SCRIPT = """
import sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    prompts = [{"prompt_token_ids": [(7 * i) % 1000 + 3 for i in range(900)]}]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    for hisparse in (False, True):
        kw = {"attention_config": {"hisparse_config": {"host_pool_gib": 0.05}},
              "num_gpu_blocks_override": 14} if hisparse else {}
        with LLM(sys.argv[1], max_num_batched_tokens=256, **kw) as llm:
            outs.append(llm.generate(prompts, sp, use_tqdm=False)[0].outputs[0].token_ids)
    assert "triton" not in sys.modules or sys.modules["triton"] is None
    assert outs[0] == outs[1], outs
    print("SAME", len(outs[1]))
"""


def test_hisparse_runs_without_triton(tiny_ckpt, tmp_path):
    """The README's plain install has no Triton: HiSparse on CPU must run on the PyTorch paths
    (every process of the engine sees `import triton` fail) and decode as the run without it."""
    import os
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['triton'] = None\n")
    (tmp_path / "run.py").write_text(_NO_TRITON_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    r = subprocess.run(
        [sys.executable, str(tmp_path / "run.py"), tiny_ckpt],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0 and "SAME 12" in r.stdout, r.stderr[-3000:]


def test_static_decode_path_equals_eager(ref, tiny_ckpt):
    """HiSparse inside the decode graphs' static path (run uncaptured on CPU): the resolver's LRU
    stamp read from the device, the indexer-key slots gathered from padded rows, misses fetched
    every step; greedy output equals the all-in-HBM run."""
    g = LLM(
        tiny_ckpt,
        attention_config={"hisparse_config": {"host_pool_gib": 0.05}},
        num_gpu_blocks_override=14,
        max_num_batched_tokens=256,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4]},
    )
    try:
        prompts = _prompts([1500, 900, 300], salt=2)
        got = _greedy(g, prompts)
        graph_steps = sum(s.num_cudagraph_steps for s in g.stats_history)
        misses = _sum(g, "hisparse_h2d_bytes_per_step")
    finally:
        g.shutdown()
    assert graph_steps >= TOKENS - 5 and misses > 0
    assert got == _greedy(ref, prompts)


@pytest.mark.parametrize("graphs", [False, True])
def test_async_scheduling_equals_sync(ref, tiny_ckpt, graphs):
    """--async-scheduling with HiSparse: the engine core schedules step N + 1 before step N's
    results and the worker launches it before reading N (pages dropped, restored from the host
    prefix cache and fetched every step meanwhile); greedy output equals the all-in-HBM run,
    eagerly and through the decode graphs' static path."""
    kw = dict(
        attention_config={"hisparse_config": {"host_pool_gib": 0.05}},
        num_gpu_blocks_override=14,
        max_num_batched_tokens=256,
        async_scheduling=True,
    )
    if graphs:
        kw["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4]}
    llm = LLM(tiny_ckpt, **kw)
    try:
        shared = _prompts([1300], salt=11)[0]
        prompts = _prompts([1500, 900, 300], salt=3) + [shared + [5], shared + [6, 7]]
        got = _greedy(llm, prompts)
        # the shared prefix again, after its pages left HBM: a host-only prefix hit
        again = llm.generate(
            {"prompt_token_ids": shared + [8]},
            SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True),
        )[0]
        steps = llm.stats_history
        pipelined = sum(s.num_pipelined_steps for s in steps)
        dropped = max((s.extra or {}).get("hisparse_pages_dropped_total", 0) for s in steps)
        misses = _sum(llm, "hisparse_h2d_bytes_per_step")
    finally:
        llm.shutdown()
    assert pipelined > TOKENS and dropped > 20 and misses > 0
    assert again.num_cached_tokens == (len(shared) // 64) * 64
    assert got == _greedy(ref, prompts)
    assert again.outputs[0].token_ids == _greedy(ref, [shared + [8]])[0]
