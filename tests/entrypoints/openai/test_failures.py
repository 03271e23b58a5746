"""A dying worker fails in-flight requests fast, turns /health off, and the server exits non-zero."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import requests

from tests.utils import RemoteServer


def _workers(server_pid: int) -> list[psutil.Process]:
    root = psutil.Process(server_pid)
    return [
        p
        for p in root.children(recursive=True)
        if p.ppid() != server_pid and "resource_tracker" not in " ".join(p.cmdline())
    ]


def test_killed_worker_fails_requests_and_server_exits(tiny_ckpt):
    s = RemoteServer([tiny_ckpt])
    try:
        workers = _workers(s.proc.pid)
        assert workers, "expected worker processes under the engine core"
        result = {}

        def long_request():
            t0 = time.monotonic()
            try:
                r = requests.post(
                    s.base_url + "/completions",
                    timeout=60,
                    json={"prompt": "x", "max_tokens": 100000, "ignore_eos": True, "stream": True},
                    stream=True,
                )
                body = b"".join(r.iter_content(None))
                result["status"], result["body"] = r.status_code, body.decode(errors="replace")
            except requests.RequestException as e:
                result["exc"] = str(e)
            result["elapsed"] = time.monotonic() - t0

        th = threading.Thread(target=long_request)
        th.start()
        time.sleep(1.5)  # the request is decoding
        os.kill(workers[0].pid, signal.SIGKILL)
        th.join(30)
        assert not th.is_alive(), "the in-flight request hung"
        assert result["elapsed"] < 20
        assert "exc" in result or "error" in result["body"]
        s.proc.wait(30)  # the server exits on its own
        assert s.proc.returncode not in (0, None)
        assert "exited with code" in s.output() or "died" in s.output()
    finally:
        s.stop()


def test_sigterm_shuts_everything_down(tiny_ckpt):
    s = RemoteServer([tiny_ckpt])
    procs = [psutil.Process(s.proc.pid)] + psutil.Process(s.proc.pid).children(recursive=True)
    assert len(procs) >= 3  # api server, engine core, worker
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(30)
    gone, alive = psutil.wait_procs(procs, timeout=20)
    assert not alive, f"left behind: {[p.pid for p in alive]}"
