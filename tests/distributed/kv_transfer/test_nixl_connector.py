"""NixlConnector over real NIXL (UCX, DRAM, loopback): a prefill engine's token-sharded KV pulled
into decode layouts of other DCP sizes, bit for bit, moving exactly the rows each decode rank
owns, through direct or staged reads alike; leases released on confirmation or expiry; loads failing fast and cleanly when the
producer is gone, unreachable or incompatible.

Each "rank" is its own NIXL agent with its own registered caches; the two-process tests run the
prefill engine in a spawned process and the decode engine in the test process."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from tests.distributed.kv_transfer.requirements import require_nixl  # noqa: E402

require_nixl()

from tests.distributed.kv_transfer.kv_helpers import (  # noqa: E402
    SMALL_BF16,
    SMALL_FP8,
    LogicalKV,
    empty_caches,
)
from tests.distributed.kv_transfer.nixl_harness import (  # noqa: E402
    NUM_BLOCKS,
    NUM_LAYERS,
    Consumer,
    Engine,
    FakeRequest,
    Producer,
    bytes_per_row,
    free_port_range,
)
from vllm.core.request import RequestStatus  # noqa: E402
from vllm.distributed.kv_transfer.reshard import KVShardLayout, plan_reads  # noqa: E402

TIMEOUT_S = 20.0


def _check_landed(c: Consumer, blocks, num_tokens: int, seed: int, hi: int, req_id: str):
    """Every consumer rank's caches equal the layout written directly; bytes = rows owned."""
    for d in range(c.shard.world_size):
        want = c.expected(num_tokens, seed, blocks, d, hi)
        for li, ((gm, gi), (wm, wi)) in enumerate(zip(c.caches[d], want, strict=True)):
            assert torch.equal(gm, wm), f"rank {d} layer {li}: MLA rows differ"
            if wi is not None:
                assert torch.equal(gi, wi), f"rank {d} layer {li}: indexer keys differ"
        owned = sum(1 for p in range(hi) if c.shard.owner(p) == c.shard.dcp_rank(d))
        assert c.workers[d].worker.recv_bytes[req_id] == owned * bytes_per_row(c.layout)


def _producer_main(shard, requests, port, lease_s, q_out, q_in):
    from vllm.utils import die_with_parent

    die_with_parent()
    p = Producer(
        KVShardLayout(*shard), requests, side_channel_port=port, kv_lease_timeout_s=lease_s
    )
    q_out.put(("params", p.params))
    try:
        p.wait("sending", [r[0] for r in requests], TIMEOUT_S)
        q_out.put(("sent", sorted(p.sending)))
    except TimeoutError as e:
        q_out.put(("error", str(e)))
    q_in.get(timeout=60)  # "stop" (or killed)
    p.shutdown()


class _Spawned:
    def __init__(self, *args):
        ctx = mp.get_context("spawn")
        self.q_out, self.q_in = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_producer_main, args=(*args, self.q_out, self.q_in))
        self.proc.start()

    def get(self, timeout=60):
        kind, *rest = self.q_out.get(timeout=timeout)
        assert kind != "error", rest
        return rest

    def stop(self):
        if self.proc.is_alive():
            self.q_in.put("stop")
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


# PCP2 × TP2 × DCP2 prefill (4 ranks, two copies of each shard) -> decode DCP1, DCP2, DCP4
REQUESTS = [("r-dcp1", 300, 11), ("r-dcp2", 129, 12), ("r-dcp4", 517, 13)]
DECODES = {"r-dcp1": (1, 1, 1), "r-dcp2": (2, 2, 1), "r-dcp4": (4, 4, 1)}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_process_pcp2_dcp2_to_dcp1_dcp2_dcp4():
    port = free_port_range(4)
    prod = _Spawned((4, 2, 1), REQUESTS, port, 60.0)
    consumers = []
    try:
        (params,) = prod.get()
        for req_id, n, seed in REQUESTS:
            c = Consumer(KVShardLayout(*DECODES[req_id]))
            consumers.append(c)
            blocks, hi = c.pull("decode-" + req_id, params[req_id], n)
            c.wait("recving", ["decode-" + req_id], TIMEOUT_S)
            assert not c.invalid
            _check_landed(c, blocks, n, seed, hi, "decode-" + req_id)
        (sent,) = prod.get()  # every decode rank confirmed: every lease released
        assert sent == sorted(r[0] for r in REQUESTS)
    finally:
        for c in consumers:
            c.shutdown()
        prod.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "src,dst",
    [
        ((2, 2, 1), (1, 1, 1)),
        ((2, 2, 4), (3, 3, 1)),
        ((4, 4, 1), (2, 2, 2)),
        ((2, 1, 1), (2, 2, 1)),
    ],
)
def test_in_process_reshard(src, dst):
    """Two engines in one process (separate agents): more layouts, interleave included."""
    p = Producer(KVShardLayout(*src), [("a", 333, 5)], side_channel_port=free_port_range(4))
    c = Consumer(KVShardLayout(*dst))
    try:
        blocks, hi = c.pull("x", p.params["a"], 333)
        c.wait("recving", ["x"], TIMEOUT_S)
        _check_landed(c, blocks, 333, 5, hi, "x")
        p.wait("sending", ["a"], TIMEOUT_S)
    finally:
        c.shutdown()
        p.shutdown()


def _consumer(shard, layout, force_staging, staging_max_bytes=None) -> Consumer:
    c = Consumer(shard, layout=layout)
    for w in c.workers:
        w.worker.force_staging = force_staging
        if staging_max_bytes is not None:
            w.worker.staging_max_bytes = staging_max_bytes
    return c


# DCP2 I1 -> DCP1 (single-row direct runs; TP2 × DCP2 or PCP2 × DCP2), DCP1 -> DCP2 I1 (single
# rows on both sides), PCP2 × TP2 × DCP2 I2 -> DCP1 (two copies of each shard)
STAGED_CASES = [((2, 2, 1), (1, 1, 1)), ((1, 1, 1), (2, 2, 1)), ((4, 2, 2), (1, 1, 1))]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", [SMALL_FP8, SMALL_BF16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("src,dst", STAGED_CASES)
def test_staged_reads_match_direct(src, dst, layout):
    """The same request (same rows, other blocks) pulled direct and staged: both land the layout
    written directly, bit for bit, and move only the owned rows; staged, every byte went
    through the staging buffer."""
    n = 333
    reqs = [("direct", n, 7), ("staged", n, 7)]
    p = Producer(KVShardLayout(*src), reqs, side_channel_port=free_port_range(4), layout=layout)
    direct = _consumer(KVShardLayout(*dst), layout, False)
    staged = _consumer(KVShardLayout(*dst), layout, True)
    try:
        landed = []
        for c, name in ((direct, "direct"), (staged, "staged")):
            blocks, hi = c.pull(name, p.params[name], n)
            c.wait("recving", [name], TIMEOUT_S)
            assert not c.invalid
            _check_landed(c, blocks, n, 7, hi, name)
            landed.append([c.caches[d] for d in range(c.shard.world_size)])
            w = [x.worker for x in c.workers]
            via = sum(x.recv_staged_bytes[name] for x in w)
            assert via == (sum(x.recv_bytes[name] for x in w) if c is staged else 0)
        for (dm, di), (sm, si) in zip(*(sum(x, []) for x in landed), strict=True):
            assert torch.equal(dm, sm) and (di is None or torch.equal(di, si))
        p.wait("sending", ["direct", "staged"], TIMEOUT_S)
    finally:
        direct.shutdown()
        staged.shutdown()
        p.shutdown()


@pytest.mark.timeout(60)
def test_staged_chunks_share_the_buffer():
    """A staging buffer of ~40 rows: two concurrent loads from DCP2 I1 go through it in many
    chunks (pages split across chunks, rows of both producer ranks in one chunk), one chunk at
    a time, and land bit for bit."""
    reqs = [("a", 517, 3), ("b", 300, 4)]
    p = Producer(KVShardLayout(2, 2, 1), reqs, side_channel_port=free_port_range(2))
    c = _consumer(KVShardLayout(1, 1, 1), SMALL_FP8, None, staging_max_bytes=40 * 1024)
    try:
        pulled = [(name, n, seed, *c.pull(name, p.params[name], n)) for name, n, seed in reqs]
        c.wait("recving", ["a", "b"], TIMEOUT_S)
        assert not c.invalid
        want = empty_caches(SMALL_FP8, NUM_LAYERS, NUM_BLOCKS)
        w = c.workers[0].worker
        for name, n, seed, blocks, hi in pulled:
            LogicalKV(SMALL_FP8, n, NUM_LAYERS, seed).write_into(want, c.shard, 0, blocks, 0, hi)
            assert w.recv_bytes[name] == hi * bytes_per_row(SMALL_FP8)
            assert w.recv_staged_bytes[name] == w.recv_bytes[name]
        for (gm, gi), (wm, wi) in zip(c.caches[0], want, strict=True):
            assert torch.equal(gm, wm) and (wi is None or torch.equal(gi, wi))
        assert c.workers[0].worker._staging.tensor.numel() <= 40 * 1024
    finally:
        c.shutdown()
        p.shutdown()


def test_staging_rule():
    """Staged only where the direct runs are short and staging at least halves them."""
    c = Consumer(KVShardLayout(1, 1, 1))
    try:
        w = c.workers[0].worker
        ids = [list(range(16))] * 4

        def staged(src, dst):
            reads = plan_reads(KVShardLayout(*src), ids, KVShardLayout(*dst), ids, 0, 0, 1000)
            return [w._stage(rr.runs) is not None for rr in reads]

        assert staged((2, 2, 1), (1, 1, 1)) == [True, True]  # 1-row runs -> 64-row source runs
        assert staged((4, 4, 8), (1, 1, 1)) == [True] * 4  # 8-row runs
        assert staged((2, 2, 64), (1, 1, 1)) == [False, False]  # 64-row runs: direct
        assert staged((1, 1, 1), (2, 2, 1)) == [False]  # strided source: staging gains nothing
        assert staged((1, 1, 1), (1, 1, 1)) == [False]
    finally:
        c.shutdown()


@pytest.mark.timeout(60)
def test_lease_expires_when_nobody_pulls():
    p = Producer(
        KVShardLayout(2, 2, 1),
        [("a", 100, 1)],
        side_channel_port=free_port_range(2),
        kv_lease_timeout_s=1.0,
    )
    try:
        took = p.wait("sending", ["a"], 10)
        assert 0.9 < took < 5
    finally:
        p.shutdown()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_producer_killed_consumer_fails_fast():
    """The prefill engine dies after a first transfer: the next load is reported failed within
    the load timeout, with its blocks listed as load errors; nothing stays in flight."""
    port = free_port_range(2)
    prod = _Spawned((2, 2, 1), [("a", 200, 1), ("b", 200, 2)], port, 60.0)
    c = Consumer(KVShardLayout(1, 1, 1), kv_load_timeout_s=3.0)
    try:
        (params,) = prod.get()
        c.pull("xa", params["a"], 200)
        c.wait("recving", ["xa"], TIMEOUT_S)
        assert not c.invalid
        os.kill(prod.proc.pid, signal.SIGKILL)
        prod.proc.join(10)
        blocks, _ = c.pull("xb", params["b"], 200)
        took = c.wait("recving", ["xb"], TIMEOUT_S)
        assert took < 6
        assert c.invalid == set(blocks)
        assert "xb" in c.workers[0].worker.failures
        assert not c.workers[0].worker._loads
    finally:
        c.shutdown()
        prod.stop()


@pytest.mark.timeout(60)
def test_unreachable_producer_fails_fast():
    p = Producer(KVShardLayout(1, 1, 1), [("a", 100, 1)], side_channel_port=free_port_range(1))
    params = dict(p.params["a"], remote_port=free_port_range(1))  # nobody listens there
    p.shutdown()
    c = Consumer(KVShardLayout(1, 1, 1), kv_load_timeout_s=2.0)
    try:
        blocks, _ = c.pull("x", params, 100)
        assert c.wait("recving", ["x"], TIMEOUT_S) < 1  # refused at once, no handshake timeout
        assert c.invalid == set(blocks)
        assert "Connection refused" in c.workers[0].worker.failures["x"]
    finally:
        c.shutdown()


@pytest.mark.timeout(60)
def test_incompatible_caches_refused():
    p = Producer(KVShardLayout(1, 1, 1), [("a", 100, 1)], side_channel_port=free_port_range(1))
    c = Consumer(KVShardLayout(1, 1, 1), model="another-model")
    try:
        c.pull("x", p.params["a"], 100)
        c.wait("recving", ["x"], TIMEOUT_S)
        why = c.workers[0].worker.failures["x"]
        assert "incompatible KV caches" in why and "another-model" in why
        assert c.invalid
        # the failed consumer still confirmed: the producer does not wait for its lease
        p.wait("sending", ["a"], TIMEOUT_S)
    finally:
        c.shutdown()
        p.shutdown()


def test_scheduler_half_decisions():
    """What request_finished and get_num_new_matched_tokens decide, without a transfer."""
    e = Engine(KVShardLayout(2, 2, 1), "kv_both", side_channel_port=free_port_range(2))
    try:
        s = e.sched
        plain = FakeRequest("p", list(range(10)), 10)
        assert s.request_finished(plain, [1]) == (False, None)
        aborted = FakeRequest("q", list(range(10)), 10, RequestStatus.FINISHED_ABORTED, {})
        aborted.kv_transfer_params = {"do_remote_decode": True}
        assert s.request_finished(aborted, [1]) == (False, None)
        ok = FakeRequest("r", list(range(200)), 200, kv_transfer_params={"do_remote_decode": True})
        delay, params = s.request_finished(ok, [3, 4])
        assert delay and params["remote_block_ids"] == [[3, 4], [3, 4]]
        assert params["remote_num_tokens"] == 200 and params["remote_dcp_size"] == 2
        # a decode request: the last prompt token is always computed locally
        d = FakeRequest("d", list(range(200)), kv_transfer_params=params)
        assert s.get_num_new_matched_tokens(d, 0) == (199, True)
        assert s.get_num_new_matched_tokens(d, 128) == (71, True)
        s.update_state_after_alloc(d, [0, 1], 199)
        assert s.get_num_new_matched_tokens(d, 0) == (0, False)  # claimed once
        assert s.request_finished(d, [0, 1]) == (True, None)  # aborted while loading
        meta = s.build_connector_meta(None)
        assert [r.req_id for r in meta.reqs_to_recv] == ["d"] and "r" in meta.reqs_to_send
        bad = FakeRequest("b", list(range(50)), kv_transfer_params={"do_remote_prefill": True})
        with pytest.raises(ValueError, match="misses"):
            s.update_state_after_alloc(bad, [0], 49)
    finally:
        e.shutdown()


def test_lease_counts_survive_early_notifications():
    """A consumer can confirm before the producer's workers have seen the lease."""
    p = Producer(KVShardLayout(1, 1, 1), [], side_channel_port=free_port_range(1))
    try:
        w = p.workers[0].worker
        w._notified["early"] = [1, 1, time.monotonic()]
        w._leases["early"] = time.monotonic() + 100
        p.wait("sending", ["early"], 5)
    finally:
        p.shutdown()
