"""Process plumbing shared by the front end, the engine core and the workers."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import mmap
import os
import signal
import sys
import tempfile
import threading
import time
from array import array

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


def token_array(ids) -> array:
    """Token ids packed as int32 (``array("i")``): what the engine keeps of a prompt for its
    lifetime. The garbage collector visits none of its elements; a tuple's are all visited at its
    first young collection, and 64 prompts of 64K tokens arriving together cost that collection
    ~50 ms (a stalled step in the engine core, a late read in the front end). Bytes (the packed
    form on the wire, native byte order) are taken as they are."""
    if isinstance(ids, array) and ids.typecode == "i":
        return ids
    if isinstance(ids, (bytes, bytearray, memoryview)):
        if len(ids) % 4:
            raise ValueError(f"packed token ids: {len(ids)} bytes is not a whole number of int32")
        a = array("i")
        a.frombytes(ids)
        return a
    try:
        return array("i", ids)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"token ids must be int32 integers: {e}") from None


def freeze_gc_heap(what: str) -> None:
    """After start-up: collect once, then move every surviving object to the collector's
    permanent generation. A full collection walks every tracked object; with torch, Triton and
    the model loaded that is ~300,000 objects, 0.1 s on 2 cores, a pause inside whatever step it
    falls in (the slowest serving steps were such pauses). Start-up objects live until the
    process ends, so they need no collecting; everything allocated later is collected as before
    (frozen objects are still freed by reference counting when dropped)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.debug(
        "%s: froze %d start-up objects out of the GC's scans (%.0f ms)",
        what,
        gc.get_freeze_count(),
        (time.perf_counter() - t0) * 1e3,
    )


def die_with_parent() -> None:
    """Linux: receive SIGKILL when the parent process dies, so no process outlives its parent."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


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
    """Ask each process to stop over its socket, wait up to `grace_s`, then kill stragglers (a
    step in progress is not waited for: on CPU one step may take many seconds)."""
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
    """SIGKILL each process still alive and every process under it (an engine core's workers),
    stopped (SIGSTOP) ones included."""
    import psutil

    tree = []
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(p.pid)
                tree += [root, *root.children(recursive=True)]
                logger.warning("killing %s (pid %d) and the processes under it", p.name, p.pid)
    for q in tree:
        with contextlib.suppress(psutil.Error):
            q.kill()
    for p in procs:
        p.join(2)


HEARTBEAT_INTERVAL_S = 0.5


class HeartbeatBoard:
    """Liveness of the engine-core and worker processes, read by the front end's watchdog.

    A small shared file holds one slot per process, two float64: [pid, time.monotonic() of its
    last beat]. A daemon thread in each process (`start`) beats every HEARTBEAT_INTERVAL_S apart
    from the model step (one step on CPU may take many seconds), so a slot goes stale only when
    the whole process stops: frozen (SIGSTOP), dead, or stuck holding the GIL. CLOCK_MONOTONIC is
    system-wide on Linux, so the reader compares the stamps with its own clock. Slots: replica
    `dp_rank` has its engine core at ``dp_rank * (world_size + 1)``, then its workers in rank
    order. Pickles as its path (for the spawned processes)."""

    def __init__(self, path: str, num_replicas: int, world_size: int):
        self.path, self.num_replicas, self.world_size = path, num_replicas, world_size
        self.num_slots = num_replicas * (world_size + 1)
        self._view: memoryview | None = None

    @classmethod
    def create(cls, directory: str, num_replicas: int, world_size: int) -> HeartbeatBoard:
        board = cls(os.path.join(directory, "heartbeats"), num_replicas, world_size)
        with open(board.path, "wb") as f:
            f.write(bytes(16 * board.num_slots))
        return board

    def __getstate__(self) -> tuple:
        return self.path, self.num_replicas, self.world_size

    def __setstate__(self, state: tuple) -> None:
        self.__init__(*state)

    def engine_slot(self, dp_rank: int) -> int:
        return dp_rank * (self.world_size + 1)

    def worker_slot(self, global_rank: int) -> int:
        dp_rank, rank_in_replica = divmod(global_rank, self.world_size)
        return self.engine_slot(dp_rank) + 1 + rank_in_replica

    def describe(self, slot: int) -> str:
        dp_rank, i = divmod(slot, self.world_size + 1)
        if i == 0:
            return f"engine core DP{dp_rank}"
        return f"worker rank {dp_rank * self.world_size + i - 1}"

    def _slots(self) -> memoryview:  # [num_slots * 2] float64
        if self._view is None:
            with open(self.path, "r+b") as f:
                self._view = memoryview(mmap.mmap(f.fileno(), 16 * self.num_slots)).cast("d")
        return self._view

    def start(self, slot: int) -> None:
        """Beat for this process in `slot` from a daemon thread, until the process ends."""
        view, pid = self._slots(), float(os.getpid())

        def beat() -> None:
            while True:
                view[2 * slot] = pid
                view[2 * slot + 1] = time.monotonic()
                time.sleep(HEARTBEAT_INTERVAL_S)

        threading.Thread(target=beat, name="heartbeat", daemon=True).start()

    def silent(self, timeout_s: float, since: float) -> list[tuple[str, int, float]]:
        """(process, pid, seconds since its last beat) of each process silent for longer than
        `timeout_s`; a slot's age counts from `since` at the earliest (the end of start-up)."""
        view, now = self._slots(), time.monotonic()
        out = []
        for slot in range(self.num_slots):
            age = now - max(view[2 * slot + 1], since)
            if age > timeout_s:
                out.append((self.describe(slot), int(view[2 * slot]), age))
        return out
