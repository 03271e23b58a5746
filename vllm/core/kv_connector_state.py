"""The scheduler's side of KV transfer between engines (P/D disaggregation, SPEC §7): when the
KV connector's scheduler half is called and what the scheduler does with its answers, in the
order of ``vllm/distributed/kv_transfer/base.py``. The scheduler calls this object unconditionally;
without --kv-transfer-config every hook answers "nothing to do".

Beyond ``waiting`` and ``running``, a request may be

  loading:  admitted with its prompt's KV on the way from a remote engine. It holds its blocks
            (status ``WAITING_FOR_REMOTE_KVS``), takes no seat and no token budget, and goes back
            to the front of ``waiting`` once every worker has reported the load ended; its
            loaded tokens then count as computed, except from the first block whose load failed
            (``kv_load_failure_policy`` "recompute"), or the request fails ("fail").
  leased:   finished, its blocks kept for a remote engine (the producer's lease, or a load
            still landing in them) until every worker reports it in ``finished_sending`` /
            ``finished_recving``.
"""

from __future__ import annotations

from collections import deque

from vllm.config import VllmConfig
from vllm.core.kv_cache_manager import KVCacheManager
from vllm.core.messages import EngineCoreOutput, SchedulerOutput
from vllm.core.request import Request, RequestStatus
from vllm.distributed.kv_transfer.base import KVConnectorContext, KVConnectorOutput, KVConnectorRole
from vllm.distributed.kv_transfer.factory import create_connector

PARKED = "parked"  # lookup(): the request waits for its remote KV (taken off ``waiting``)


class KVConnectorScheduler:
    def __init__(self, config: VllmConfig, kv: KVCacheManager, waiting: deque[Request]):
        cfg = config.kv_transfer_config
        self.enabled = config.uses_kv_connector
        self.fail_on_load_error = cfg is not None and cfg.kv_load_failure_policy == "fail"
        ctx = KVConnectorContext.for_engine(config)
        self.connector = create_connector(ctx, KVConnectorRole.SCHEDULER)
        self.kv, self.waiting = kv, waiting
        self.block_size = config.scheduler_block_size
        self.loading: dict[str, tuple[Request, int]] = {}  # id -> (request, tokens once loaded)
        self.resumed: set[str] = set()  # loaded, back in ``waiting`` with its blocks
        self.leased: dict[str, Request] = {}
        self._params: dict[str, dict] = {}  # kv_transfer_params for the final output
        self._pending: dict[str, dict[str, int]] = {}  # aggregate_outputs' counts across steps
        self._stats: dict[str, float] = {}

    def has_pending(self) -> bool:
        """Transfers the engine must keep stepping for (loads to poll, leases to release)."""
        return bool(self.loading or self.leased)

    # ---- admission ----------------------------------------------------------------------------
    def lookup(self, req: Request):
        """The computed prefix of a waiting request about to be admitted: (hit blocks, tokens)
        from the local prefix cache, or :data:`PARKED` when the connector loads more of its KV
        asynchronously (its blocks are allocated here), or None when the pool cannot hold those
        blocks yet (nothing changed)."""
        if req.request_id in self.resumed:  # its KV landed: its blocks are already held
            return [], req.num_computed_tokens
        hit_blocks, num_hit = self.kv.get_computed_blocks(req)
        if not self.enabled:
            return hit_blocks, num_hit
        n, is_async = self.connector.get_num_new_matched_tokens(req, num_hit)
        if not (is_async and n > 0):
            return hit_blocks, num_hit
        if self.kv.allocate_for_load(req, n, hit_blocks) is None:
            return None
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens < 0:  # first admission
            req.num_cached_tokens = num_hit
            self.kv.record_prefix_lookup(req, num_hit)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.connector.update_state_after_alloc(req, self.kv.transfer_block_ids(req), n)
        self.loading[req.request_id] = (req, num_hit + n)
        return PARKED

    def allocated(self, req: Request) -> None:
        """A request was admitted with its blocks (no asynchronous load)."""
        if self.enabled and req.request_id not in self.resumed:
            # e.g. a local prefix hit covered the remote KV: the producer is told to free it
            self.connector.update_state_after_alloc(req, self.kv.transfer_block_ids(req), 0)
        self.resumed.discard(req.request_id)

    def build_meta(self, so: SchedulerOutput) -> None:
        if self.enabled:
            so.kv_connector_metadata = self.connector.build_connector_meta(so)

    # ---- worker reports -----------------------------------------------------------------------
    def update(self, out: KVConnectorOutput | None) -> list[tuple[Request, str]]:
        """Apply a step's aggregated worker report: free released leases, send landed requests
        back to the front of ``waiting``. Returns the requests whose load failed under the
        "fail" policy, with the reason (the scheduler finishes them with an error)."""
        if out is None or not self.enabled:
            return []
        self.connector.update_connector_output(out)
        for k, v in out.stats.items():
            self._stats[k] = self._stats.get(k, 0) + v
        for rid in [*out.finished_sending, *out.finished_recving]:
            req = self.leased.pop(rid, None)
            if req is not None:
                self.kv.free(req)
        invalid, ready, failed = set(out.invalid_block_ids), [], []
        for rid in out.finished_recving:
            req, loaded = self.loading.pop(rid, (None, 0))
            if req is None:
                continue
            blocks = self.kv.transfer_block_ids(req)
            bad = next((i for i, b in enumerate(blocks) if b in invalid), None)
            if bad is not None and self.fail_on_load_error:
                why = out.failures.get(rid, "a prefill rank did not deliver it")
                failed.append((req, f"KV transfer of request {rid} failed: {why}"))
                continue
            if bad is not None and not self.kv.partial_loads:
                bad = 0
            computed = loaded if bad is None else min(loaded, bad * self.block_size)
            req.status = RequestStatus.WAITING
            if computed <= 0:  # nothing usable arrived: a plain prefill from scratch
                self.kv.free(req)
                req.num_computed_tokens = 0
            else:
                req.num_computed_tokens = computed
                req.num_cached_tokens = computed  # upstream: external hits count as cached
                self.kv.cache_full_blocks(req, computed)
                self.resumed.add(rid)
            ready.append(req)
        self.waiting.extendleft(reversed(ready))
        return failed

    # ---- finishing ----------------------------------------------------------------------------
    def request_finished(self, req: Request) -> bool:
        """The request finished (any reason): True if its blocks must stay allocated (leased
        to a remote engine, or a load still landing); its kv_transfer_params are kept for its
        final output."""
        if not self.enabled:
            return False
        self.loading.pop(req.request_id, None)
        self.resumed.discard(req.request_id)
        delay, params = self.connector.request_finished(req, self.kv.blocks_of(req))
        if params is not None:
            self._params[req.request_id] = params
        if delay:
            self.leased[req.request_id] = req
        return delay

    def attach_params(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Put each finished request's kv_transfer_params on its final output."""
        if self._params:
            for o in outputs:
                if o.finish_reason is not None and o.request_id in self._params:
                    o.kv_transfer_params = self._params.pop(o.request_id)
        return outputs

    def take_stats(self) -> dict[str, float]:
        out, self._stats = self._stats, {}
        for k, v in self.connector.take_scheduler_stats().items():
            out[k] = out.get(k, 0) + v
        return out
