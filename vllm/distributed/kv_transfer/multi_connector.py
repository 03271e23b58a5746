"""Several KV connectors in one engine (upstream's ``MultiConnector``): what runs when both
``--kv-transfer-config`` and ``--kv-offloading-size`` are given, e.g. a prefill engine that sends
its KV to decode engines over NIXL and keeps evicted prefixes in its host offload tier.

The rules, hook by hook:
  * a waiting request's external tokens come from the first connector that claims any; the
    others see it allocated with none (a NIXL consumer then only notifies its producer);
  * metadata: one entry per connector, in order; each worker half gets its own;
  * ``request_finished``: blocks stay while any connector keeps them; the kv_transfer_params
    are the first connector's that returns some;
  * finished sends / receives, failed blocks, failures and counters: the union (no two
    connectors report the same request: only the claimant loads it, only a delaying one
    sends it).
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.nixl_params import NixlConnectorMetadata
from vllm.distributed.kv_transfer.offloading_connector import OffloadMetadata


class MultiConnectorMetadata(KVConnectorMetadata, tag=True):
    metas: list[NixlConnectorMetadata | OffloadMetadata | KVConnectorMetadata] = []


class MultiConnector(KVConnectorBase):
    def __init__(
        self, ctx: KVConnectorContext, role: KVConnectorRole, connectors: list[KVConnectorBase]
    ):
        super().__init__(ctx, role)
        self.connectors = connectors
        self._claims: dict[str, int] = {}  # request -> connector that loads its external tokens

    # ---- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        for i, c in enumerate(self.connectors):
            n, is_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if n > 0:
                self._claims[request.request_id] = i
                return n, is_async
        self._claims.pop(request.request_id, None)
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        owner = self._claims.pop(request.request_id, None)
        for i, c in enumerate(self.connectors):
            c.update_state_after_alloc(request, block_ids, num_external_tokens if i == owner else 0)

    def build_connector_meta(self, scheduler_output) -> MultiConnectorMetadata:
        return MultiConnectorMetadata(
            metas=[c.build_connector_meta(scheduler_output) for c in self.connectors]
        )

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for c in self.connectors:
            c.update_connector_output(output)

    def request_finished(self, request, block_ids):
        delay, params = False, None
        for c in self.connectors:
            d, p = c.request_finished(request, block_ids)
            delay = delay or d
            if params is None:
                params = p
        return delay, params

    def take_scheduler_stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in self.connectors:
            for k, v in c.take_scheduler_stats().items():
                out[k] = out.get(k, 0) + v
        return out

    # ---- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        for c in self.connectors:
            c.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata) -> None:
        super().bind_connector_metadata(metadata)
        metas = metadata.metas if isinstance(metadata, MultiConnectorMetadata) else []
        for i, c in enumerate(self.connectors):
            c.bind_connector_metadata(metas[i] if i < len(metas) else None)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for c in self.connectors:
            c.clear_connector_metadata()

    def start_load_kv(self, so) -> None:
        for c in self.connectors:
            c.start_load_kv(so)

    def wait_for_layer_load(self, layer_idx: int) -> None:
        for c in self.connectors:
            c.wait_for_layer_load(layer_idx)

    def save_kv_layer(self, layer_idx: int) -> None:
        for c in self.connectors:
            c.save_kv_layer(layer_idx)

    def wait_for_save(self) -> None:
        for c in self.connectors:
            c.wait_for_save()

    def get_finished(self, finished_req_ids):
        sending, recving = set(), set()
        for c in self.connectors:
            s, r = c.get_finished(finished_req_ids)
            sending |= s
            recving |= r
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        out: set[int] = set()
        for c in self.connectors:
            out |= c.get_block_ids_with_load_errors()
        return out

    def take_failures_and_stats(self):
        failures: dict[str, str] = {}
        stats: dict[str, float] = {}
        for c in self.connectors:
            f, s = c.take_failures_and_stats()
            failures.update(f)
            for k, v in s.items():
                stats[k] = stats.get(k, 0) + v
        return failures, stats

    def shutdown(self) -> None:
        for c in self.connectors:
            c.shutdown()
