"""benchmarks/kv_transfer/bench_offload_reload.py on the CPU at toy sizes: it runs, checks every
copy, prints its table and --json, and fails when the store or the reload does not copy."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm.distributed.kv_transfer.offload_store import HostKVStore

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kv_transfer" / "bench_offload_reload.py"
TABLE_ROWS = ["ceiling H2D", "ceiling D2H", "reload contiguous", "reload scattered", "store contiguous", "store scattered"]  # fmt: skip


def run(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--repeats", "2", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )


def test_offload_reload_table_and_json(tmp_path):
    out = tmp_path / "r.json"
    r = run("--tokens", "256", "--no-recompute", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verification: passed" in r.stdout
    table = r.stdout.splitlines()[-7:]  # the table is last: header + 6 rows
    for row, name in zip(table[1:], TABLE_ROWS, strict=True):
        assert row.startswith(name), table
    assert "54,728 B/token" in r.stdout
    res = json.loads(out.read_text())
    assert res["blocks"] == 4 and res["cache_tensors"] == 79 + 22
    assert res["bytes"] == 4 * 64 * 54728
    assert res["rows"]["reload_contiguous"]["copies"] == 101  # one per tensor: coalesced
    assert res["rows"]["reload_scattered"]["copies"] > 101
    assert all(x["gbps"] > 0 for x in res["rows"].values()) and res["recompute"] is None


def test_recompute_projection(tmp_path):
    """A one-layer slice at 64 tokens: the projection covers 78 layers + MTP, the kinds the slice
    lacks are named, and the table ends with the recompute row."""
    out = tmp_path / "r.json"
    args = ["--tokens", "64", "--slice-layers", "1", "--chunk", "32", "--recompute-repeats", "1"]
    r = run(*args, "--no-scatter", "--json", str(out), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].startswith("recompute (projected)")
    rec = json.loads(out.read_text())["recompute"]
    assert rec["projected_layers"] == 79 and rec["slice_kinds"] == ["dense+full"]
    assert set(rec["kinds_missing_from_slice"]) == {"moe+full", "moe+shared"}
    assert rec["projected_ms"] > rec["slice_ms"] > 0


@pytest.mark.parametrize("broken", ["load", "store"])
def test_copies_that_do_nothing_fail(monkeypatch, capsys, broken):
    spec = importlib.util.spec_from_file_location("bench_offload_reload", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(HostKVStore, broken, lambda self, pairs: None)
    assert (
        bench.main(["--tokens", "128", "--device", "cpu", "--repeats", "1", "--no-recompute"]) == 1
    )
    assert (
        f"verification: FAILED: {'reload' if broken == 'load' else broken}"
        in capsys.readouterr().out
    )
