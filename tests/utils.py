"""Test helpers: a real `vllm serve` subprocess on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    def __init__(self, args: list[str], env: dict | None = None, startup_timeout: float = 240.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            *args,
            "--port",
            str(self.port),
            "--uvicorn-log-level",
            "warning",
        ]
        e = dict(os.environ)
        e.update(env or {})
        e.setdefault("VLLM_NO_PROGRESS", "1")
        self.proc = subprocess.Popen(
            cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode(errors="replace")
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{out[-4000:]}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("server did not become healthy")
            time.sleep(0.25)

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
        try:
            return self.proc.stdout.read().decode(errors="replace")
        except Exception:  # noqa: BLE001
            return ""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
