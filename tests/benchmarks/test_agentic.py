"""`vllm bench agentic`: unit pieces, a short end-to-end sweep with the real harness, bad input."""

from __future__ import annotations

import csv
import json
import os
import stat

import pytest

from tests.benchmarks.conftest import run_cli
from vllm.benchmarks import BenchmarkError
from vllm.benchmarks.agentic import results
from vllm.benchmarks.agentic.server import parse_prometheus, parse_serve_config


def test_parse_serve_config():
    cfg = parse_serve_config("pcp", "vllm serve -pcp 2 -dcp 2 --enable-expert-parallel")
    assert cfg.args == ("-pcp", "2", "-dcp", "2", "--enable-expert-parallel")
    assert cfg.num_gpus == 2 and cfg.command.startswith("vllm serve -pcp 2")
    assert parse_serve_config("dp", "vllm serve -dp 2 -tp 2").num_gpus == 4
    assert parse_serve_config("x", "vllm serve -tp 2", num_gpus=8).num_gpus == 8
    for bad, msg in [
        ("vllm serve --no-such-flag", "unrecognized arguments"),
        ("vllm serve 'open", "No closing quotation"),
        ("python -m vllm serve", "must start with 'vllm serve'"),
        ("vllm serve --port 8000", "leave out --port"),
    ]:
        with pytest.raises(BenchmarkError, match=msg):
            parse_serve_config("x", bad)


def test_prometheus_and_level_metrics():
    text = (
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{model_name="m"} 300.0\n'
        'vllm:prefix_cache_queries_total{model_name="m"} 400.0\n'
    )
    after = parse_prometheus(text)
    before = {"vllm:prefix_cache_hits_total": 100.0, "vllm:prefix_cache_queries_total": 200.0}

    def rec(start_s, end_s, n_in, n_out, err=None):
        m = {
            "usage_prompt_tokens": n_in,
            "usage_completion_tokens": n_out,
            "usage_prompt_cache_read_tokens": n_in // 2,
            "request_latency": (end_s - start_s) * 1000,
            "time_to_first_token": 100.0,
            "inter_token_latency": 10.0,
        }
        meta = {"request_start_ns": int(start_s * 1e9), "request_end_ns": int(end_s * 1e9)}
        r = {"metadata": meta, "metrics": {k: {"value": v} for k, v in m.items()}}
        if err:
            r["error"] = {"message": err}
        return r

    recs = [rec(0, 1, 100, 10), rec(1, 2, 300, 30), rec(1, 2, 50, 0, err="boom")]
    m = results.level_metrics(recs, before, after, {}, num_gpus=2)
    assert m["requests"] == 3 and m["errors"] == 1
    assert m["duration_s"] == pytest.approx(2.0)
    # logical throughput counts cached input: (100 + 10 + 300 + 30) / 2 s / 2 GPUs
    assert m["throughput_per_gpu"] == pytest.approx(110.0)
    assert m["cached_input_tokens"] == 200
    assert m["interactivity_median"] == pytest.approx(20.0)  # 10 and 30 tok over 1 s each
    assert m["prefix_cache_hit_rate"] == pytest.approx(1.0)  # (300-100) / (400-200)
    assert results.percentile([1, 2, 3, 4, 5], 90) == pytest.approx(4.6)


def _fake_agentx(tmp_path) -> str:
    path = tmp_path / "agentx"
    path.write_text("#!/bin/sh\necho 0.0-fake\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _assert_clean_error(r, code: int, needle: str):
    assert r.returncode == code, r.stdout + r.stderr
    assert needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_missing_trace_folder(tmp_path):
    r = run_cli(
        "bench",
        "agentic",
        "--trace-dir",
        str(tmp_path / "nope"),
        "--output-dir",
        str(tmp_path / "o"),
    )
    _assert_clean_error(r, 2, "no such folder")
    os.makedirs(tmp_path / "empty")
    r = run_cli(
        "bench",
        "agentic",
        "--trace-dir",
        str(tmp_path / "empty"),
        "--output-dir",
        str(tmp_path / "o"),
    )
    _assert_clean_error(r, 2, "no *.json session files")


def test_unparsable_serve_command(tmp_path):
    r = run_cli(
        "bench", "agentic", "--config", "x=vllm serve --bogus 1", "--output-dir", str(tmp_path)
    )
    _assert_clean_error(r, 2, "cannot parse serve command")
    assert not os.path.exists(tmp_path / "x")  # nothing started


def test_missing_harness(tmp_path):
    r = run_cli(
        "bench", "agentic", "--shape", "tiny", "--sessions", "1", "--agentx-bin", str(tmp_path / "nope"),
        "--output-dir", str(tmp_path / "o"),
    )  # fmt: skip
    _assert_clean_error(r, 2, "is not an executable file")


def test_server_that_exits_at_start(tmp_path):
    out = tmp_path / "out"
    r = run_cli(
        "bench", "agentic", "--config", "bad=vllm serve --block-size 32", "--shape", "tiny",
        "--sessions", "1", "--concurrency", "1", "--duration", "5",
        "--agentx-bin", _fake_agentx(tmp_path), "--output-dir", str(out),
    )  # fmt: skip
    _assert_clean_error(r, 1, "server exited with code")
    row = json.loads((out / "results.json").read_text())["results"][0]
    assert row["status"] == "server_failed" and "--block-size" in row["message"]
    assert (out / "results.csv").is_file() and (out / "pareto.png").is_file()


def test_short_sweep_with_real_harness(agentx_bin, tmp_path):
    """The tiny model, c2, ~20 s profiled, with the real `agentx profile`."""
    out = tmp_path / "out"
    r = run_cli(
        "bench", "agentic", "--shape", "tiny", "--sessions", "4", "--concurrency", "2",
        "--duration", "20", "--warmup-requests-per-lane", "2", "--agentx-bin", agentx_bin,
        "--output-dir", str(out), timeout=420,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    (row,) = data["results"]
    assert row["status"] == "ok", row["message"]
    assert row["config"] == "plain" and row["concurrency"] == 2
    assert row["requests"] > 0 and row["errors"] == 0
    assert row["throughput_per_gpu"] > 0 and row["output_tokens"] > 0
    assert row["interactivity_p90"] > 0 and row["ttft_median_ms"] > 0 and row["itl_mean_ms"] > 0
    assert row["prefix_cache_hit_rate"] > 0.5
    assert data["meta"]["agentx_version"] and data["meta"]["git_commit"]
    with open(out / "results.csv") as f:
        (csv_row,) = list(csv.DictReader(f))
    assert float(csv_row["throughput_per_gpu"]) > 0
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "plain" / "c2" / "agentx" / "profile_export.jsonl").is_file()
