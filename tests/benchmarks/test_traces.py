"""The weka_trace synthesiser and the Mooncake scaler; the output loads in the harness's loader."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from vllm.benchmarks import BenchmarkError
from vllm.benchmarks.agentic import harness, traces

MOONCAKE_SLICE = (
    harness.repo_root() / "benchmarks" / "agentic" / "data" / "mooncake_conversation_head.jsonl"
)


def _sessions(shape: str, n: int, seed: int = 0) -> list[dict]:
    return [
        traces.synthesize_session(traces.get_shape(shape), f"s{i}", seed, "m") for i in range(n)
    ]


@pytest.mark.parametrize("shape", ["agentx", "cpu"])
def test_shape_matches_agentx_statistics(shape):
    stats = traces.summarize(_sessions(shape, 60))
    assert 38 <= stats["turns_median"] <= 50  # AgentX: median ~43 turns
    assert stats["shared_with_previous_turn_mean"] > 0.95
    assert stats["turns_sharing_95pct"] > 0.95
    assert stats["sessions_with_subagents"] > 0
    if shape == "agentx":
        assert 350 <= stats["output_tokens_median"] <= 550  # ~444 output tokens per turn
        assert stats["input_tokens_median"] > 50_000


def test_sessions_grow_and_share_prefixes():
    sess = _sessions("tiny", 1, seed=3)[0]
    bs = sess["block_size"]
    main = [r for r in sess["requests"] if r["type"] != "subagent"]
    for prev, cur in zip(main, main[1:], strict=False):
        assert cur["t"] >= prev["t"] + prev["api_time"]  # think time after the previous turn
        assert len(cur["hash_ids"]) == cur["in"] // bs
        if cur["in"] > prev["in"]:  # growth (no compaction): the whole previous prefix is reused
            assert cur["hash_ids"][: prev["in"] // bs] == prev["hash_ids"]
            assert cur["in"] >= prev["in"] + prev["out"]


def test_scaling_and_determinism():
    full = traces.AGENTX
    small = full.scaled(tokens=0.5, outputs=0.25, turns=0.5, time=0.1)
    assert small.tool_tokens == full.tool_tokens // 2
    assert small.output_median == pytest.approx(full.output_median / 4)
    assert small.turns_median == pytest.approx(full.turns_median / 2)
    assert small.think_median_s == pytest.approx(full.think_median_s / 10)
    a = traces.synthesize_session(small, "x", 7, "m")
    assert a == traces.synthesize_session(small, "x", 7, "m")
    with pytest.raises(BenchmarkError):
        full.scaled(tokens=0)
    with pytest.raises(BenchmarkError):
        traces.get_shape("nope")


def test_mooncake_scaling(tmp_path):
    dst = tmp_path / "m.jsonl"
    n = traces.scale_mooncake(str(MOONCAKE_SLICE), str(dst), max_requests=50, block_to=16)
    assert n == 50
    src = [json.loads(x) for x in MOONCAKE_SLICE.read_text().splitlines()[:50]]
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    for a, b in zip(src, out, strict=True):
        assert b["hash_ids"] == a["hash_ids"]
        assert math.ceil(b["input_length"] / 16) == len(b["hash_ids"])
        assert b["timestamp"] == a["timestamp"]
    with pytest.raises(BenchmarkError, match="no such file"):
        traces.scale_mooncake(str(tmp_path / "nope"), str(dst), max_requests=1)


_LOADER_SCRIPT = r"""
import json, sys
from aiperf.common import random_generator
from aiperf.common.tokenizer import Tokenizer
from aiperf.config import BenchmarkConfig, BenchmarkRun
from aiperf.dataset.composer.custom import CustomDatasetComposer

path, fmt, tok = sys.argv[1:4]
extra = json.loads(sys.argv[4])
random_generator.init(0)
cfg = BenchmarkConfig.model_validate({
    "models": ["tiny-glm-5.3"],
    "endpoint": {"urls": ["http://127.0.0.1:9"], "type": "chat", "streaming": True},
    "datasets": [dict({"name": "main", "type": "file", "path": path, "format": fmt}, **extra)],
    "phases": [{"name": "profiling", "type": "concurrency", "concurrency": 2, "duration": 10}],
    "tokenizer": {"name": tok},
})
run = BenchmarkRun(benchmark_id="t", cfg=cfg, artifact_dir=cfg.artifacts.dir)
composer = CustomDatasetComposer(run=run, tokenizer=Tokenizer.from_pretrained(tok))
convs = composer.create_dataset()
print(json.dumps({
    "loader": type(composer.loader).__name__,
    "sessions": sorted(c.session_id for c in convs),
    "turns": sum(len(c.turns) for c in convs),
}))
"""


def _load_in_harness(agentx_bin, tmp_path, tiny_ckpt, path: str, fmt: str, **extra) -> dict:
    hf_home = str(tmp_path / "hf")
    tok = harness.prepare_tokenizer(tiny_ckpt, hf_home, "tiny")
    r = subprocess.run(
        [
            harness.agentx_python(agentx_bin),
            "-c",
            _LOADER_SCRIPT,
            path,
            fmt,
            tok,
            json.dumps(extra),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=harness.harness_env(hf_home),
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_synthesised_sessions_load_in_harness_loader(agentx_bin, tmp_path, tiny_ckpt):
    trace_dir = tmp_path / "traces"
    shape = traces.get_shape("tiny").scaled(turns=0.5)
    traces.synthesize(str(trace_dir), shape, 6, seed=1)
    sessions = traces.load_sessions(str(trace_dir))
    num_sub = sum(r["type"] == "subagent" for s in sessions for r in s["requests"])
    assert num_sub > 0
    got = _load_in_harness(agentx_bin, tmp_path, tiny_ckpt, str(trace_dir), "weka_trace")
    assert got["loader"] == "WekaTraceLoader"
    roots = [s for s in got["sessions"] if "::sa:" not in s]
    assert sorted(roots) == sorted(s["id"] for s in sessions)
    assert len(got["sessions"]) >= len(sessions) + num_sub  # every sub-agent became a child
    assert got["turns"] >= sum(
        len([r for r in s["requests"] if r["type"] != "subagent"]) for s in sessions
    )


def test_mooncake_slice_loads_in_harness_loader(agentx_bin, tmp_path, tiny_ckpt):
    dst = tmp_path / "mooncake.jsonl"
    n = traces.scale_mooncake(str(MOONCAKE_SLICE), str(dst), max_requests=40)
    got = _load_in_harness(
        agentx_bin, tmp_path, tiny_ckpt, str(dst), "mooncake_trace", block_size=16
    )
    assert got["loader"].startswith("Mooncake")
    assert got["turns"] == n
