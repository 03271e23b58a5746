"""The front end's handle on the engine-core process(es): start them, send requests, read outputs,
notice death.

With --data-parallel-size N there are N engine cores (each with its own workers); requests go to
the least loaded one and outputs from all arrive on one socket.

Death is noticed three ways: an engine core reports `fatal` (a worker failed or died), an engine
core process exits, or a process (engine core or worker) stops beating on the `HeartbeatBoard` for
``VLLM_ENGINE_HEARTBEAT_TIMEOUT_S`` (default 10; 0 turns the watchdog off): frozen, e.g. SIGSTOP,
while its step never returns.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing as mp
import os
import shutil
import time
import weakref

import msgspec
import zmq

from vllm.config import VllmConfig
from vllm.core.messages import EngineCoreRequest, decoder, encoder
from vllm.distributed.groups import host_store
from vllm.engine.messages import EngineCoreOutputs
from vllm.utils import (
    MAIN_GUARD_EXIT,
    MAIN_GUARD_MESSAGE,
    EngineDeadError,
    HeartbeatBoard,
    ipc_addr,
    ipc_dir,
    kill_processes,
    refuse_in_spawn_bootstrap,
    send_nonblocking,
    stop_processes,
)

STARTUP_TIMEOUT_S = 1800.0
# how long `shutdown` lets the engine cores finish before killing them and their workers
SHUTDOWN_GRACE_S = 2.0
# how often `get_output` checks liveness while outputs keep arriving
LIVENESS_CHECK_S = 0.25


def heartbeat_timeout_s() -> float:
    raw = os.environ.get("VLLM_ENGINE_HEARTBEAT_TIMEOUT_S", "10")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(
            f"VLLM_ENGINE_HEARTBEAT_TIMEOUT_S={raw!r}: expected seconds >= 0 (0: no watchdog)"
        )
    return value


class EngineCoreClient:
    def __init__(self, config: VllmConfig):
        from vllm.engine.core import engine_core_main

        refuse_in_spawn_bootstrap()

        self.config = config
        self.heartbeat_timeout_s = heartbeat_timeout_s()
        self.ctx = zmq.Context()
        self.ipc_dir = d = ipc_dir()
        self.out_addr = ipc_addr(d, "outputs")
        self.outputs = self.ctx.socket(zmq.PULL)
        self.outputs.bind(self.out_addr)
        self.enc = encoder()
        self.dec = decoder(EngineCoreOutputs)
        # the ranks' and the DP replicas' rendezvous stores live here, for the engine's lifetime
        dist_store, dist_init = host_store()
        dp_store, dp_init = host_store()
        self._stores = (dist_store, dp_store)
        spawn = mp.get_context("spawn")
        self.procs, self.inputs = [], []
        dp = config.parallel_config.data_parallel_size
        self.heartbeats = HeartbeatBoard.create(d, dp, config.parallel_config.world_size)
        self.load = [0] * dp
        self.owner: dict[str, int] = {}
        self.dead: str | None = None
        self.pending: list[EngineCoreOutputs] = []
        self._closed = False
        # a script that raises before LLM.shutdown() must still exit: multiprocessing joins
        # the (non-daemon) engine processes at exit, so stop them first (atexit runs this
        # before multiprocessing's own handler, registered earlier)
        ref = weakref.ref(self)
        atexit.register(lambda: (c := ref()) is not None and c.shutdown())
        try:  # interrupted (SIGINT) or failed: no engine process may outlive this
            for i in range(dp):
                addr = ipc_addr(d, f"input-{i}")
                s = self.ctx.socket(zmq.PUSH)
                s.bind(addr)
                p = spawn.Process(
                    target=engine_core_main,
                    name=f"EngineCore_DP{i}",
                    args=(config, i, addr, self.out_addr, dist_init, dp_init, self.heartbeats),
                    daemon=False,
                )
                p.start()
                self.procs.append(p)
                self.inputs.append(s)
            self.info = self._wait_ready()
        except BaseException:
            self._kill()
            raise
        self._watch_since = self._last_check = time.monotonic()
        self._call_ids = itertools.count()

    def _wait_ready(self) -> dict:
        infos: dict[int, dict] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(infos) < len(self.procs):
            if self.outputs.poll(100):
                m = self.dec.decode(self.outputs.recv())
                if m.fatal:
                    self._kill()
                    raise RuntimeError(f"engine failed to start: {m.fatal}")
                if m.ready is not None:
                    infos[m.engine_index] = m.ready
                continue
            for p in self.procs:
                if p.exitcode == MAIN_GUARD_EXIT:
                    self._kill()
                    raise RuntimeError(MAIN_GUARD_MESSAGE)
                if p.exitcode is not None:
                    self._kill()
                    raise RuntimeError(
                        f"engine process {p.name} exited with code {p.exitcode} during start-up"
                    )
            if time.monotonic() > deadline:
                self._kill()
                raise RuntimeError("engine start-up timed out")
        return {
            "max_request_tokens": min(i["max_request_tokens"] for i in infos.values()),
            "capacity_tokens": min(i["capacity_tokens"] for i in infos.values()),
            "num_blocks": min(i["num_blocks"] for i in infos.values()),
            "engines": infos,
        }

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        self._raise_if_dead()
        i = min(range(len(self.load)), key=self.load.__getitem__)
        self.owner[req.request_id] = i
        self.load[i] += 1
        send_nonblocking(self.inputs[i], b"add|" + self.enc.encode(req), self.check_alive)

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        """Several requests, each engine's share in one message: an engine core admits them in
        the same loop iteration, so an offline batch's step composition does not depend on how
        fast the messages arrive."""
        self._raise_if_dead()
        by_engine: dict[int, list[EngineCoreRequest]] = {}
        for req in reqs:
            i = min(range(len(self.load)), key=self.load.__getitem__)
            self.owner[req.request_id] = i
            self.load[i] += 1
            by_engine.setdefault(i, []).append(req)
        for i, batch in by_engine.items():
            send_nonblocking(self.inputs[i], b"adds|" + self.enc.encode(batch), self.check_alive)

    def abort(self, request_ids: list[str]) -> None:
        if self.dead:
            return
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            i = self.owner.get(rid)
            if i is not None:
                by_engine.setdefault(i, []).append(rid)
        for i, ids in by_engine.items():
            try:
                send_nonblocking(
                    self.inputs[i], b"abort|" + msgspec.msgpack.encode(ids), self.check_alive
                )
            except EngineDeadError:
                return

    def finished(self, request_id: str) -> None:
        i = self.owner.pop(request_id, None)
        if i is not None:
            self.load[i] -= 1

    def next_call_id(self) -> int:
        return next(self._call_ids)

    def send_utility(
        self, name: str, args: list, engines: list[int] | None = None, call_id: int | None = None
    ) -> int:
        """Ask engine cores (default: all) to run a utility; returns the call id that their
        replies (``EngineCoreOutputs.utility``) carry. The replies arrive on the output socket
        like any output: the socket's one reader routes them (``AsyncLLM``'s output thread, or
        :meth:`call_utility` for a single-threaded owner)."""
        self._raise_if_dead()
        cid = self.next_call_id() if call_id is None else call_id
        msg = b"utility|" + msgspec.msgpack.encode([cid, name, list(args)])
        for i in range(len(self.inputs)) if engines is None else engines:
            send_nonblocking(self.inputs[i], msg, self.check_alive)
        return cid

    def call_utility(self, name: str, *args, timeout: float = 60.0):
        """Run a utility on every engine core and wait for their answers, one per engine in
        engine order (other outputs read meanwhile are kept for :meth:`get_output`). Only for a
        caller that is the output socket's one reader (the offline ``LLM``)."""
        cid = self.send_utility(name, list(args))
        want, answers = len(self.inputs), []
        deadline = time.monotonic() + timeout
        kept = []
        try:
            while time.monotonic() < deadline and len(answers) < want:
                m = self.get_output(0.1)
                if m is None:
                    continue
                if m.utility is not None and m.utility[0] == cid:
                    if m.utility[2]:
                        raise RuntimeError(m.utility[2])
                    answers.append((m.engine_index, m.utility[1]))
                else:
                    kept.append(m)
        finally:
            self.pending.extend(kept)
        if len(answers) < want:
            raise TimeoutError(f"utility {name} timed out")
        return [a for _, a in sorted(answers, key=lambda x: x[0])]

    # ---- outputs -----------------------------------------------------------------------------
    def get_output(self, timeout_s: float) -> EngineCoreOutputs | None:
        """Next output batch, or None after timeout. Raises EngineDeadError if an engine died."""
        if self.pending:
            return self.pending.pop(0)
        self._raise_if_dead()
        if self.outputs.poll(int(timeout_s * 1000)):
            m = self.dec.decode(self.outputs.recv())
            if m.fatal:
                self.dead = m.fatal
                raise EngineDeadError(m.fatal)
            if time.monotonic() - self._last_check > LIVENESS_CHECK_S:
                self.check_alive()  # a frozen replica under DP sends nothing; the others do
            return m
        self.check_alive()
        return None

    def check_alive(self) -> None:
        self._last_check = time.monotonic()
        for p in self.procs:
            if p.exitcode is not None and self.dead is None:
                self.dead = f"engine process {p.name} exited with code {p.exitcode}"
        if self.dead is None and self.heartbeat_timeout_s > 0:
            silent = self.heartbeats.silent(self.heartbeat_timeout_s, self._watch_since)
            if silent:
                self.dead = "; ".join(
                    f"{name} (pid {pid}) sent no heartbeat for {age:.1f} s (frozen?)"
                    for name, pid, age in silent
                )
        self._raise_if_dead()

    def _raise_if_dead(self) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)

    # ---- shutdown -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine cores: those still in a step after SHUTDOWN_GRACE_S are killed with
        their workers."""
        if self._closed:
            return
        self._closed = True
        stop_processes(self.procs, self.inputs, b"shutdown|", SHUTDOWN_GRACE_S)
        for s in self.inputs:
            s.close(linger=0)
        self.outputs.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def _kill(self) -> None:
        kill_processes(self.procs)
