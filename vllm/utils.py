"""Process plumbing shared by the front end, the engine core and the workers."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import tempfile

logger = logging.getLogger("vllm")


def init_logging(level: str | None = None) -> None:
    lvl = (level or os.environ.get("VLLM_LOGGING_LEVEL", "INFO")).upper()
    if not logging.getLogger("vllm").handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s [%(processName)s] %(message)s", "%H:%M:%S")
        )
        logging.getLogger("vllm").addHandler(h)
    logging.getLogger("vllm").setLevel(lvl)


def die_with_parent() -> None:
    """Linux: receive SIGKILL when the parent process dies, so no process outlives its parent."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ipc_dir() -> str:
    return tempfile.mkdtemp(prefix="vllm-ipc-")


def ipc_addr(d: str, name: str) -> str:
    return f"ipc://{os.path.join(d, name)}"


MAIN_GUARD_EXIT = 87  # exit code of an engine process that re-ran the main script's LLM(...)
MAIN_GUARD_MESSAGE = (
    "LLM(...) ran while an engine process was importing your script: engine processes start with "
    "'spawn', which re-imports the main script, so put the code that creates the engine under "
    '`if __name__ == "__main__":`'
)


def refuse_in_spawn_bootstrap() -> None:
    """Called before an engine is built: inside a spawned process that is still importing the
    parent's main script (no `__main__` guard there), exit at once with MAIN_GUARD_EXIT instead
    of starting processes recursively; the parent turns the code into MAIN_GUARD_MESSAGE."""
    import multiprocessing.process

    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        sys.stderr.write(f"error: {MAIN_GUARD_MESSAGE}\n")
        sys.stderr.flush()
        os._exit(MAIN_GUARD_EXIT)


class EngineDeadError(RuntimeError):
    """The engine (a worker or the engine core) died; the message says why."""


def send_nonblocking(sock, data: bytes, check_alive, timeout_s: float = 30.0) -> None:
    """Send without ever blocking forever: a ZMQ PUSH socket whose peer died blocks on send, so
    poll the peer's liveness (`check_alive` raises if it is dead) while the queue is full."""
    import time

    import zmq

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.send(data, zmq.NOBLOCK)
            return
        except zmq.Again:
            check_alive()
            if time.monotonic() > deadline:
                raise EngineDeadError("timed out sending to the engine") from None
            time.sleep(0.001)


def stop_processes(procs, sockets, message: bytes, grace_s: float) -> None:
    """Ask each process to stop over its socket, wait up to `grace_s`, then kill stragglers."""
    import time

    import zmq

    for s in sockets:
        try:
            s.send(message, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    kill_processes(procs)


def kill_processes(procs) -> None:
    for p in procs:
        if p.is_alive():
            logger.warning("terminating %s", p.name)
            p.terminate()
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(2)
