"""The engine-core process: scheduler + executor in a busy loop, talking to the front end over ZMQ.

Input messages (msgpack): ("add", EngineCoreRequest) | ("abort", [ids]) | ("utility", [call_id,
name, args]) | ("shutdown",). Output: EngineCoreOutputs. If a worker dies (noticed during a step,
and between steps while idle) the core reports a `fatal` message (every in-flight request fails
with it) and exits non-zero. A heartbeat thread stamps the `HeartbeatBoard` for the front end's
watchdog; SIGTERM stops the loop between steps, and the front end kills a core still in a step.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback

import msgspec
import zmq

from vllm.config import VllmConfig
from vllm.core.messages import EngineCoreRequest, SchedulerOutput, encoder
from vllm.core.scheduler import Scheduler
from vllm.engine.messages import EngineCoreOutputs
from vllm.utils import HeartbeatBoard, die_with_parent, freeze_gc_heap, init_logging, logger

IDLE_POLL_MS = 100
# with only KV transfers in flight (loads to poll, leases to release): step this often
TRANSFER_POLL_MS = 5


class EngineCore:
    """Scheduler + executor, without the process loop (usable in-process for tests)."""

    def __init__(
        self,
        config: VllmConfig,
        dp_rank: int = 0,
        dist_init: str = "",
        heartbeats: HeartbeatBoard | None = None,
    ):
        from vllm.executor.multiproc_executor import MultiprocExecutor

        self.config = config
        self.dp_rank = dp_rank
        self.executor = MultiprocExecutor(config, dp_rank, dist_init, heartbeats)
        self.scheduler = Scheduler(config, self.executor.kv_plan)
        self._in_flight: SchedulerOutput | None = None  # --async-scheduling: sent, not read

    @property
    def in_flight(self) -> bool:
        """--async-scheduling: a step was sent and its results not yet read."""
        return self._in_flight is not None

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.in_flight

    def step(self, lockstep: bool = False) -> EngineCoreOutputs | None:
        """One model step. With `lockstep` (DP replicas sharing EP) the workers run a forward even
        with nothing scheduled (a dummy step) so every replica's EP all-to-alls stay matched.
        With --async-scheduling the next step is scheduled and sent before the results of the
        one in flight are read (:meth:`_step_async`)."""
        if self.scheduler.async_scheduling:
            return self._step_async(lockstep)
        if not self.scheduler.has_work():
            if lockstep:
                self.executor.execute(SchedulerOutput(dummy=True))
            return None
        so = self.scheduler.schedule()
        so.dummy = lockstep and so.total_num_scheduled_tokens == 0
        ro = self.executor.execute(so)
        outs = self.scheduler.take_stuck() + self.scheduler.update_from_output(so, ro)
        return EngineCoreOutputs(
            engine_index=self.dp_rank, outputs=outs, stats=self.scheduler.stats()
        )

    def _step_async(self, lockstep: bool = False) -> EngineCoreOutputs | None:
        """Schedule and send step N + 1, then read step N's results and apply them: the
        scheduler's work and the results' round trip overlap the workers' step. Step N + 1's
        decode rows take the tokens step N samples from the workers' device state. A request
        that step N finishes is computed once more by step N + 1 and that output is dropped.
        With ``lockstep`` (DP replicas sharing EP; called only while some replica has work to
        schedule) a step is always sent, a dummy one when this replica has none to schedule."""
        sched, ahead = self.scheduler, None
        if sched.has_work() and (self._in_flight is None or sched.can_schedule_ahead()):
            ahead = sched.schedule()
        elif lockstep:  # step -1: no scheduled step's number (its placeholders stay)
            ahead = SchedulerOutput(step=-1)
        if ahead is not None:
            ahead.dummy = lockstep and ahead.total_num_scheduled_tokens == 0
            ahead.pipelined = True  # this loop sends the next step or a flush before collecting
            self.executor.submit(ahead)
        if self._in_flight is None:
            self._in_flight = ahead
            return None
        so, self._in_flight = self._in_flight, ahead
        if ahead is None:  # the workers hold step N's results until a step or a flush comes
            self.executor.flush()
        ro = self.executor.collect()
        outs = sched.take_stuck() + sched.update_from_output(so, ro)
        return EngineCoreOutputs(engine_index=self.dp_rank, outputs=outs, stats=sched.stats())

    def info(self) -> dict:
        s = self.scheduler
        return {
            "num_blocks": self.executor.num_blocks,
            "block_size": s.block_size,
            "capacity_tokens": s.kv.capacity_tokens,
            "max_request_tokens": s.max_request_tokens,
        }

    def shutdown(self) -> None:
        self.executor.shutdown()


def engine_core_main(
    config: VllmConfig,
    dp_rank: int,
    in_addr: str,
    out_addr: str,
    dist_init: str,
    dp_init: str = "",
    heartbeats: HeartbeatBoard | None = None,
) -> None:
    die_with_parent()
    if heartbeats is not None:
        heartbeats.start(heartbeats.engine_slot(dp_rank))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("flag", True))
    init_logging()
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.connect(out_addr)
    inp = ctx.socket(zmq.PULL)
    inp.connect(in_addr)
    enc = encoder()
    core = None
    code = 0
    try:
        core = EngineCore(config, dp_rank, dist_init, heartbeats)
        wave = DPWave(config, dp_rank, dp_init)
        freeze_gc_heap(f"engine core {dp_rank}")
        out.send(enc.encode(EngineCoreOutputs(engine_index=dp_rank, ready=core.info())))
        _loop(core, inp, out, enc, stop, wave)
    except Exception as e:
        code = 1
        logger.error("engine core %d failed: %s", dp_rank, traceback.format_exc())
        out.send(
            enc.encode(EngineCoreOutputs(engine_index=dp_rank, fatal=f"{type(e).__name__}: {e}"))
        )
    finally:
        if core is not None:
            core.shutdown()
        out.close(linger=2000)
        inp.close(linger=0)
        ctx.term()
    sys.exit(code)


class DPWave:
    """Keeps DP engine cores in step when their workers share EP collectives.

    Every iteration each core all-reduces (has work, wants to stop) over a gloo group of the DP
    engine cores; if any has work, all step (idle ones run a dummy step); if any stops, all stop.
    Without EP across DP the replicas are independent and this is a no-op.
    """

    def __init__(self, config: VllmConfig, dp_rank: int, dp_init: str):
        pc = config.parallel_config
        self.active = pc.data_parallel_size > 1 and pc.enable_expert_parallel
        if self.active:
            import torch.distributed as dist

            from vllm.distributed.groups import join_store

            dp = pc.data_parallel_size
            dist.init_process_group(
                "gloo", store=join_store(dp_init, dp), world_size=dp, rank=dp_rank
            )

    def sync(self, has_work: bool, stop: bool) -> tuple[bool, bool]:
        if not self.active:
            return has_work, stop
        import torch
        import torch.distributed as dist

        t = torch.tensor([int(has_work), int(stop)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t[0]), bool(t[1])


def _loop(core: EngineCore, inp, out, enc, stop, wave: DPWave) -> None:
    dec = msgspec.msgpack.Decoder()
    req_dec = msgspec.msgpack.Decoder(EngineCoreRequest)
    reqs_dec = msgspec.msgpack.Decoder(list[EngineCoreRequest])
    sched = core.scheduler
    idle_ms = 10 if wave.active else IDLE_POLL_MS
    shutdown = False
    while True:
        timeout = 0 if sched.waiting or sched.running or core.in_flight else idle_ms
        if timeout and core.has_work():
            timeout = TRANSFER_POLL_MS
        aborted = False
        while inp.poll(timeout):
            timeout = 0
            raw = inp.recv()
            kind, _, body = raw.partition(b"|")
            if kind in (b"add", b"adds"):
                reqs = [req_dec.decode(body)] if kind == b"add" else reqs_dec.decode(body)
                errs = [e for e in map(sched.add_request, reqs) if e is not None]
                if errs:
                    out.send(enc.encode(EngineCoreOutputs(engine_index=core.dp_rank, outputs=errs)))
            elif kind == b"abort":
                sched.abort(dec.decode(body))
                aborted = True
            elif kind == b"utility":
                call_id, name, args = dec.decode(body)
                out.send(
                    enc.encode(
                        EngineCoreOutputs(
                            engine_index=core.dp_rank, utility=_utility(core, call_id, name, args)
                        )
                    )
                )
            elif kind == b"shutdown":
                shutdown = True
                break
        if aborted and not core.has_work():  # no step will report the freed seats and blocks
            out.send(enc.encode(EngineCoreOutputs(engine_index=core.dp_rank, stats=sched.stats())))
        # with --async-scheduling, replicas in lockstep agree on work still to schedule; a
        # step in flight (every replica has one when any does) is read without a new step
        pending = wave.active and sched.async_scheduling
        has_work = sched.has_work() if pending else core.has_work()
        any_work, any_stop = wave.sync(has_work, shutdown or stop["flag"])
        if any_stop:
            return
        if not any_work and not (pending and core.in_flight):
            core.executor.check_alive()  # a worker that dies while idle fails no step
            continue
        res = core.step(lockstep=wave.active and any_work)
        if res is not None:
            out.send(enc.encode(res))


def _utility(core: EngineCore, call_id: int, name: str, args: list) -> list:
    try:
        if name == "reset_prefix_cache":
            return [call_id, core.scheduler.kv.reset_prefix_cache(), None]
        if name == "info":
            return [call_id, core.info(), None]
        if name == "ping":
            return [call_id, time.time(), None]
        if name == "pid":
            return [call_id, os.getpid(), None]
        return [call_id, None, f"unknown utility {name!r}"]
    except Exception as e:  # noqa: BLE001
        return [call_id, None, str(e)]
