"""--async-scheduling at the scheduler: step N + 1 is scheduled before step N's results are
applied. Driven by a stand-in worker that follows the real one's rule for which rows sample (a
chunk reaching the newest token, counting the tokens it sampled itself) and samples a token that
depends only on the request and position, so the asynchronous run must give exactly the
synchronous run's outputs: stops, max_tokens, preemption and aborts included."""

from __future__ import annotations

import pytest

from vllm.core.messages import EngineCoreRequest, KVCachePlan, ModelRunnerOutput, SamplingOptions
from vllm.core.scheduler import Scheduler
from vllm.engine.arg_utils import EngineArgs

EOS = 0


@pytest.fixture(scope="module")
def configs(tiny_ckpt):
    kw = dict(model=tiny_ckpt, max_num_batched_tokens=96, max_num_seqs=4)
    return (
        EngineArgs(**kw).create_engine_config(),
        EngineArgs(**kw, async_scheduling=True).create_engine_config(),
    )


def _token(rid: str, pos: int) -> int:
    """The stand-in model: EOS for requests "e*" at position 60, else a fixed function."""
    if rid.startswith("e") and pos == 60:
        return EOS
    return 3 + (sum(map(ord, rid)) * 31 + pos * 7) % 90


class Worker:
    def __init__(self):
        self.known: dict[str, int] = {}
        self.sampled: dict[str, int] = {}
        self.rows_per_step: list[int] = []

    def run(self, so) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.known.pop(rid, None)
            self.sampled.pop(rid, None)
        start = {r.req_id: r.num_computed_tokens for r in so.new_reqs}
        start |= {c.req_id: c.num_computed_tokens for c in so.cached_reqs}
        for r in so.new_reqs:
            self.known[r.req_id], self.sampled[r.req_id] = r.num_tokens, 0
        ro = ModelRunnerOutput(step=so.step, req_ids=[], sampled_token_ids=[])
        for rid, n in so.num_scheduled_tokens.items():
            seq = start[rid] + n
            if seq >= self.known[rid] + self.sampled[rid]:
                self.sampled[rid] += 1
                ro.req_ids.append(rid)
                ro.sampled_token_ids.append([_token(rid, seq)])
        self.rows_per_step.append(len(so.num_scheduled_tokens))
        return ro


def _drive(s: Scheduler, ahead: bool, abort_at: dict[int, str] | None = None):
    """Outputs per request (tokens, finish reason), running the engine core's loop."""
    w, got, fin, pending, step = Worker(), {}, {}, None, 0
    for _ in range(5000):
        step += 1
        if abort_at and step in abort_at:
            s.abort([abort_at[step]])
        nxt = None
        if s.has_work() and (pending is None or (ahead and s.can_schedule_ahead())):
            nxt = s.schedule()
            nxt = (nxt, w.run(nxt))
        if pending is not None:
            for o in s.update_from_output(*pending):
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason:
                    fin[o.request_id] = o.finish_reason
        elif nxt is None:
            return got, fin, w
        pending = nxt
    raise AssertionError("did not finish")


def _requests(s: Scheduler, lengths, max_tokens=30, prefix="r"):
    for i, n in enumerate(lengths):
        rid = f"{prefix}{i}"
        s.add_request(
            EngineCoreRequest(
                rid,
                [10 + (i * 13 + j) % 80 for j in range(n)],
                SamplingOptions(temperature=0, max_tokens=max_tokens + i),
                [EOS],
            )
        )


@pytest.mark.parametrize("blocks", [100, 6])  # 6: preemptions
def test_async_equals_sync(configs, blocks):
    sync_cfg, async_cfg = configs
    runs = []
    for cfg, ahead in ((sync_cfg, False), (async_cfg, True)):
        s = Scheduler(cfg, KVCachePlan(blocks))
        _requests(s, (5, 40, 70, 130, 33, 9))
        _requests(s, (20, 58), prefix="e")  # stop at EOS (position 60)
        got, fin, w = _drive(s, ahead)
        assert s.kv.pool.num_free_blocks == blocks and not s.requests
        runs.append((got, fin, s._stats.num_preemptions))
    (g0, f0, p0), (g1, f1, p1) = runs
    assert g1 == g0 and f1 == f0
    assert f0["e1"] == "stop" and g0["e1"] == [_token("e1", 58), _token("e1", 59), EOS]
    assert f0["e0"] == "length" and len(g0["e0"]) == 30
    assert f0["r0"] == "length" and len(g0["r0"]) == 30
    if blocks == 6:
        assert p1 > 0


def test_steps_are_scheduled_ahead(configs):
    """While a step is in flight the next one is scheduled, its decode rows included; a finished
    request's extra row is computed once and never reported."""
    _, cfg = configs
    s = Scheduler(cfg, KVCachePlan(100))
    _requests(s, (8,), max_tokens=3)
    so1 = s.schedule()  # the prompt: samples token 1
    so2 = s.schedule()  # scheduled before so1's results: decodes the token in flight
    assert so2.num_scheduled_tokens == {"r0": 1} and s.requests["r0"].num_output_placeholders == 2
    w = Worker()
    ro1, ro2 = w.run(so1), w.run(so2)
    s.update_from_output(so1, ro1)
    so3 = s.schedule()  # the third token
    assert so3.num_scheduled_tokens == {"r0": 1}
    assert s.schedule().num_scheduled_tokens == {}  # max_tokens reached counting in flight
    out = s.update_from_output(so2, ro2) + s.update_from_output(so3, w.run(so3))
    assert [t for o in out for t in o.new_token_ids] == [_token("r0", 9), _token("r0", 10)]
    assert out[-1].finish_reason == "length" and not s.requests


def test_abort_while_in_flight(configs):
    _, cfg = configs
    s = Scheduler(cfg, KVCachePlan(20))
    _requests(s, (30, 30), max_tokens=50)
    got, fin, _ = _drive(s, True, abort_at={6: "r1"})
    assert len(got["r0"]) == 50 and 0 < len(got["r1"]) < 10 and "r1" not in fin
    assert s.kv.pool.num_free_blocks == 20 and not s.requests


def test_start_up_errors_name_the_flag(tiny_ckpt):
    with pytest.raises(ValueError, match="--async-scheduling.*--speculative-config"):
        EngineArgs(
            model=tiny_ckpt,
            async_scheduling=True,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        ).create_engine_config()


@pytest.mark.distributed
@pytest.mark.parametrize("ep", [False, True])
def test_llm_async_with_dp_replicas(tiny_ckpt, ep):
    """DP replicas without EP run independently: each engine core schedules ahead on its own.
    With EP they run in lockstep: a replica with nothing to schedule sends a dummy step ahead,
    so every replica's workers run the same forwards (EP's all-to-alls stay matched) while the
    others schedule ahead; an uneven load leaves one replica idle for most of the run. The
    outputs equal the synchronous run's."""
    from vllm import LLM, SamplingParams

    prompts = [list(range(11 + 5 * i, 11 + 5 * i + n)) for i, n in enumerate((6, 50, 90, 13))]
    params = [
        SamplingParams(temperature=0.7 if i % 2 else 0.0, seed=7 + i, max_tokens=n, ignore_eos=True)
        for i, n in enumerate((12, 5, 20, 9))
    ]
    runs = []
    for flag in (False, True):
        m = LLM(
            tiny_ckpt,
            async_scheduling=flag,
            data_parallel_size=2,
            enable_expert_parallel=ep,
            max_num_batched_tokens=64,
        )
        try:
            outs = m.generate([{"prompt_token_ids": p} for p in prompts], params)
            runs.append([list(o.outputs[0].token_ids) for o in outs])
            pipelined = sum(st.num_pipelined_steps for st in m.stats_history)
        finally:
            m.shutdown()
        assert (pipelined > 0) == flag
    assert runs[1] == runs[0] and [len(t) for t in runs[1]] == [12, 5, 20, 9]


@pytest.mark.parametrize("graphs", [False, True])
def test_llm_async_equals_sync(tiny_ckpt, graphs):
    """The real engine: worker processes, CPU model, the graphs' static decode path (with mixed
    steps split) or eager, sampled and greedy rows, logprobs, a stop token, a KV budget small
    enough to preempt: identical outputs with and without --async-scheduling."""
    from vllm import LLM, SamplingParams
    from vllm.kv_cache_interface import kv_bytes_per_token

    prompts = [list(range(7 + 3 * i, 7 + 3 * i + n)) for i, n in enumerate((5, 40, 70, 130, 9))]
    mc = EngineArgs(model=tiny_ckpt).create_engine_config().model_config
    per_block = 64 * kv_bytes_per_token(mc.arch, "auto", mc.dtype, num_mtp_layers=0)
    stops = list(range(43, mc.arch.vocab_size))
    kw = dict(max_num_batched_tokens=64, max_num_seqs=8, kv_cache_memory_bytes=5 * per_block)
    if graphs:
        kw["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8]}
    runs = []
    for flag in (False, True):
        m = LLM(tiny_ckpt, async_scheduling=flag, **kw)
        try:
            params = [
                SamplingParams(
                    temperature=0.8 if i % 2 else 0.0,
                    seed=100 + i,
                    max_tokens=n,
                    ignore_eos=True,
                    logprobs=2 if i == 1 else None,
                )
                for i, n in enumerate((3, 30, 9, 17, 24))
            ]
            outs = m.generate([{"prompt_token_ids": p} for p in prompts], params)
            toks = [list(o.outputs[0].token_ids) for o in outs]
            lps = [{t: d[t].logprob for t in d} for d in outs[1].outputs[0].logprobs]
            # stop at the 5th token of the greedy request 2 (a stop token id, as a user sets it)
            stop = SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=[toks[2][4]])
            stopped = m.generate([{"prompt_token_ids": prompts[2]}], stop)[0].outputs[0]
            # min_tokens bans the stop tokens (here all but 40 ids) for 7 outputs, so the 8th
            # output is a stop token; a count late by one step (the worker reads step N after
            # launching N + 1) would ban them once more: 9 outputs
            held = SamplingParams(
                temperature=0.0, max_tokens=12, stop_token_ids=stops, min_tokens=7
            )
            late = m.generate([{"prompt_token_ids": prompts[2]}], held)[0].outputs[0]
            preempted = sum(st.num_preemptions for st in m.stats_history)
            pipelined = sum(st.num_pipelined_steps for st in m.stats_history)
            runs.append((toks, lps, list(stopped.token_ids), stopped.finish_reason))
            runs[-1] += (list(late.token_ids),)
        finally:
            m.shutdown()
        assert preempted > 0
        # the worker launched steps before reading the previous one only with the flag
        assert (pipelined > 0) == flag, pipelined
    (t0, l0, s0, r0, h0), (t1, l1, s1, r1, h1) = runs
    assert h1 == h0 and len(h0) == 8 and h0[-1] in stops and not set(h0[:7]) & set(stops)
    assert t1 == t0 and s1 == s0 == t0[2][:5] and r0 == r1 == "stop"
    assert [len(t) for t in t1] == [3, 30, 9, 17, 24]
    for a, b in zip(l1, l0, strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[k] - b[k]) < 1e-4 for k in a)
