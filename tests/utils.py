"""Test helpers: a real `vllm serve` subprocess on 127.0.0.1."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import requests

# the server's first log line names the port it bound (`--port 0`: one the OS picked)
_LISTENING = re.compile(rb"listening on http://127\.0\.0\.1:(\d+)")


def free_port() -> int:
    """A port nothing listens on now (another process may take it before you bind it: servers
    are started with `--port 0` instead)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command(*args: str) -> list[str]:
    """`vllm ARGS...` with this interpreter."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", *args]


class RemoteServer:
    """`vllm serve ARGS --port 0` in its own session; waits for /health 200. Its output (stdout
    and stderr) is read all along by a thread: `output()`."""

    def __init__(self, args: list[str], env: dict | None = None, startup_timeout: float = 240.0):
        cmd = vllm_command("serve", *args, "--port", "0", "--disable-uvicorn-access-log")
        e = dict(os.environ)
        e.update(env or {})
        e.setdefault("VLLM_NO_PROGRESS", "1")
        self.proc = subprocess.Popen(
            cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._out = bytearray()
        self._bound = threading.Event()
        self.port = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + startup_timeout
        while not self._wait_healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{self.output()[-4000:]}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"server did not become healthy:\n{self.output()[-4000:]}")
            time.sleep(0.25)

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, b""):
            self._out += line
            m = None if self._bound.is_set() else _LISTENING.search(line)
            if m:
                self.port = int(m.group(1))
                self._bound.set()

    def _wait_healthy(self) -> bool:
        if not self._bound.wait(0.25):
            return False
        try:
            return requests.get(self.url + "/health", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode

    def output(self) -> str:
        """What the server printed so far (all of it once it has exited)."""
        if self.proc.poll() is not None:
            self._reader.join(5)  # the pipe ends when the last process holding it exits
        return bytes(self._out).decode(errors="replace")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
