"""A `vllm serve ...` command line as one benchmark configuration: parse, start, wait, scrape, stop.

Each concurrency level gets a fresh server on a free loopback port. The command line is checked
with the real `vllm serve` argument parser before anything starts, so a typo fails the whole run
at once instead of at every level.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from vllm.benchmarks import BenchmarkError

# Flags the runner owns; a configuration must leave them out.
_RUNNER_FLAGS = ("--port", "--host")


@dataclass(frozen=True)
class ServeConfig:
    """One named server configuration."""

    name: str
    args: tuple[str, ...]  # what follows `vllm serve`
    num_gpus: int = 1
    model: str | None = None  # the MODEL argument, if given
    tokenizer: str | None = None  # --tokenizer, if given

    @property
    def command(self) -> str:
        return shlex.join(["vllm", "serve", *self.args])


def parse_serve_config(name: str, command: str, num_gpus: int | None = None) -> ServeConfig:
    """Validate `command` (`vllm serve [MODEL] [flags]`) with the real serve parser.
    `num_gpus` defaults to the ranks the command starts: DP x PP x PCP x TP."""
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", name or ""):
        raise BenchmarkError(f"configuration name {name!r}: use letters, digits and _.+- only")
    if num_gpus is not None and num_gpus < 1:
        raise BenchmarkError(f"configuration {name!r}: the GPU count must be >= 1")
    try:
        argv = shlex.split(command)
    except ValueError as e:
        raise BenchmarkError(f"configuration {name!r}: cannot parse {command!r}: {e}") from None
    if argv[:2] != ["vllm", "serve"]:
        raise BenchmarkError(
            f"configuration {name!r}: the command must start with 'vllm serve', got {command!r}"
        )
    args = argv[2:]
    for flag in _RUNNER_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in args):
            raise BenchmarkError(
                f"configuration {name!r}: leave out {flag}; the runner picks a free port on "
                "127.0.0.1 for every level"
            )
    from vllm.entrypoints.openai.cli_args import make_serve_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns = make_serve_parser().parse_args(args)
    except SystemExit:
        msg = err.getvalue().strip().splitlines()
        detail = msg[-1] if msg else "invalid arguments"
        detail = re.sub(r"^vllm( serve)?: error: ", "", detail)
        raise BenchmarkError(
            f"configuration {name!r}: cannot parse serve command {command!r}: {detail}"
        ) from None
    model = ns.model_flag or ns.model
    if num_gpus is None:
        num_gpus = (
            ns.data_parallel_size
            * ns.pipeline_parallel_size
            * ns.prefill_context_parallel_size
            * ns.tensor_parallel_size
        )
    return ServeConfig(name, tuple(args), num_gpus, model, getattr(ns, "tokenizer", None))


_LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class ServerError(Exception):
    """The server did not come up (it exited, or /health never answered)."""


class ServerProcess:
    """`vllm serve` as a child process in its own session, with its output in `log_path`."""

    def __init__(self, config: ServeConfig, log_path: str, extra_env: dict | None = None):
        self.config = config
        self.log_path = log_path
        # the server binds a port the OS picks (--port 0) and logs it: a port probed free here
        # could be taken by another process before the server binds it
        self.port = 0
        self.url = ""
        args = list(config.args)
        if "--enable-prompt-tokens-details" not in args:
            args.append("--enable-prompt-tokens-details")  # per-request cached tokens
        self.argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ]
        self.env = dict(os.environ, VLLM_NO_PROGRESS="1", **(extra_env or {}))
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> float:
        """Start and wait for /health; returns the seconds it took. Raises ServerError."""
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            log.write(f"$ {shlex.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise ServerError(
                    f"server exited with code {rc} during startup: {self.log_tail(1)}"
                )
            if not self.port:
                self._find_port()
            try:
                if self.port and http_get(self.url + "/health", timeout=2.0) is not None:
                    return time.monotonic() - t0
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise ServerError(f"/health did not answer within {timeout:.0f} s")
            time.sleep(0.5)

    def _find_port(self) -> None:
        """The port from the server's "listening on" log line, once it is there."""
        try:
            with open(self.log_path, errors="replace") as f:
                m = _LISTENING.search(f.read())
        except OSError:
            return
        if m:
            self.port = int(m.group(1))
            self.url = f"http://127.0.0.1:{self.port}"

    def served_model(self) -> str:
        data = json.loads(http_get(self.url + "/v1/models"))
        return data["data"][0]["id"]

    def metrics(self) -> dict[str, float]:
        return parse_prometheus(http_get(self.url + "/metrics"))

    def stop(self, timeout: float = 30.0) -> None:
        """SIGINT, then SIGKILL to the server's whole process group after `timeout`."""
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # Engine cores and workers live in the same session; make sure none outlives the level.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(5)

    def log_tail(self, num_lines: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                lines = [ln.rstrip() for ln in f if ln.strip()]
        except OSError:
            return ""
        # The last error line says most; fall back to the last lines.
        if num_lines == 1:
            for ln in reversed(lines):
                if re.search(r"error|Error|ERROR", ln):
                    return ln.strip()
        return "\n".join(lines[-num_lines:])


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum every sample of each metric name over its label sets (`name{...} value`)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)", line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out
