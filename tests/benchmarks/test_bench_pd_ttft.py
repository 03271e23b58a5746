"""benchmarks/kv_transfer/bench_pd_ttft.py at toy sizes against real engines joined by NIXL: the
decode engine receives exactly the KV of the prompt positions it does not compute, its greedy text
equals its own local prefill's, the local prefill really recomputed (no prefix-cache hit), and
the table and --json are written; with a plain and a HiSparse decode engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.kv_transfer.requirements import require_nixl

require_nixl()

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kv_transfer" / "bench_pd_ttft.py"
TOKENS = [9, 130]  # under one block; two full blocks and a partial one


def _kv_bytes_per_token(ckpt: str) -> int:
    """As tests/distributed/kv_transfer/test_pd_serve.py: no --speculative-config, so the MTP
    layer's KV is not part of what moves."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.kv_cache_interface import kv_bytes_per_token

    cfg = EngineArgs(model=ckpt).create_engine_config()
    mc = cfg.model_config
    return kv_bytes_per_token(mc.arch, cfg.cache_config.cache_dtype, mc.dtype, num_mtp_layers=0)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("hisparse", [False, True], ids=["plain", "hisparse"])
def test_handoff_bytes_ttft_and_text(tiny_ckpt, tmp_path, hisparse):
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(SCRIPT), "--model", tiny_ckpt, "--tokens", *map(str, TOKENS),
           "--repeats", "2", "--max-tokens", "6", "--json", str(out)]  # fmt: skip
    if hisparse:
        cmd += ["--hisparse", "--host-pool-gib", "0.05"]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=360, cwd=ROOT, stdin=subprocess.DEVNULL
    )
    assert r.returncode == 0, r.stdout + r.stderr
    table = r.stdout.splitlines()[
        -len(TOKENS) - 1 :
    ]  # the table is last: header + one row per length
    assert table[0].split()[:3] == ["tokens", "KV", "MB"], r.stdout
    assert [int(row.split()[0]) for row in table[1:]] == TOKENS

    res = json.loads(out.read_text())
    assert res["decode"] == ("HiSparse" if hisparse else "plain")
    assert res["copy_ceiling_gbps"] > 0
    per_token = _kv_bytes_per_token(tiny_ckpt)
    assert [row["prompt_tokens"] for row in res["rows"]] == TOKENS
    for row in res["rows"]:
        n = row["prompt_tokens"]
        assert len(row["repeats"]) == 2
        for rep in row["repeats"]:
            # the decode engine computes the last prompt token; every other position crossed once
            assert rep["bytes"] == (n - 1) * per_token, (n, rep["bytes"])
            assert rep["prefill_ms"] > 0 and rep["handoff_ttft_ms"] > 0 and rep["local_ttft_ms"] > 0
            assert rep["texts_compared"] and rep["local_text"] == rep["handoff_text"] != ""
            # distinct prompts and no prefix cache: both prefills computed every token
            assert rep["cached_tokens"]["prefill"] == 0 and rep["cached_tokens"]["local"] == 0
        assert row["bytes"] == (n - 1) * per_token and row["texts_equal"]
        assert row["handoff_gbps"] > 0 and row["local_over_handoff"] > 0
