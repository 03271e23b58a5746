"""CPU KV offload (`--kv-offloading-size`): the flags, the host tier's index (LRU within its
budget, loads pinned against eviction), the worker's copies, and the engine: a prompt evicted
from the device cache and reloaded from the host tier gives the same greedy tokens and logprobs
as recomputing it, alone and under PCP2 × DCP2, with its hits reported."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.core.block_pool import hash_block
from vllm.core.messages import NewRequestData, SamplingOptions, SchedulerOutput
from vllm.distributed.kv_transfer.base import (
    KVConnectorContext,
    KVConnectorOutput,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.offload_store import HostKVStore, coalesce
from vllm.distributed.kv_transfer.offloading_connector import OffloadingConnector, OffloadMetadata
from vllm.distributed.kv_transfer.reshard import KVShardLayout
from vllm.engine.arg_utils import EngineArgs


# ---- flags ----------------------------------------------------------------------------------
def test_flags(tiny_ckpt):
    cfg = EngineArgs(model=tiny_ckpt, kv_offloading_size=0.01).create_engine_config()
    assert cfg.uses_kv_connector and cfg.offload_num_blocks > 0
    # the size is the replica's total: two ranks hold half each
    cfg2 = EngineArgs(
        model=tiny_ckpt, kv_offloading_size=0.01, prefill_context_parallel_size=2
    ).create_engine_config()
    assert cfg2.offload_num_blocks == cfg.offload_num_blocks // 2
    assert not EngineArgs(model=tiny_ckpt).create_engine_config().uses_kv_connector


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(kv_offloading_size=1e-6), "holds no KV block"),
        (dict(kv_offloading_size=-1), "--kv-offloading-size"),
        (dict(kv_offloading_size=1, enable_prefix_caching=False), "prefix caching"),
        (dict(kv_offloading_size=1, kv_offloading_backend="lmcache"), "--kv-offloading-backend"),
        (dict(kv_offloading_size=2**20), "GiB of host memory; this host has"),  # refused, not OOM
    ],
)
def test_bad_flags_are_named(tiny_ckpt, kw, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=tiny_ckpt, **kw).create_engine_config()


# ---- the scheduler half's index -------------------------------------------------------------
BS = 64


def _connector(num_slots: int, role=KVConnectorRole.SCHEDULER) -> OffloadingConnector:
    """The offload tier alone (its halves read only the block size and the slot count)."""
    ctx = KVConnectorContext(
        config=None, layout=None, shard=KVShardLayout(block_size=BS), offload_num_blocks=num_slots
    )
    return OffloadingConnector(ctx, role)


def _req(rid: str, tokens: list[int], computed: int):
    hashes, parent = [], None
    for i in range(len(tokens) // BS):
        parent = hash_block(parent, tokens[i * BS : (i + 1) * BS])
        hashes.append(parent)
    return types.SimpleNamespace(
        request_id=rid,
        block_hashes=hashes,
        num_tokens=len(tokens),
        num_computed_tokens=computed,
        use_prefix_cache=True,
    )


def _so(step_reqs: dict[str, int], new: dict[str, list[int]] | None = None) -> SchedulerOutput:
    new_reqs = [
        NewRequestData(rid, [], 0, blocks, 0, SamplingOptions())
        for rid, blocks in (new or {}).items()
    ]
    return SchedulerOutput(step=0, new_reqs=new_reqs, num_scheduled_tokens=step_reqs)


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


def test_index_stays_within_budget_and_evicts_least_recently_used():
    c = _connector(num_slots=4)
    a, b = _req("a", _tokens(0, 3 * BS + 5), 3 * BS + 5), _req("b", _tokens(1, 3 * BS), 3 * BS)
    c.update_state_after_alloc(a, [10, 11, 12, 13], 0)
    meta = c.build_connector_meta(_so({"a": 1}))  # a's 3 full blocks were final before the step
    assert meta.stores == [(10, 0), (11, 1), (12, 2)] and len(c.index) == 3
    c.build_connector_meta(_so({"a": 1}))  # offered once only
    assert not c._stores
    # a comes back: its first block is refreshed (most recently used), the others are not
    a2 = _req("a2", _tokens(0, 3 * BS + 5), 0)
    assert c.get_num_new_matched_tokens(a2, 0) == (3 * BS, True)
    c.index.move_to_end(a.block_hashes[0])
    c.update_state_after_alloc(b, [20, 21, 22], 0)
    c.request_finished(
        types.SimpleNamespace(**{**vars(b), "num_computed_tokens": 3 * BS}), [20, 21, 22]
    )
    meta = c.build_connector_meta(_so({}))
    assert len(c.index) == 4 <= c.num_slots
    # b's 3 blocks took the free slot and the two least recently used of a's
    assert [s for _, s in meta.stores] == [3, 1, 2]
    assert a.block_hashes[0] in c.index and a.block_hashes[1] not in c.index
    assert c.get_num_new_matched_tokens(a2, 0) == (BS, True)  # only the first block is left
    stats = c.take_scheduler_stats()
    assert stats["kv_offload_evicted_blocks"] == 2 and stats["kv_offload_stored_blocks"] == 6


def test_speculative_tokens_are_never_stored():
    """Only blocks final before the step are offered: a block filled by this step's verified
    drafts may be rolled back."""
    c = _connector(num_slots=8)
    r = _req("r", _tokens(2, 2 * BS), 2 * BS)
    c.update_state_after_alloc(r, [0, 1], 0)
    r.num_computed_tokens = 2 * BS  # after scheduling 4 tokens: 1 + 3 drafts crossing a block
    assert c.build_connector_meta(_so({"r": 4})).stores == [(0, 0)]


def test_a_load_pins_its_slots_against_eviction():
    """A reload racing with new stores: the slots being read are never reused until the load
    is reported finished; the stores that found no slot are offered again after."""
    c = _connector(num_slots=2)
    a = _req("a", _tokens(3, 2 * BS + 1), 2 * BS + 1)
    c.update_state_after_alloc(a, [0, 1, 2], 0)
    c.build_connector_meta(_so({"a": 1}))
    a2 = _req("a2", _tokens(3, 2 * BS + 1), 0)
    n, is_async = c.get_num_new_matched_tokens(a2, 0)
    assert (n, is_async) == (2 * BS, True)
    c.update_state_after_alloc(a2, [5, 6, 7], n)
    b = _req("b", _tokens(4, 2 * BS + 1), 2 * BS + 1)
    c.update_state_after_alloc(b, [8, 9, 10], 0)
    meta = c.build_connector_meta(_so({"b": 1}))
    assert meta.loads == {"a2": [(5, 0), (6, 1)]} and meta.stores == []
    assert set(c.index) == set(a.block_hashes)
    c.update_connector_output(KVConnectorOutput(finished_recving=["a2"]))
    meta = c.build_connector_meta(_so({"b": 1}))
    assert sorted(s for _, s in meta.stores) == [0, 1] and set(c.index) == set(b.block_hashes)


def test_abort_while_loading_keeps_the_blocks_until_the_load_ended():
    c = _connector(num_slots=4)
    a = _req("a", _tokens(5, BS + 1), BS + 1)
    c.update_state_after_alloc(a, [0, 1], 0)
    c.build_connector_meta(_so({"a": 1}))
    for issued in (False, True):
        r = _req(f"r{issued}", _tokens(5, BS + 1), 0)
        n, _ = c.get_num_new_matched_tokens(r, 0)
        c.update_state_after_alloc(r, [2, 3], n)
        if issued:
            assert c.build_connector_meta(_so({})).loads
        delay, _ = c.request_finished(r, [2, 3])
        assert delay == issued  # an issued load still writes the blocks
        assert bool(c.pins) == issued
    c.update_connector_output(KVConnectorOutput(finished_recving=["rTrue"]))
    assert not c.pins and not c.loading


# ---- the worker half's copies ---------------------------------------------------------------
def test_coalesce():
    assert coalesce([(4, 0), (5, 1), (6, 2), (9, 3), (10, 4), (2, 7)]) == [
        (4, 0, 3),
        (9, 3, 2),
        (2, 7, 1),
    ]


def test_worker_copies_round_trip_and_stores_before_loads():
    g = torch.Generator().manual_seed(0)
    caches = [
        (torch.randn(8, BS, 6, generator=g), torch.randn(8, BS, 4, generator=g)),
        (torch.randn(8, BS, 6, generator=g), None),
    ]
    w = _connector(num_slots=3, role=KVConnectorRole.WORKER)
    w.register_kv_caches(caches)
    assert isinstance(w.store, HostKVStore) and w.store.bytes_per_block == BS * (6 + 4 + 6) * 4
    orig = [tuple(None if t is None else t.clone() for t in layer) for layer in caches]
    so = _so({})
    w.bind_connector_metadata(OffloadMetadata(stores=[(3, 0), (4, 1), (7, 2)]))
    w.start_load_kv(so)
    # the same step stores block 5 into a free slot and loads it back into block 0 (a block
    # offered at a request's end whose device copy was evicted before the next step ran)
    w.bind_connector_metadata(
        OffloadMetadata(loads={"r": [(0, 1), (1, 2)], "q": [(6, 0)]}, stores=[(5, 1)])
    )
    w.start_load_kv(so)
    assert w.get_finished([]) == (set(), {"r", "q"})
    for layer, ref in zip(caches, orig, strict=True):
        for t, o in zip(layer, ref, strict=True):
            if t is not None:
                assert torch.equal(t[0], o[5]) and torch.equal(t[1], o[7])
                assert torch.equal(t[6], o[3])
    _, stats = w.take_failures_and_stats()
    assert stats["kv_offload_num_loads"] == 2 and stats["kv_offload_load_bytes"] > 0


# ---- the engine -----------------------------------------------------------------------------
PROMPTS = [list(range(10 + 7 * i, 10 + 7 * i + 300)) for i in range(4)]
ORDER = [0, 1, 2, 3, 0, 2]  # 0 and 2 come back after being pushed out of the device cache
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=3)


def _turns(m: LLM):
    """Each prompt alone (one turn after another): tokens, logprobs, cached tokens."""
    out = []
    for i in ORDER:
        o = m.generate([{"prompt_token_ids": PROMPTS[i]}], PARAMS)[0]
        lps = [{t: d[t].logprob for t in d} for d in o.outputs[0].logprobs]
        out.append((o.outputs[0].token_ids, lps, o.num_cached_tokens))
    return out


def _kv(stats, key):
    return sum(s.kv_transfer.get(key, 0) for s in stats)


CONFIGS = {
    "1rank": dict(num_gpu_blocks_override=10),
    # the MTP layer's KV rides in the same blocks; verified drafts' KV is never stored
    "1rank-mtp2": dict(
        num_gpu_blocks_override=10,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
    ),
    # each step scheduled, stores and loads chosen, before the previous step's results
    "1rank-async": dict(num_gpu_blocks_override=10, async_scheduling=True),
    # a scheduler block is 128 tokens here: 5 virtual blocks hold about 2 prompts
    "pcp2-dcp2": dict(
        num_gpu_blocks_override=5, prefill_context_parallel_size=2, decode_context_parallel_size=2
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_reloaded_prefix_gives_the_recomputed_output(tiny_ckpt, name):
    kw = dict(CONFIGS[name], max_num_batched_tokens=128)
    ref = LLM(tiny_ckpt, **kw)
    try:
        want = _turns(ref)
    finally:
        ref.shutdown()
    m = LLM(tiny_ckpt, kv_offloading_size=0.02, **kw)
    try:
        got = _turns(m)
        stats = m.stats_history
    finally:
        m.shutdown()
    block = 64 * (2 if "dcp2" in name else 1)
    for (gt, glp, gc), (wt, wlp, wc) in zip(got, want, strict=True):
        assert gt == wt
        for g, w in zip(glp, wlp, strict=True):
            assert g.keys() == w.keys()
            np.testing.assert_allclose([g[t] for t in w], list(w.values()), atol=1e-4)
        assert gc >= wc  # the tier only adds hits
    # the returning prompts hit every full block but the one holding their last token
    full = (300 - 1) // block * block
    assert [c for *_, c in got[4:]] == [full, full]
    assert [c for *_, c in want[4:]] != [full, full]  # without the tier they partly recompute
    hits = _kv(stats, "external_prefix_cache_hits")
    assert hits > 0 and hits == sum(g[2] - w[2] for g, w in zip(got, want, strict=True))
    assert _kv(stats, "external_prefix_cache_queries") >= 300 * len(ORDER)
    assert _kv(stats, "kv_offload_num_loads") > 0 and _kv(stats, "kv_offload_stored_blocks") > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_concurrent_requests_with_a_tier_smaller_than_the_working_set(tiny_ckpt, async_scheduling):
    """Loads, stores and evictions in the same steps (the tier holds 6 blocks, the prompts 16):
    every output still equals the reference's; also with --async-scheduling, where a step is
    scheduled (its stores and loads chosen) before the previous one's results are applied."""
    kw = dict(num_gpu_blocks_override=12, max_num_batched_tokens=128, max_num_seqs=4)
    prompts = [{"prompt_token_ids": PROMPTS[i]} for i in (0, 1, 2, 3, 0, 1, 3, 2)]
    ref = LLM(tiny_ckpt, **kw)
    try:
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, PARAMS)]
    finally:
        ref.shutdown()
    cfg = EngineArgs(model=tiny_ckpt, kv_offloading_size=1).create_engine_config()
    per_block = 2**30 / cfg.offload_num_blocks
    m = LLM(
        tiny_ckpt,
        kv_offloading_size=6.5 * per_block / 2**30,
        async_scheduling=async_scheduling,
        **kw,
    )
    try:
        assert m.config.offload_num_blocks == 6
        got = [o.outputs[0].token_ids for o in m.generate(prompts, PARAMS)]
        got2 = [o.outputs[0].token_ids for o in m.generate(prompts, PARAMS)]
        stats = m.stats_history
    finally:
        m.shutdown()
    assert got == want and got2 == want
    assert _kv(stats, "kv_offload_evicted_blocks") > 0
    assert _kv(stats, "external_prefix_cache_hits") > 0


def test_served_cached_tokens_and_counters(tiny_ckpt):
    """Through the OpenAI server: a returning prompt's usage counts its host-tier hit in
    prompt_tokens_details.cached_tokens, and /metrics carries upstream's external counters."""
    import openai
    import requests

    from tests.utils import RemoteServer

    argv = [tiny_ckpt, "--num-gpu-blocks-override", "10", "--kv-offloading-size", "0.02"]
    with RemoteServer([*argv, "--enable-prompt-tokens-details"]) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        cached = []
        for i in ORDER[:5]:
            r = client.completions.create(
                model=client.models.list().data[0].id, prompt=PROMPTS[i], max_tokens=2
            )
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
        text = requests.get(s.url + "/metrics").text
    assert cached[:4] == [0, 0, 0, 0] and cached[4] == (300 - 1) // 64 * 64

    def metric(name):
        return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name + "{"))

    hits = metric("vllm:external_prefix_cache_hits_total")
    assert 0 < hits <= cached[4] and metric("vllm:external_prefix_cache_queries_total") >= 1500
    assert metric("vllm:kv_offload_num_loads_total") == 1


def test_hisparse_pool_is_the_tier(tiny_ckpt):
    """Under HiSparse the offload size grows its pinned host pool (every completed page is
    already backed up there and kept as the prefix cache): no second tier, one budget. A prompt
    pushed out of a small pool recomputes; with the tier's share added it hits."""
    hs = {"hisparse_config": {"host_pool_gib": 0.0019}}  # 12 pages of 64 tokens
    cfg = EngineArgs(
        model=tiny_ckpt, attention_config=hs, kv_offloading_size=0.02
    ).create_engine_config()
    assert cfg.offload_num_blocks == 0 and not cfg.uses_kv_connector
    assert cfg.hisparse_host_pool_gib == pytest.approx(0.0219)
    kw = dict(attention_config=hs, num_gpu_blocks_override=14, max_num_batched_tokens=128)
    got = {}
    for name, extra in (("pool", {}), ("pool+tier", {"kv_offloading_size": 0.02})):
        m = LLM(tiny_ckpt, **kw, **extra)
        try:
            got[name] = _turns(m)
        finally:
            m.shutdown()
    for a, b in zip(got["pool"], got["pool+tier"], strict=True):
        assert a[0] == b[0]
    full = (300 - 1) // 64 * 64
    assert [c for *_, c in got["pool+tier"][4:]] == [full, full]
    assert [c for *_, c in got["pool"][4:]] != [full, full]
