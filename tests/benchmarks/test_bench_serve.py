"""`vllm bench serve` against a live tiny server: upstream metric names, --json, bad input."""

from __future__ import annotations

import json
import urllib.request

from tests.benchmarks.conftest import run_cli
from tests.utils import RemoteServer, free_port

UPSTREAM_KEYS = [
    "duration",
    "completed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl") for s in ("mean", "median", "std", "p99")),
]


def test_bench_serve_json_against_live_server():
    with RemoteServer([]) as server:
        r = run_cli(
            "bench", "serve", "--base-url", server.url, "--num-prompts", "8",
            "--random-input-len", "64", "--random-output-len", "8", "--max-concurrency", "4",
            "--ignore-eos", "--json", timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)
        for key in UPSTREAM_KEYS:
            assert key in res, key
        assert res["completed"] == 8 and res["failed"] == 0
        assert res["total_input_tokens"] == 8 * 64 and res["total_output_tokens"] == 8 * 8
        assert res["request_throughput"] > 0 and res["mean_ttft_ms"] > 0 and res["mean_tpot_ms"] > 0

        r = run_cli(
            "bench", "serve", "--base-url", server.url, "--dataset-name", "fixed",
            "--num-prompts", "3", "--random-input-len", "16", "--random-output-len", "4",
            "--request-rate", "20", timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "Serving Benchmark Result" in r.stdout and "Mean TTFT (ms):" in r.stdout


def test_bench_serve_without_server():
    r = run_cli("bench", "serve", "--port", str(free_port()), "--num-prompts", "1", timeout=60)
    assert r.returncode == 2
    assert "no server at" in r.stderr and "Traceback" not in r.stderr


def test_bench_serve_reports_speculative_decoding():
    """With --speculative-config the server exports upstream's spec-decode counters and `vllm
    bench serve` reports acceptance over the run (here in the synthetic mode, which it marks)."""
    spec = '{"method": "mtp", "num_speculative_tokens": 3, "synthetic_acceptance_length": 2.5}'
    with RemoteServer(["--speculative-config", spec]) as server:
        r = run_cli(
            "bench", "serve", "--base-url", server.url, "--num-prompts", "6",
            "--random-input-len", "32", "--random-output-len", "24", "--max-concurrency", "3",
            "--ignore-eos", "--json", timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)
        assert res["completed"] == 6 and res["total_output_tokens"] == 6 * 24
        drafts, tokens = res["spec_decode_num_drafts"], res["spec_decode_draft_tokens"]
        accepted = res["spec_decode_accepted_tokens"]
        assert drafts > 0 and 0 < accepted <= tokens <= 3 * drafts
        assert abs(res["spec_decode_acceptance_length"] - 2.5) < 0.4
        per_pos = res["spec_decode_per_position_acceptance_rate"]
        assert len(per_pos) == 3 and per_pos == sorted(per_pos, reverse=True)
        assert res["spec_decode_synthetic_acceptance_length"] == 2.5
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as f:
            text = f.read().decode()
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            assert f"vllm:spec_decode_{name}_total{{" in text
        assert "vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=" in text
        r = run_cli(
            "bench", "serve", "--base-url", server.url, "--num-prompts", "2",
            "--random-input-len", "16", "--random-output-len", "8", timeout=120,
        )  # fmt: skip
        assert "Speculative Decoding" in r.stdout and "SYNTHETIC" in r.stdout
