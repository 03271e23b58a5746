"""benchmarks/kv_transfer/bench_nixl_transfer.py on the CPU at toy sizes (GLM-5.3 rows, every
8th layer): the direct, staged and auto paths land the same bytes, move only the owned rows, and
staging turns DCP2 I1's single-row descriptors into one per source run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.kv_transfer.requirements import require_nixl

require_nixl()

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kv_transfer" / "bench_nixl_transfer.py"
# --layers-scale 8 keeps layers 0, 8, ..., 72 (10 MLA caches); layer 0 also holds indexer keys
BYTES_PER_TOKEN = 10 * 656 + 132


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--tokens", "1024", "--layers-scale", "8", "--iters", "1"]
        + list(args),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.timeout(150)
def test_staged_against_direct_json():
    r = run("--src-dcp", "2", "--paths", "direct,staged,auto", "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    direct, staged, auto = recs
    assert [x["path"] for x in recs] == ["direct", "staged", "auto"]
    assert all(x["same_as_first_path"] for x in recs)
    assert {x["bytes"] for x in recs} == {1023 * BYTES_PER_TOKEN}  # owned rows only
    assert direct["staged_bytes"] == 0 and staged["staged_bytes"] == staged["bytes"]
    assert auto["staged_bytes"] == auto["bytes"]  # single-row runs: the rule stages them
    # direct: one descriptor per row and region; staged: per source run (one per rank for the
    # MLA caches, whose blocks are consecutive) and, for the FP8 indexer, per page and region
    assert direct["descs"] > 50 * staged["descs"]
    assert all(x["nixl_gbps"] > 0 and x["copy_ceiling_gbps"] > 0 for x in recs)


@pytest.mark.timeout(150)
def test_table():
    r = run("--src-dcp", "2", "--interleave", "64")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    i = lines.index(next(x for x in lines if x.startswith("verification:")))
    assert lines[i] == "verification: passed (paths landed the same bytes)"
    assert "descs" in lines[i + 1] and "copy GB/s" in lines[i + 1]
    assert lines[i + 2].split()[:2] == ["DCP2->DCP1", "I64"]
    assert lines[i + 2].split()[2] == "direct" and lines[i + 3].split()[2] == "staged*"
