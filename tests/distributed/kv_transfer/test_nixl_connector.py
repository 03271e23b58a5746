"""NixlConnector over real NIXL (UCX, DRAM, loopback): a prefill engine's token-sharded KV pulled
into decode layouts of other DCP sizes, bit for bit, moving exactly the rows each decode rank
owns; leases released on confirmation or expiry; loads failing fast and cleanly when the
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

from tests.distributed.kv_transfer.nixl_harness import (  # noqa: E402
    BYTES_PER_ROW,
    Consumer,
    Engine,
    FakeRequest,
    Producer,
    free_port_range,
)
from vllm.core.request import RequestStatus  # noqa: E402
from vllm.distributed.kv_transfer.reshard import KVShardLayout  # noqa: E402

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
        assert c.workers[d].worker.recv_bytes[req_id] == owned * BYTES_PER_ROW


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
