"""Spawns one worker process per rank of an engine replica and runs steps on them.

The scheduler output goes to every worker over its own ZMQ socket; the driver (first rank of
the replica) sends back the sampled tokens. With a KV connector every rank also reports its KV
transfers each step, combined here (``aggregate_outputs``: a transfer is done once every rank has
reported it). Worker death or a worker error is noticed within
~50 ms while waiting (and by `check_alive` between steps) and raised as EngineDeadError naming the
rank and cause. A frozen worker is the front end's to notice, through the `HeartbeatBoard`.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import time

import zmq

from vllm.config import VllmConfig
from vllm.core.messages import (
    KVCachePlan,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerMessage,
    decoder,
    encoder,
)
from vllm.distributed.kv_transfer import KVConnectorOutput, aggregate_outputs
from vllm.utils import (
    EngineDeadError,
    HeartbeatBoard,
    ipc_addr,
    ipc_dir,
    send_nonblocking,
    stop_processes,
)

STARTUP_TIMEOUT_S = 1800.0


class MultiprocExecutor:
    def __init__(
        self,
        config: VllmConfig,
        dp_rank: int,
        dist_init: str,
        heartbeats: HeartbeatBoard | None = None,
    ):
        self.config = config
        self.world_size = config.parallel_config.world_size
        self.first_rank = dp_rank * self.world_size
        self.ctx = zmq.Context()
        self.ipc_dir = d = ipc_dir()
        self.result_addr = ipc_addr(d, "results")
        self.results = self.ctx.socket(zmq.PULL)
        self.results.bind(self.result_addr)
        self.enc, self.dec = encoder(), decoder(WorkerMessage)
        spawn = mp.get_context("spawn")
        self.procs, self.socks = [], []
        from vllm.worker.worker import worker_main

        for i in range(self.world_size):
            rank = self.first_rank + i
            addr = ipc_addr(d, f"in-{rank}")
            sock = self.ctx.socket(zmq.PUSH)
            sock.bind(addr)
            p = spawn.Process(
                target=worker_main,
                name=f"VllmWorker-{rank}",
                args=(config, rank, dp_rank, dist_init, addr, self.result_addr, heartbeats),
                daemon=True,
            )
            p.start()
            self.procs.append(p)
            self.socks.append(sock)
        infos = self._collect("ready", self.world_size, STARTUP_TIMEOUT_S)
        # every rank allocated the minimum over its replica's ranks; DP replicas may differ
        plans = [m.kv_plan for m in infos]
        self.kv_plan = KVCachePlan(
            num_blocks=min(p.num_blocks for p in plans),
            num_host_blocks=min(p.num_host_blocks for p in plans),
            num_idx_blocks=min(p.num_idx_blocks for p in plans),
        )
        self.num_blocks = self.kv_plan.num_blocks
        self.dead: str | None = None
        # every rank answers each step when KV moves between engines (its transfers' progress)
        self.kv_transfer = config.uses_kv_connector
        self.num_answers = self.world_size if self.kv_transfer else 1
        self._kv_pending: dict[str, dict[str, int]] = {}

    def _check_alive(self) -> None:
        for i, p in enumerate(self.procs):
            if p.exitcode is not None:
                raise EngineDeadError(
                    f"worker rank {self.first_rank + i} exited with code {p.exitcode}"
                )

    def check_alive(self) -> None:
        """Between steps: raise EngineDeadError if a worker reported an error or exited."""
        try:
            if self.results.poll(0):  # nothing else arrives between steps
                m = self.dec.decode(self.results.recv())
                if m.kind == "error":
                    raise EngineDeadError(self._describe_failure(m))
            self._check_alive()
        except EngineDeadError as e:
            self.dead = str(e)
            raise

    def _describe_failure(self, first: WorkerMessage) -> str:
        """When one rank fails its peers fail too (collectives break); wait briefly and report
        every rank's error, the root cause first."""
        errors = {first.rank: first.error}
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            if self.results.poll(50):
                m = self.dec.decode(self.results.recv())
                if m.kind == "error":
                    errors[m.rank] = m.error
        secondary = ("Connection closed by peer", "Connection reset", "Broken pipe", "Timed out")
        ranked = sorted(errors.items(), key=lambda kv: any(s in (kv[1] or "") for s in secondary))
        return "; ".join(f"worker rank {r} failed: {e}" for r, e in ranked)

    def _collect(self, kind: str, count: int, timeout: float) -> list[WorkerMessage]:
        got: list[WorkerMessage] = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            if self.results.poll(50):
                m = self.dec.decode(self.results.recv())
                if m.kind == "error":
                    raise EngineDeadError(self._describe_failure(m))
                if m.kind == kind:
                    got.append(m)
                continue
            self._check_alive()
            if time.monotonic() > deadline:
                raise EngineDeadError(
                    f"timed out after {timeout:.0f}s waiting for workers ({kind})"
                )
        return got

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(so)
        return self.collect()

    def submit(self, so: SchedulerOutput) -> None:
        """Send a step to the workers without waiting for its results (they answer in order)."""
        self._send(self.enc.encode(so))

    def flush(self) -> None:
        """No step follows the ones submitted: the workers read the one they hold now."""
        self._send(b"FLUSH")

    def _send(self, raw: bytes) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)
        try:
            for s in self.socks:
                send_nonblocking(s, raw, self._check_alive, timeout_s=float("inf"))
        except EngineDeadError as e:
            self.dead = str(e)
            raise

    def collect(self) -> ModelRunnerOutput:
        """The results of the oldest step submitted and not yet collected."""
        if self.dead:
            raise EngineDeadError(self.dead)
        try:
            msgs = self._collect("output", self.num_answers, float("inf"))
        except EngineDeadError as e:
            self.dead = str(e)
            raise
        driver = next(m for m in msgs if m.rank == self.first_rank).output
        if self.kv_transfer:
            kv = [m.output.kv_connector_output or KVConnectorOutput() for m in msgs]
            driver.kv_connector_output = aggregate_outputs(kv, self._kv_pending)
        return driver

    def shutdown(self) -> None:
        stop_processes(self.procs, self.socks, b"SHUTDOWN", 5.0)
        for s in self.socks:
            s.close(linger=0)
        self.results.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
