"""The scheduler's side of P/D disaggregation (``core/kv_connector_state.py``) with the real
NixlConnector scheduler half, driven without workers: what the workers would report each step
(``KVConnectorOutput``) is fed back by hand. The transfers themselves are tested over real NIXL
in tests/distributed/kv_transfer."""

from __future__ import annotations

import pytest

from vllm.core.messages import EngineCoreRequest, KVCachePlan, ModelRunnerOutput, SamplingOptions
from vllm.core.request import RequestStatus
from vllm.core.scheduler import Scheduler
from vllm.distributed.kv_transfer import KVConnectorOutput
from vllm.engine.arg_utils import EngineArgs

N = 150  # prompt tokens: 3 blocks of 64


def _scheduler(tiny_ckpt, role: str, policy: str = "recompute") -> Scheduler:
    kvt = {"kv_connector": "NixlConnector", "kv_role": role, "kv_load_failure_policy": policy}
    cfg = EngineArgs(
        model=tiny_ckpt, max_num_batched_tokens=256, max_num_seqs=4, kv_transfer_config=kvt
    ).create_engine_config()
    return Scheduler(cfg, KVCachePlan(100))


def _params(n: int = N) -> dict:
    return {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p",
        "remote_request_id": "x", "remote_host": "127.0.0.1", "remote_port": 5600,
        "remote_block_ids": [[7, 8, 9]], "remote_num_tokens": n, "remote_world_size": 1,
        "remote_dcp_size": 1, "remote_interleave": 1, "remote_block_size": 64,
    }  # fmt: skip


def _req(rid: str, n: int, kv=None, max_tokens: int = 4) -> EngineCoreRequest:
    opts = SamplingOptions(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(rid, list(range(10, 10 + n)), opts, [0], kv_transfer_params=kv)


def _step(s: Scheduler, kv: KVConnectorOutput | None = None):
    """One step whose rows that finish their prompt sample token 7."""
    so = s.schedule()
    ro = ModelRunnerOutput(kv_connector_output=kv)
    for rid in so.num_scheduled_tokens:
        r = s.requests[rid]
        if r.num_computed_tokens >= r.num_tokens:
            ro.req_ids.append(rid)
            ro.sampled_token_ids.append([7])
    return so, s.update_from_output(so, ro)


def _drain(s: Scheduler) -> dict:
    outs: dict = {}
    for _ in range(100):
        if not s.has_work():
            return outs
        for o in _step(s)[1]:
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("scheduler did not finish")


def test_loading_request_waits_without_blocking_others(tiny_ckpt):
    s = _scheduler(tiny_ckpt, "kv_consumer")
    s.add_request(_req("r", N, _params()))
    s.add_request(_req("plain", 10))
    so, _ = _step(s)
    assert "r" not in so.num_scheduled_tokens and "plain" in so.num_scheduled_tokens
    (recv,) = so.kv_connector_metadata.reqs_to_recv
    assert (recv.req_id, recv.lo, recv.hi) == ("r", 0, N - 1)  # the last token is computed
    assert (
        len(recv.local_block_ids) == 3 and s.requests["r"].status.name == "WAITING_FOR_REMOTE_KVS"
    )
    assert s.stats().num_waiting == 1  # a loading request counts as waiting
    _step(s)  # still loading: nothing of it scheduled
    so, _ = _step(s, KVConnectorOutput(finished_recving=["r"], stats={"kv_transfer_num_loads": 1}))
    so, _ = _step(s)
    assert so.num_scheduled_tokens["r"] == 1  # only the last prompt token
    assert so.new_reqs[-1].num_computed_tokens == N - 1
    _drain(s)
    assert s.kv.usage() == 0 and s.stats().kv_transfer == {"kv_transfer_num_loads": 1}


def test_recompute_from_first_invalid_block(tiny_ckpt):
    s = _scheduler(tiny_ckpt, "kv_consumer")
    s.add_request(_req("r", N, _params()))
    so, _ = _step(s)
    blocks = so.kv_connector_metadata.reqs_to_recv[0].local_block_ids
    _step(s, KVConnectorOutput(finished_recving=["r"], invalid_block_ids=[blocks[1]]))
    so, _ = _step(s)
    assert so.num_scheduled_tokens["r"] == N - 64  # block 0 arrived, the rest is recomputed
    _drain(s)
    assert s.kv.usage() == 0


def test_fail_policy_errors_with_the_reason(tiny_ckpt):
    s = _scheduler(tiny_ckpt, "kv_consumer", "fail")
    s.add_request(_req("r", N, _params()))
    so, _ = _step(s)
    blocks = so.kv_connector_metadata.reqs_to_recv[0].local_block_ids
    why = {"r": "RuntimeError: NIXL transfer failed"}
    _, outs = _step(
        s, KVConnectorOutput(finished_recving=["r"], invalid_block_ids=blocks, failures=why)
    )
    (o,) = outs
    assert o.finish_reason == "error" and "NIXL transfer failed" in o.error
    assert s.kv.usage() == 0 and not s.has_work()


def test_abort_while_loading_frees_after_the_load(tiny_ckpt):
    s = _scheduler(tiny_ckpt, "kv_consumer")
    s.add_request(_req("r", N, _params()))
    _step(s)
    s.abort(["r"])
    assert s.kv.usage() > 0 and s.has_work()  # the workers may still be writing its blocks
    _step(s, KVConnectorOutput(finished_recving=["r"]))
    assert s.kv.usage() == 0 and not s.has_work()


def test_producer_leases_blocks_and_returns_params(tiny_ckpt):
    s = _scheduler(tiny_ckpt, "kv_producer")
    s.add_request(_req("p", N, {"do_remote_decode": True}, max_tokens=1))
    so, outs = _step(s)
    (o,) = outs
    kv = o.kv_transfer_params
    assert o.finish_reason == "length" and kv["do_remote_prefill"]
    assert kv["remote_request_id"] == "p" and kv["remote_num_tokens"] == N
    assert kv["remote_block_ids"] == [so.new_reqs[0].block_ids]
    assert s.kv.usage() > 0 and s.has_work()  # leased
    so, _ = _step(s)
    assert "p" in so.kv_connector_metadata.reqs_to_send
    _step(s, KVConnectorOutput(finished_sending=["p"]))
    assert s.kv.usage() == 0 and not s.has_work()


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_plain_requests_unchanged(tiny_ckpt, role):
    s = _scheduler(tiny_ckpt, role)
    s.add_request(_req("a", 100))
    outs = _drain(s)
    assert [t for o in outs["a"] for t in o.new_token_ids] == [7] * 4
    assert all(o.kv_transfer_params is None for o in outs["a"])
    assert s.kv.usage() == 0 and RequestStatus.FINISHED_LENGTH.finish_reason == "length"


# ---- a HiSparse decode engine: received KV lands in the host pool ----------------------------------
def _hisparse_scheduler(tiny_ckpt) -> Scheduler:
    kvt = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    cfg = EngineArgs(
        model=tiny_ckpt,
        max_num_batched_tokens=128,
        max_num_seqs=4,
        kv_transfer_config=kvt,
        attention_config={"hisparse_config": {"host_pool_gib": 0.01}},
    ).create_engine_config()
    return Scheduler(cfg, KVCachePlan(6, num_host_blocks=40, num_idx_blocks=40))


def test_hisparse_receives_into_host_pages_and_uploads_the_partial_page(tiny_ckpt):
    s = _hisparse_scheduler(tiny_ckpt)
    hot = s.kv.hot_blocks
    s.add_request(_req("r", N, _params()))
    so, _ = _step(s)
    (recv,) = so.kv_connector_metadata.reqs_to_recv
    pages = s.kv.pages["r"]
    # the connector writes host pages; the device holds only the partial last page + the hot buffer
    assert recv.local_block_ids == pages.host and len(pages.host) == 3
    assert pages.gpu[:2] == [-1, -1] and pages.gpu[2] >= 0 and len(pages.hot) == hot
    assert s.kv.pool.num_blocks - s.kv.pool.num_free_blocks == 1 + hot
    _step(s, KVConnectorOutput(finished_recving=["r"]))
    so, _ = _step(s)
    assert so.num_scheduled_tokens["r"] == 1
    (new,) = so.new_reqs
    upd = new.kv_update
    assert new.block_ids == pages.gpu and upd.host == pages.host
    assert upd.restore == [0, 1, 2] and upd.upload == [2] and upd.hot == pages.hot
    _drain(s)
    assert s.kv.usage() == 0
    # the received complete pages are now the host pool's prefix cache
    s.add_request(_req("again", N))
    so, _ = _step(s)
    assert so.new_reqs[0].num_computed_tokens == 128
    _drain(s)
    assert s.kv.usage() == 0


def test_hisparse_failed_load_recomputes_from_scratch(tiny_ckpt):
    s = _hisparse_scheduler(tiny_ckpt)
    s.add_request(_req("r", N, _params()))
    so, _ = _step(s)
    blocks = so.kv_connector_metadata.reqs_to_recv[0].local_block_ids
    _step(s, KVConnectorOutput(finished_recving=["r"], invalid_block_ids=[blocks[1]]))
    so, _ = _step(s)
    # its pages were host-only: no resuming mid-prompt, the whole prompt is recomputed (chunked)
    assert so.new_reqs[0].num_computed_tokens == 0 and so.num_scheduled_tokens["r"] == 128
    _drain(s)
    assert s.kv.usage() == 0 and s.kv.host.usage() == 0


def test_hisparse_refuses_to_send(tiny_ckpt):
    for role in ("kv_producer", "kv_both"):
        with pytest.raises(NotImplementedError, match="kv_consumer"):
            EngineArgs(
                model=tiny_ckpt,
                kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": role},
                attention_config={"hisparse_config": {"host_pool_gib": 0.01}},
            ).create_engine_config()
