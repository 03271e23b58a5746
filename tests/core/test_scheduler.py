"""Scheduler and KV cache manager, driven without workers."""

from __future__ import annotations

import pytest
import torch

from vllm.core.block_pool import BlockPool, hash_block
from vllm.core.messages import EngineCoreRequest, KVCachePlan, ModelRunnerOutput, SamplingOptions
from vllm.core.scheduler import Scheduler
from vllm.engine.arg_utils import EngineArgs


@pytest.fixture(scope="module")
def config(tiny_ckpt):
    return EngineArgs(
        model=tiny_ckpt, max_num_batched_tokens=256, max_num_seqs=4
    ).create_engine_config()


def _req(rid, n, max_tokens=8, start=10):
    return EngineCoreRequest(
        rid,
        list(range(start, start + n)),
        SamplingOptions(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        [0],
    )


def _run(s: Scheduler, steps=1000):
    """Drive to completion with a fake runner that samples token 7; returns outputs by request."""
    got: dict[str, list[int]] = {}
    for _ in range(steps):
        if not s.has_work():
            return got
        so = s.schedule()
        assert so.total_num_scheduled_tokens <= s.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= s.max_num_seqs
        ro = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        for rid in so.num_scheduled_tokens:
            r = s.requests[rid]
            if r.num_computed_tokens >= r.num_tokens:
                ro.req_ids.append(rid)
                ro.sampled_token_ids.append([7])
        for o in s.update_from_output(so, ro):
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("scheduler did not finish")


def test_chunked_prefill_and_budget(config):
    s = Scheduler(config, KVCachePlan(100))
    s.add_request(_req("a", 600))
    first = s.schedule()  # (not fed back: inspect only)
    assert first.num_scheduled_tokens == {"a": 256}
    assert len(first.new_reqs[0].block_ids) == 4  # 256 tokens = 4 blocks of 64


def test_max_num_seqs(config):
    s = Scheduler(config, KVCachePlan(100))
    for i in range(6):
        s.add_request(_req(str(i), 10))
    got = _run(s)  # asserts <= 4 requests per step
    assert all(len(v) == 8 for v in got.values()) and len(got) == 6


def test_prefix_cache_hits_whole_blocks_and_keeps_one_token(config):
    s = Scheduler(config, KVCachePlan(100))
    s.add_request(_req("a", 200))
    _run(s)
    s.add_request(_req("b", 200))
    so = s.schedule()
    assert so.new_reqs[0].num_computed_tokens == 192 and so.num_scheduled_tokens["b"] == 8
    s2 = Scheduler(config, KVCachePlan(100))
    s2.add_request(_req("a", 128))
    _run(s2)
    s2.add_request(_req("c", 128))  # exactly two blocks: only one may hit
    assert s2.schedule().new_reqs[0].num_computed_tokens == 64


def test_blocks_completed_during_decode_are_published_once(config):
    """A block filled by generated tokens is published to the prefix cache the step it completes
    (only the new blocks are published per step: long contexts cost nothing extra per step), and
    a follow-up request whose prompt is the whole first conversation hits it."""
    s = Scheduler(config, KVCachePlan(100))
    s.add_request(_req("a", 100, max_tokens=40))  # 140 tokens: block 1 fills during decode
    out = _run(s)["a"]
    assert s.kv.published == {}  # forgotten with the request's blocks
    prompt = list(range(10, 110)) + out + [9] * 10
    s.add_request(EngineCoreRequest("b", prompt, SamplingOptions(max_tokens=1), [0]))
    assert s.schedule().new_reqs[0].num_computed_tokens == 128  # both full blocks hit


def test_preemption_recomputes_and_finishes(config):
    s = Scheduler(config, KVCachePlan(5))
    for i, n in enumerate((5, 40, 70, 130)):
        s.add_request(_req(str(i), n, max_tokens=60))
    got = _run(s)
    assert {k: len(v) for k, v in got.items()} == {str(i): 60 for i in range(4)}
    assert s.kv.pool.num_free_blocks == 5


def test_request_too_big_for_cache_refused(config):
    s = Scheduler(config, KVCachePlan(2))
    err = s.add_request(_req("x", 120, max_tokens=20))
    assert err is not None and "KV capacity 128" in err.error
    assert not s.has_work()


def test_abort_frees_blocks(config):
    s = Scheduler(config, KVCachePlan(10))
    s.add_request(_req("a", 100))
    s.schedule()
    assert s.kv.pool.num_free_blocks == 8
    s.abort(["a"])
    assert s.kv.pool.num_free_blocks == 10 and not s.has_work()


def test_block_pool_evicts_least_recently_freed():
    pool = BlockPool(3)
    a = pool.allocate(3)
    h = [hash_block(None, [i]) for i in range(3)]
    for b, hh in zip(a, h, strict=True):
        pool.cache_block(b, hh)
    pool.release([a[0]])
    pool.release([a[1], a[2]])  # released tail first: a[2] evicted before a[1]
    assert pool.lookup(h[0]) == a[0]
    pool.allocate(2)
    assert pool.lookup(h[0]) is None and pool.lookup(h[2]) is None and pool.lookup(h[1]) == a[1]


def test_hash_chain_depends_on_parent():
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0]), [1, 2])
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2])


def test_token_slice_matches_all_token_ids():
    from vllm.core.request import Request

    r = Request(_req("a", 10))
    r.output_token_ids += [100, 101, 102, 103]
    full = r.all_token_ids
    for a in range(0, 15):
        for b in range(a, 15):
            assert r.token_slice(a, b) == full[a:b]


def test_new_request_tokens_travel_as_int32_bytes(config):
    """What a worker is sent for a new request: prompt (+ outputs after a preemption) as int32
    bytes, decoded by the worker's request state to the same ids."""
    from array import array

    from vllm.core.request import Request
    from vllm.worker.gpu.states import RequestStates

    r = Request(_req("a", 10, start=70000))
    assert array("i", r.all_token_bytes()).tolist() == r.all_token_ids
    r.output_token_ids += [100, 101]
    assert array("i", r.all_token_bytes()).tolist() == r.all_token_ids
    s = Scheduler(config, KVCachePlan(100))
    s.add_request(_req("b", 20, start=140000))
    so = s.schedule()
    (nr,) = so.new_reqs
    assert isinstance(nr.token_ids, bytes) and nr.num_tokens == 20
    states = RequestStates(4, 64, torch.device("cpu"), 200000)
    slot = states.add(nr, [0])
    assert states.token_ids[slot].tolist() == list(range(140000, 140020))


def _feed(s: Scheduler, so) -> list:
    """Feed one step back with the fake runner of `_run` (token 7 for every finished prompt)."""
    ro = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
    for rid in so.num_scheduled_tokens:
        r = s.requests[rid]
        if r.num_computed_tokens >= r.num_tokens:
            ro.req_ids.append(rid)
            ro.sampled_token_ids.append([7])
    return s.update_from_output(so, ro)


def test_short_request_not_held_behind_long_prefill(config):
    """A 4-token prompt arriving mid-prefill of a long one is computed in the next step, beside
    the long prefill (which keeps the rest of the budget); alone, the long one takes it all."""
    s = Scheduler(config, KVCachePlan(100))
    s.add_request(_req("long", 2000, max_tokens=1))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"long": 256}  # alone: the whole budget
    _feed(s, first)
    s.add_request(_req("short", 4, max_tokens=2, start=500))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"long": 252, "short": 4}
    outs = {o.request_id: o.new_token_ids for o in _feed(s, so)}
    assert outs == {"short": [7]}  # first token after one step; the long prompt still prefills
    so = s.schedule()
    assert so.num_scheduled_tokens == {"short": 1, "long": 255}  # decode first, then the chunk


def test_two_long_prompts_share_the_budget(config):
    s = Scheduler(config, KVCachePlan(100))
    s.add_request(_req("a", 2000, max_tokens=1))
    _feed(s, s.schedule())
    s.add_request(_req("b", 2000, max_tokens=1, start=3000))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 128, "b": 128}
    got = _run(s)
    assert got == {"a": [7], "b": [7]}


def test_long_prefill_token_threshold_caps_chunks(tiny_ckpt):
    cfg = EngineArgs(
        model=tiny_ckpt, max_num_batched_tokens=256, long_prefill_token_threshold=100
    ).create_engine_config()
    s = Scheduler(cfg, KVCachePlan(100))
    s.add_request(_req("a", 250, max_tokens=1))
    s.add_request(_req("b", 30, max_tokens=1, start=400))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 100, "b": 30}
    _feed(s, so)
    assert _run(s) == {"a": [7]}


def test_preemption_never_takes_a_request_already_scheduled(tiny_ckpt):
    """Decodes are scheduled before prefills: when a prefill admitted earlier then needs blocks,
    the victim must be a request not yet given tokens this step (else its tokens would be
    computed into freed blocks)."""
    cfg = EngineArgs(
        model=tiny_ckpt, max_num_batched_tokens=256, long_prefill_token_threshold=64
    ).create_engine_config()
    s = Scheduler(cfg, KVCachePlan(6))
    s.add_request(_req("p", 350, max_tokens=5))  # 64 prompt tokens a step, 6 blocks in the end
    _feed(s, s.schedule())
    s.add_request(_req("d", 4, max_tokens=100, start=500))  # admitted later, then decodes
    preempted = 0
    for _ in range(300):
        if not s.has_work():
            break
        so = s.schedule()
        preempted += s._stats.num_preemptions
        for rid in so.num_scheduled_tokens:
            assert s.requests[rid].status.name == "RUNNING", rid
        _feed(s, so)
    assert preempted > 0  # the situation did arise
    assert not s.has_work() and s.kv.pool.num_free_blocks == 6


def test_structured_request_follows_its_grammar(config):
    """The scheduler sends a bitmask row for every structured request that samples; a runner that
    samples only allowed tokens ends at EOS with text the grammar accepts; prompt chunks get no
    row; the plain request beside it is untouched."""
    import re
    import time

    import numpy as np

    pytest.importorskip("xgrammar")
    from vllm.core.messages import SamplingOptions
    from vllm.structured_output import StructuredOutputsParams
    from vllm.tokenizer import Tokenizer

    tok = Tokenizer(config.model_config.tokenizer)
    s = Scheduler(config, KVCachePlan(100))
    opts = SamplingOptions(
        temperature=0, max_tokens=50, structured=StructuredOutputsParams(regex=r"[0-9]{2}-[a-c]")
    )
    s.add_request(EngineCoreRequest("g", list(range(10, 400)), opts, [0, 4, 6]))
    s.add_request(_req("plain", 20, max_tokens=5))
    deadline = time.monotonic() + 60
    got: dict[str, list[int]] = {}
    words = (config.model_config.vocab_size + 31) // 32
    while s.has_work():
        assert time.monotonic() < deadline
        so = s.schedule()
        rows = np.frombuffer(so.grammar_bitmask, dtype=np.int32).reshape(-1, words)
        assert len(rows) == len(so.grammar_req_ids)
        ro = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        for rid in so.num_scheduled_tokens:
            r = s.requests[rid]
            if r.num_computed_tokens < r.num_tokens:
                assert rid not in so.grammar_req_ids  # a prompt chunk samples nothing
                continue
            t = 7
            if rid in so.grammar_req_ids:
                row = rows[so.grammar_req_ids.index(rid)]
                allowed = [i for i in range(words * 32) if (int(row[i // 32]) >> (i % 32)) & 1]
                t = allowed[len(r.output_token_ids) % len(allowed)]
            ro.req_ids.append(rid)
            ro.sampled_token_ids.append([t])
        for o in s.update_from_output(so, ro):
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        if not so.num_scheduled_tokens:
            time.sleep(0.01)  # the grammar is compiling
    assert got["plain"] == [7] * 5
    assert got["g"][-1] in (0, 4, 6)
    assert re.fullmatch(r"[0-9]{2}-[a-c]", tok.decode(got["g"][:-1])), tok.decode(got["g"])
    assert not s._grammar._matchers  # dropped with the request


def test_bad_grammar_fails_the_request_only(config):
    pytest.importorskip("xgrammar")
    from vllm.core.messages import SamplingOptions
    from vllm.structured_output import StructuredOutputsParams

    s = Scheduler(config, KVCachePlan(100))
    # a bad EBNF (the front end refuses it first): the engine still fails only this request
    opts = SamplingOptions(max_tokens=3, structured=StructuredOutputsParams(grammar="root ::= "))
    s.add_request(EngineCoreRequest("bad", [10, 11, 12], opts, [0]))
    s.add_request(_req("ok", 10, max_tokens=3))
    import time

    errors, got = [], {}
    for _ in range(500):
        if not s.has_work():
            break
        so = s.schedule()
        errors += [o for o in s.take_stuck() if o.error]
        for o in _feed(s, so):
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        time.sleep(0.005)
    assert [e.request_id for e in errors] == ["bad"] and "EBNF parser error" in errors[0].error
    assert got == {"ok": [7, 7, 7]}


def _walked_by_gc(x) -> int:
    """How many objects a collection visits through x (a tuple or list: every element)."""
    import gc

    return sum(not isinstance(r, type) for r in gc.get_referents(x))


def test_long_prompts_stay_out_of_collections():
    """A request's prompt is kept in a form whose elements no collection visits (a list of 64K
    tokens is walked by every full collection, a tuple by its first young one: 64 such prompts
    arriving together cost ~50 ms, a pause inside a serving step); the views the scheduler builds
    from it are lists. From the front end it arrives as int32 bytes."""
    from vllm.core.request import Request
    from vllm.utils import token_array

    assert _walked_by_gc(tuple(range(1000, 2000))) == 1000  # what the check measures
    req = Request(_req("r", 5000, start=10))
    assert _walked_by_gc(req.prompt_token_ids) == 0
    packed = _req("p", 5000, start=10)
    packed.prompt_token_ids = token_array(packed.prompt_token_ids).tobytes()
    assert Request(packed).prompt_token_ids == req.prompt_token_ids
    req.output_token_ids += [7, 8]
    assert req.all_token_ids == list(range(10, 5010)) + [7, 8]
    assert req.token_slice(4992, 5002) == list(range(5002, 5010)) + [7, 8]
    assert req.token_slice(64, 128) == list(range(74, 138))
    assert req.token_slice(5000, 5002) == [7, 8]


def test_front_end_prompts_stay_out_of_collections(config):
    """The API server keeps each request's prompt for its lifetime (RequestState) too: the input
    processor packs it as int32 and sends those bytes; LLM.generate still returns upstream's list
    (tests/entrypoints/test_llm.py). Ids that are not int32 integers are a clear error."""
    from vllm.engine.input_processor import InputProcessor, ProcessedPrompt

    ip = InputProcessor(config, None, 4096)
    for prompt in ({"prompt_token_ids": list(range(3, 1000))}, list(range(3, 1000))):
        p = ip.tokenize(prompt)
        assert list(p.prompt_token_ids) == list(range(3, 1000))
        assert _walked_by_gc(p.prompt_token_ids) == 0
    assert list(ProcessedPrompt("x", [5, 6]).prompt_token_ids) == [5, 6]  # the server's lists
    for bad in ([1.5], ["7"], [2**40]):
        with pytest.raises(ValueError, match="int32"):
            ip.tokenize({"prompt_token_ids": bad})


class _ListPool:
    """The pool's contract as the plain structures it replaced: list counts and an OrderedDict
    of free blocks in eviction order."""

    def __init__(self, n):
        from collections import OrderedDict

        self.ref = [0] * n
        self.free = OrderedDict((i, None) for i in range(n))

    def touch(self, blocks):
        for b in blocks:
            if self.ref[b] == 0:
                self.free.pop(b, None)
            self.ref[b] += 1

    def allocate(self, n):
        if n > len(self.free):
            return None
        out = [self.free.popitem(last=False)[0] for _ in range(n)]
        for b in out:
            self.ref[b] = 1
        return out

    def release(self, blocks):
        for b in reversed(blocks):
            self.ref[b] -= 1
            assert self.ref[b] >= 0
            if self.ref[b] == 0:
                self.free[b] = None


@pytest.mark.parametrize("seed", range(4))
def test_block_pool_matches_the_list_reference(seed):
    """Random allocations, releases (tails first) and prefix-hit touches, small lists (scalar
    paths) and long ones (array paths), past several ring compactions: the same blocks handed
    out, counts and eviction order as the reference."""
    import random

    rng = random.Random(seed)
    n = 300
    pool, ref = BlockPool(n), _ListPool(n)
    held: list[list[int]] = []  # the lists taken (allocations and touches), to release later
    freed: list[list[int]] = []  # released lists whose blocks may be free again (touch targets)
    for _ in range(3000):
        op = rng.random()
        if op < 0.4:
            k = rng.choice([0, 1, 3, 8, 9, 40, 150])
            got, want = pool.allocate(k), ref.allocate(k)
            assert got == want
            if got:
                held.append(got)
        elif op < 0.75 and held:
            blocks = held.pop(rng.randrange(len(held)))
            pool.release(blocks)
            ref.release(blocks)
            freed.append(blocks)
        elif freed:  # a prefix hit: blocks still cached (free or shared) get a reference
            blocks = rng.choice(freed)
            blocks = blocks[: rng.randrange(1, len(blocks) + 1)]
            pool.touch(blocks)
            ref.touch(blocks)
            held.append(list(blocks))
        assert pool.num_free_blocks == len(ref.free)
    assert pool.ref_cnt.tolist() == ref.ref
    assert pool.free_blocks() == list(ref.free)


def test_block_pool_double_free_is_an_error():
    pool = BlockPool(40)
    small, large = pool.allocate(3), pool.allocate(20)
    pool.release(small)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.release(small[:1])
    pool.release(large)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.release(large)


def test_block_pool_revive_cycles_compact_the_ring():
    """The same cached prefix hit and freed again many times without an allocation (each cycle
    leaves dead FIFO entries): the ring compacts and the eviction order stays the reference's."""
    n = 50
    pool, ref = BlockPool(n), _ListPool(n)
    blocks = pool.allocate(n)
    ref.allocate(n)
    pool.release(blocks)
    ref.release(blocks)
    for i in range(40):  # 40 x 20 dead entries, past the ring's 100 slots several times
        part = blocks[i % 3 : i % 3 + 20]
        pool.touch(part)
        ref.touch(part)
        pool.release(part)
        ref.release(part)
        assert pool.free_blocks() == list(ref.free)
    assert pool.allocate(n) == ref.allocate(n)


def test_block_pool_lists_with_repeats_match_the_reference():
    """A list naming a block twice (not something the managers build, but the pool's contract
    allows it): counted twice, freed once, at the reference's place in the eviction order."""
    pool, ref = BlockPool(30), _ListPool(30)
    blocks = pool.allocate(12)
    assert blocks == ref.allocate(12)
    twice = blocks + blocks[:5]  # 17 entries: the array path
    pool.touch(twice)
    ref.touch(twice)
    assert pool.ref_cnt.tolist() == ref.ref  # 3 for the first five, 2 for the rest
    pool.release(blocks)
    ref.release(blocks)
    pool.release(twice)  # every block reaches zero, the first five at their second listing
    ref.release(twice)
    assert pool.ref_cnt.tolist() == ref.ref and pool.free_blocks() == list(ref.free)
    assert pool.allocate(30) == ref.allocate(30)


def test_cached_prefix_stops_at_the_first_miss():
    """A later block still cached after an evicted one is not a hit: the prefix is cut there."""
    pool = BlockPool(10)
    hs = [hash_block(None, [i]) for i in range(5)]
    blocks = pool.allocate(5)
    for b, h in zip(blocks, hs, strict=True):
        pool.cache_block(b, h)
    assert pool.cached_prefix(hs) == blocks
    missing = hash_block(None, [99])
    assert pool.cached_prefix([hs[0], missing, hs[2]]) == blocks[:1]
    assert pool.cached_prefix([missing, *hs]) == [] and pool.cached_prefix([]) == []
    assert BlockPool(4, enable_caching=False).cached_prefix(hs) == []
