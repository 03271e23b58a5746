"""The server's lifecycle with real `vllm serve` processes: a busy port fails before the engine
starts; `--port 0` serves on the port it logs; SIGTERM / SIGINT stop everything within seconds,
even mid-step, and exit 0; a dead or frozen (SIGSTOP) worker fails in-flight requests, turns
/health to 503 and the server exits non-zero."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time

import psutil
import requests

from tests.utils import RemoteServer, vllm_command

WATCHDOG_S = 3.0  # VLLM_ENGINE_HEARTBEAT_TIMEOUT_S in the frozen-worker test


def _tree(server_pid: int) -> list[psutil.Process]:
    root = psutil.Process(server_pid)
    return [root, *root.children(recursive=True)]


def _workers(server_pid: int) -> list[psutil.Process]:
    root = psutil.Process(server_pid)
    return [
        p
        for p in root.children(recursive=True)
        if p.ppid() != server_pid and "resource_tracker" not in " ".join(p.cmdline())
    ]


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _stream(url: str, body: dict, result: dict) -> None:
    """POST a completion, keep its status and body (or the connection error), and the time."""
    t0 = time.monotonic()
    try:
        r = requests.post(url + "/v1/completions", json=body, stream=True, timeout=60)
        data = b"".join(r.iter_content(None))
        result["status"], result["body"] = r.status_code, data.decode(errors="replace")
    except requests.RequestException as e:
        result["exc"] = str(e)
    result["elapsed"] = time.monotonic() - t0


def _cli_seconds(*args: str) -> float:
    t0 = time.monotonic()
    subprocess.run(vllm_command(*args), capture_output=True, timeout=120, check=True)
    return time.monotonic() - t0


def test_busy_port_fails_before_the_engine_starts(tiny_ckpt):
    """Old path: the engine starts (processes spawned, model loaded), then uvicorn fails."""
    # `vllm --version` builds the same parser, so it imports what `vllm serve` imports
    imports_s = _cli_seconds("--version")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        proc = subprocess.Popen(
            vllm_command("serve", tiny_ckpt, "--port", str(port)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        spawned = set()
        while proc.poll() is None and time.monotonic() - t0 < 60:
            with contextlib.suppress(psutil.Error):
                spawned |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
            time.sleep(0.02)
        elapsed = time.monotonic() - t0
        out, err = proc.communicate(timeout=60)
    print(f"exited after {elapsed:.2f} s ({imports_s:.2f} s to import and parse)")
    assert proc.returncode not in (0, None)
    assert f"error: --port {port}: address already in use" in err.decode(), err.decode()
    assert not spawned, "processes were started before the port was bound"
    assert elapsed - imports_s < 2.0


def test_port_zero_and_sigint_when_idle(tiny_ckpt):
    """`--port 0`: the server logs the port the OS picked and serves there; SIGINT stops it,
    exit code 0, port free. Old path: the port is never logged (the helper finds no server)."""
    s = RemoteServer([tiny_ckpt])
    procs = _tree(s.proc.pid)
    assert len(procs) >= 3  # api server, engine core, worker
    assert s.port != 0 and requests.get(s.url + "/health", timeout=5).status_code == 200
    assert f"on http://127.0.0.1:{s.port}" in s.output().split("serving", 1)[1]
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGINT)
    assert s.proc.wait(20) == 0, s.output()[-3000:]
    gone, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive, f"left behind: {[p.pid for p in alive]}"
    assert time.monotonic() - t0 < 10
    assert _port_is_free(s.port)


def test_sigterm_during_long_prefill_stops_everything(tiny_ckpt):
    """SIGTERM while one step computes a 16K-token prompt (many seconds on CPU): the request
    fails, every process is gone within 10 s, exit code 0, the port is free. Old path: uvicorn
    waits for the request, then re-raises SIGTERM (exit code -15)."""
    s = RemoteServer([tiny_ckpt, "--max-num-batched-tokens", "16384"])  # one step
    procs = _tree(s.proc.pid)
    try:
        result: dict = {}
        prompt = [(7 * i) % 1000 + 3 for i in range(16000)]
        body = {"prompt": prompt, "max_tokens": 1, "stream": True}
        th = threading.Thread(target=_stream, args=(s.url, body, result))
        th.start()
        time.sleep(2.0)  # the request is in its prefill step
        assert th.is_alive(), f"the prefill ended before SIGTERM: {result}"
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        rc = s.proc.wait(10)
        gone, alive = psutil.wait_procs(procs, timeout=max(0.1, 10 - (time.monotonic() - t0)))
        stopped_s = time.monotonic() - t0
        th.join(10)
        print(f"everything stopped {stopped_s:.2f} s after SIGTERM; request: {result}")
        assert rc == 0, s.output()[-3000:]
        assert not alive, f"left behind: {[p.pid for p in alive]}"
        assert "exc" in result or "shutting down" in result["body"]
        assert _port_is_free(s.port)
    finally:
        s.stop()


def test_frozen_worker_turns_health_503_and_server_exits(tiny_ckpt):
    """A SIGSTOPped worker stops beating: within the watchdog period /health answers 503 naming
    it, the in-flight request fails, and the server kills its processes and exits non-zero.
    Old path: nothing notices (/health stays 200, the request hangs)."""
    env = {"VLLM_ENGINE_HEARTBEAT_TIMEOUT_S": str(WATCHDOG_S)}
    s = RemoteServer([tiny_ckpt], env=env)
    procs = _tree(s.proc.pid)
    try:
        (worker,) = _workers(s.proc.pid)
        result: dict = {}
        body = {"prompt": "x", "max_tokens": 30000, "ignore_eos": True, "stream": True}
        th = threading.Thread(target=_stream, args=(s.url, body, result))
        th.start()
        time.sleep(1.5)  # the request is decoding
        worker.suspend()
        t0 = time.monotonic()
        health = None
        while time.monotonic() - t0 < WATCHDOG_S + 5:
            with contextlib.suppress(requests.RequestException):
                r = requests.get(s.url + "/health", timeout=1)
                if r.status_code != 200:
                    health = (r.status_code, r.text, time.monotonic() - t0)
                    break
            time.sleep(0.1)
        print(f"/health: {health}")
        assert health is not None, "/health stayed 200"
        assert health[0] == 503 and f"worker rank 0 (pid {worker.pid})" in health[1]
        assert "no heartbeat" in health[1]
        th.join(15)
        assert not th.is_alive(), "the in-flight request hung"
        assert "exc" in result or "no heartbeat" in result["body"], result
        assert s.proc.wait(20) not in (0, None)
        gone, alive = psutil.wait_procs(procs, timeout=10)
        assert not alive, f"left behind: {[p.pid for p in alive]}"
    finally:
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.resume()
        s.stop()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()


def test_killed_worker_fails_requests_and_server_exits(tiny_ckpt):
    s = RemoteServer([tiny_ckpt])
    try:
        workers = _workers(s.proc.pid)
        assert workers, "expected worker processes under the engine core"
        result: dict = {}
        body = {"prompt": "x", "max_tokens": 30000, "ignore_eos": True, "stream": True}
        th = threading.Thread(target=_stream, args=(s.url, body, result))
        th.start()
        time.sleep(1.5)  # the request is decoding
        os.kill(workers[0].pid, signal.SIGKILL)
        th.join(30)
        assert not th.is_alive(), "the in-flight request hung"
        assert result.get("status", 200) == 200, result  # it was running, not refused
        assert result["elapsed"] < 20
        assert "exc" in result or "error" in result["body"]
        s.proc.wait(30)  # the server exits on its own
        assert s.proc.returncode not in (0, None)
        assert "exited with code" in s.output() or "died" in s.output()
    finally:
        s.stop()
