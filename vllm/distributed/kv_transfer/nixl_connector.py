"""NixlConnector: the decode engine pulls a finished prefill's KV with NIXL READs (SPEC §7).

Flow (upstream's, with resharding):

  1. The client (router) sends the prefill engine a request with
     ``kv_transfer_params = {"do_remote_decode": true}``. When it finishes, the scheduler half's
     :meth:`request_finished` keeps its blocks leased and returns the params below.
  2. The decode engine receives the request with those params. :meth:`get_num_new_matched_tokens`
     claims the prompt's KV (all but the last prompt token) as asynchronously loaded; after block
     allocation the request is listed in the step's :class:`NixlConnectorMetadata`.
  3. Each decode worker (``nixl_worker.NixlWorker``) handshakes with every prefill rank over the
     ZMQ side channel (agent metadata + a compatibility hash), plans its reads with
     ``reshard.plan_reads`` (only the rows it owns), posts one READ per prefill rank for all
     layers, polls without blocking, notifies every prefill rank, and reports the request in
     ``finished_recving`` (failed loads also list their blocks in
     ``get_block_ids_with_load_errors``).
  4. Prefill workers count the notifications; when every decode rank has confirmed (or the lease
     expires) they report the request in ``finished_sending`` and the scheduler frees its blocks.

The params schema and the per-step metadata are in ``nixl_params.py``.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorOutput,
    KVConnectorRole,
    KVRequest,
)
from vllm.distributed.kv_transfer.nixl_params import (
    NixlConnectorMetadata,
    NixlRecvReq,
    source_layout,
)
from vllm.distributed.kv_transfer.nixl_worker import NixlWorker


class NixlConnector(KVConnectorBase):
    """Scheduler half here; the worker half delegates to ``nixl_worker.NixlWorker``."""

    def __init__(self, ctx: KVConnectorContext, role: KVConnectorRole):
        super().__init__(ctx, role)
        cfg = ctx.config
        self.engine_id = cfg.engine_id or "engine"
        # scheduler state
        self._recv: list[NixlRecvReq] = []  # listed in the next metadata
        self._send: dict[str, float] = {}
        self._pulled: set[str] = set()  # requests already claimed (a preempted one recomputes)
        self._loading: set[str] = set()  # claimed and not yet reported finished_recving
        self.worker: NixlWorker | None = None
        if role == KVConnectorRole.WORKER:
            self.worker = NixlWorker(ctx, self.engine_id)

    # ---- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: KVRequest, num_computed_tokens: int):
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or not self.ctx.config.is_kv_consumer:
            return 0, False
        if request.request_id in self._pulled:
            return 0, False
        hi = min(int(params.get("remote_num_tokens", 0)), len(request.prompt_token_ids) - 1)
        n = hi - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: KVRequest, block_ids, num_external_tokens):
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or request.request_id in self._pulled:
            return
        source_layout(params)  # refuse malformed params here, not in a worker
        self._pulled.add(request.request_id)
        hi = min(int(params["remote_num_tokens"]), len(request.prompt_token_ids) - 1)
        lo = hi - num_external_tokens if num_external_tokens > 0 else hi
        if num_external_tokens > 0:
            self._loading.add(request.request_id)
        self._recv.append(NixlRecvReq(request.request_id, list(block_ids), lo, hi, dict(params)))

    def build_connector_meta(self, scheduler_output) -> NixlConnectorMetadata:
        meta = NixlConnectorMetadata(reqs_to_recv=self._recv, reqs_to_send=self._send)
        self._recv, self._send = [], {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._loading.difference_update(output.finished_recving)

    def request_finished(self, request: KVRequest, block_ids):
        self._pulled.discard(request.request_id)
        if request.request_id in self._loading:
            # finished (aborted) while its KV is still landing: free after finished_recving
            return True, None
        params = request.kv_transfer_params
        cfg, shard = self.ctx.config, self.ctx.shard
        if not params or not params.get("do_remote_decode") or not cfg.is_kv_producer:
            return False, None
        if request.status.finish_reason not in ("stop", "length"):
            return False, None  # aborted or failed: nobody will pull
        num_tokens = min(request.num_computed_tokens, len(request.prompt_token_ids))
        if num_tokens <= 0 or not block_ids:
            return False, None
        self._send[request.request_id] = cfg.kv_lease_timeout_s
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": cfg.kv_ip,
            "remote_port": cfg.side_channel_port + self.ctx.dp_rank * shard.world_size,
            "remote_block_ids": [list(block_ids)] * shard.dcp_size,
            "remote_num_tokens": num_tokens,
            "remote_world_size": shard.world_size,
            "remote_dcp_size": shard.dcp_size,
            "remote_interleave": shard.interleave,
            "remote_block_size": shard.block_size,
        }

    # ---- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, so) -> None:
        meta = self._metadata
        if isinstance(meta, NixlConnectorMetadata):
            self.worker.start(meta)

    def get_finished(self, finished_req_ids):
        return self.worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def take_failures_and_stats(self):
        return self.worker.take_failures_and_stats()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
