"""Prefix-cache counters (``vllm:prefix_cache_queries`` / ``_hits``): each request's lookup counts
once, at its first admission, however many steps it waited for room, so hits / queries is the
share of prompt tokens served from the cache (what ``usage.cached_tokens`` reports)."""

from __future__ import annotations

from vllm.core.messages import EngineCoreRequest, KVCachePlan, ModelRunnerOutput, SamplingOptions
from vllm.core.scheduler import Scheduler
from vllm.engine.arg_utils import EngineArgs


def _run(s: Scheduler, reqs: list[tuple[str, list[int]]]) -> tuple[int, int, dict[str, int]]:
    for rid, prompt in reqs:
        s.add_request(
            EngineCoreRequest(rid, prompt, SamplingOptions(max_tokens=3, ignore_eos=True), [0])
        )
    queries = hits = waits = 0
    cached: dict[str, int] = {}
    for _ in range(200):
        if not s.has_work():
            break
        so = s.schedule()
        waits += len(s.waiting) > 0 and bool(so.num_scheduled_tokens)
        ro = ModelRunnerOutput()
        for rid in so.num_scheduled_tokens:
            r = s.requests[rid]
            if r.num_computed_tokens + so.num_scheduled_tokens[rid] >= r.num_tokens:
                ro.req_ids.append(rid)
                ro.sampled_token_ids.append([7])
        for o in s.update_from_output(so, ro):
            if o.finish_reason is not None:
                cached[o.request_id] = o.num_cached_tokens
        st = s.stats()
        queries, hits = queries + st.prefix_cache_queries, hits + st.prefix_cache_hits
    assert waits > 2  # the later requests were looked up at several steps before admission
    return queries, hits, cached


def test_a_request_waiting_for_room_is_counted_once(tiny_ckpt):
    cfg = EngineArgs(
        model=tiny_ckpt, max_num_batched_tokens=512, max_num_seqs=4
    ).create_engine_config()
    s = Scheduler(cfg, KVCachePlan(5))  # 5 blocks of 64: one 200-token request at a time
    shared = list(range(10, 210))
    reqs = [("a", shared), ("b", shared + [5]), ("c", list(range(300, 500)))]
    queries, hits, cached = _run(s, reqs)
    assert queries == sum(len(p) for _, p in reqs)
    assert hits == sum(cached.values()) == 192  # b reuses a's three full blocks
