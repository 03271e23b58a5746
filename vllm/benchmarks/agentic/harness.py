"""The AgentX harness (`agentx profile`, PyPI `agentx-harness`, a fork of AIPerf) as a subprocess.

The harness has its own pinned dependencies (huggingface-hub < 2, pyzmq 26, ...) that clash with
the engine's, so it lives in its own virtual environment: `benchmarks/agentic/install_agentx.sh`
creates `.venv-agentx/` at the repository root, and CI runs the same script. The binary is found
through `--agentx-bin`, `$VLLM_AGENTX_BIN`, `agentx` on PATH, then `.venv-agentx/bin/agentx`.

Offline, the harness loads the tokenizer only from the Hugging Face cache layout
(`$HF_HOME/hub/models--local--NAME/snapshots/<hash>/` plus `refs/main`) with `HF_HUB_OFFLINE=1`
and `--tokenizer local/NAME`; `prepare_tokenizer` lays a tokenizer folder out that way.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vllm.benchmarks import BenchmarkError

AGENTX_VERSION = "1.0.12"  # what benchmarks/agentic/install_agentx.sh installs
AGENTX_BIN_ENV = "VLLM_AGENTX_BIN"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "config.json",
    "generation_config.json",
)


def repo_root() -> Path:
    import vllm

    return Path(vllm.__file__).resolve().parents[1]


def find_agentx(explicit: str | None = None) -> str:
    """Path of the `agentx` executable, or a BenchmarkError saying how to get one."""
    for source, path in (
        ("--agentx-bin", explicit),
        (AGENTX_BIN_ENV, os.environ.get(AGENTX_BIN_ENV)),
    ):
        if path:
            if not (os.path.isfile(path) and os.access(path, os.X_OK)):
                raise BenchmarkError(f"{source}: {path!r} is not an executable file")
            return path
    on_path = shutil.which("agentx")
    if on_path:
        return on_path
    local = repo_root() / ".venv-agentx" / "bin" / "agentx"
    if local.is_file():
        return str(local)
    raise BenchmarkError(
        "the AgentX harness (agentx) was not found: run benchmarks/agentic/install_agentx.sh "
        f"(creates .venv-agentx with agentx-harness=={AGENTX_VERSION}), or pass --agentx-bin / "
        f"set ${AGENTX_BIN_ENV}"
    )


def agentx_python(agentx: str) -> str:
    """The Python interpreter of the harness's environment (from the `agentx` script's shebang)."""
    sibling = os.path.join(os.path.dirname(agentx), "python")
    if os.path.isfile(sibling):
        return sibling
    with open(agentx, "rb") as f:
        first = f.readline().decode(errors="replace")
    if first.startswith("#!") and "python" in first:
        return first[2:].strip().split()[0]
    raise BenchmarkError(f"cannot tell which Python runs {agentx!r}")


def prepare_tokenizer(tokenizer_dir: str, hf_home: str, name: str) -> str:
    """Copy a tokenizer folder into `hf_home` in the HF cache layout; returns `local/NAME`."""
    src = Path(tokenizer_dir)
    if not (src / "tokenizer.json").is_file() and not (src / "tokenizer.model").is_file():
        raise BenchmarkError(f"tokenizer folder {tokenizer_dir!r} has no tokenizer.json")
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", name).strip("-") or "model"
    digest = hashlib.sha1()
    files = [f for f in _TOKENIZER_FILES if (src / f).is_file()]
    for f in files:
        digest.update((src / f).read_bytes())
    revision = digest.hexdigest()
    repo = Path(hf_home) / "hub" / f"models--local--{name}"
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(src / f, snap / f)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return f"local/{name}"


def harness_env(hf_home: str) -> dict[str, str]:
    env = dict(os.environ)
    for k in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):  # the harness has its own venv
        env.pop(k, None)
    env.update(HF_HOME=hf_home, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NO_COLOR="1")
    env.setdefault("COLUMNS", "160")
    return env


@dataclass(frozen=True)
class Workload:
    """What the harness replays: weka_trace sessions (chat) or a Mooncake trace (completions)."""

    kind: str  # "agentx" or "mooncake"
    input_path: str
    block_size: int = 64  # Mooncake only: tokens per hash block after scaling

    def harness_args(self) -> list[str]:
        if self.kind == "agentx":
            return ["--endpoint-type", "chat", "--custom-dataset-type", "weka_trace"]
        return [
            "--endpoint-type",
            "completions",
            "--custom-dataset-type",
            "mooncake_trace",
            "--isl-block-size",
            str(self.block_size),
            "--no-fixed-schedule",  # closed loop at the level's concurrency
            # Every Mooncake request is its own conversation: the agentx scenario's per-conversation
            # cache-bust marker would hide the cross-request prefix reuse the trace records.
            "--cache-bust",
            "none",
        ]


def build_command(
    agentx: str,
    *,
    url: str,
    model: str,
    tokenizer: str,
    workload: Workload,
    concurrency: int,
    duration: float,
    artifact_dir: str,
    seed: int,
    warmup_per_lane: int | None = None,
    allow_wrap: bool = False,
    extra: list[str] | None = None,
) -> list[str]:
    cmd = [
        agentx,
        "profile",
        "--model",
        model,
        "--url",
        url,
        "--streaming",
        *workload.harness_args(),
        "--input-file",
        workload.input_path,
        "--tokenizer",
        tokenizer,
        "--concurrency",
        str(concurrency),
        "--benchmark-duration",
        f"{duration:g}",
        "--output-artifact-dir",
        artifact_dir,
        "--random-seed",
        str(seed),
        "--stats-interval",
        "5",
        "--ui",
        "none",
        # The agentx scenario pins a public hub dataset and >= 900 s runs; we replay local
        # traces for shorter levels, so its locks become warnings (submission_valid=false).
        "--unsafe-override",
    ]
    if warmup_per_lane is not None:
        if workload.kind == "agentx":
            cmd += ["--warmup-requests-per-lane", str(warmup_per_lane)]
        else:
            cmd += ["--warmup-request-count", str(warmup_per_lane * concurrency)]
    if allow_wrap:
        cmd.append("--allow-dataset-wrap")
    return cmd + list(extra or [])


@dataclass
class HarnessProgress:
    """What the harness's log says so far (phase, requests done, errors)."""

    phase: str = "starting"
    phase_t0: float = field(default_factory=time.monotonic)
    done: int = 0
    errors: int = 0
    lines: list[str] = field(default_factory=list)

    _PHASE = re.compile(r"Phase (\w+) \(\w+\) started")
    _STATS = re.compile(r"done=(\d+) ok=\d+ err=(\d+)")
    _DONE = re.compile(r"Phase profiling \(profiling\) complete \| completed=(\d+).*errors=(\d+)")

    def feed(self, line: str) -> bool:
        """Update from one log line; True when something shown changed."""
        self.lines.append(line)
        del self.lines[:-200]
        if m := self._PHASE.search(line):
            self.phase, self.phase_t0 = m.group(1), time.monotonic()
            self.done = self.errors = 0
            return True
        if m := self._DONE.search(line):
            self.phase, self.done, self.errors = "exporting", int(m.group(1)), int(m.group(2))
            return True
        if self.phase == "profiling" and (m := self._STATS.search(line)):
            self.done, self.errors = int(m.group(1)), int(m.group(2))
            return True
        return False

    def error_hint(self) -> str:
        for ln in reversed(self.lines):
            if re.search(r"\b(ERROR|CRITICAL|Error:)", ln):
                return ln.strip()[-300:]
        return self.lines[-1].strip()[-300:] if self.lines else ""


def run_harness(
    cmd: list[str],
    env: dict[str, str],
    log_path: str,
    on_update: Callable[[HarnessProgress], None],
    timeout: float,
) -> tuple[int, HarnessProgress]:
    """Run the harness, teeing its output to `log_path`; returns (exit code, progress)."""
    progress = HarnessProgress()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        timer = threading.Timer(timeout, _stop_group, (proc,))
        timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                if progress.feed(line):
                    on_update(progress)
            rc = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:  # interrupted: take the harness's services down with it
                _stop_group(proc)
    return rc, progress


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGINT to the harness's process group (its services are children), SIGKILL after 15 s."""
    for sig, wait in ((signal.SIGINT, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def read_records(artifact_dir: str) -> list[dict]:
    """The per-request records (profile_export.jsonl) of the profiling phase."""
    path = os.path.join(artifact_dir, "profile_export.jsonl")
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec.get("metadata", {}).get("benchmark_phase", "profiling") == "profiling":
                out.append(rec)
    return out


def read_profiling_server_metrics(artifact_dir: str) -> dict[str, float]:
    """Counter totals over the profiling phase only, from the harness's own /metrics scraper."""
    path = os.path.join(artifact_dir, "server_metrics_export.json")
    try:
        with open(path) as f:
            metrics = json.load(f).get("metrics", {})
    except (OSError, ValueError):
        return {}
    out: dict[str, float] = {}
    for name, m in metrics.items():
        if m.get("type") != "counter":
            continue
        total = sum(s.get("stats", {}).get("total", 0.0) or 0.0 for s in m.get("series", []))
        out[name] = total
    return out
