"""Fixtures for the benchmark tests: the AgentX harness venv (installed the way CI installs it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm.benchmarks import BenchmarkError
from vllm.benchmarks.agentic import harness

INSTALL_SCRIPT = harness.repo_root() / "benchmarks" / "agentic" / "install_agentx.sh"


@pytest.fixture(scope="session")
def agentx_bin() -> str:
    """The `agentx` executable; runs benchmarks/agentic/install_agentx.sh (as .ci/run does) when
    none is found, so a fresh checkout gets the same .venv-agentx as CI."""
    try:
        return harness.find_agentx()
    except BenchmarkError:
        pass
    r = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        pytest.fail(f"install_agentx.sh failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return harness.find_agentx()


def run_cli(*args: str, timeout: float = 300.0, env: dict | None = None):
    """`vllm ARGS...` in a subprocess (same interpreter); fails rather than hangs."""
    e = dict(os.environ, VLLM_NO_PROGRESS="1")
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
        stdin=subprocess.DEVNULL,
    )
