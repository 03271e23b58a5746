"""KV transfer between engines (P/D disaggregation). The runner always holds a connector; without
--kv-transfer-config it is the no-op one, so the runner never asks "is there a connector?"."""

from __future__ import annotations

from vllm.core.messages import SchedulerOutput


class KVConnectorBase:
    """Worker-side hooks around each step (upstream's KVConnectorBase_V1 worker half)."""

    def start_load_kv(self, so: SchedulerOutput) -> None:
        """Begin pulling remote KV for requests scheduled this step."""

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until layer `layer_idx`'s remote KV is in place."""

    def save_kv_layer(self, layer_idx: int) -> None:
        """Offer layer `layer_idx`'s new KV to remote consumers."""

    def wait_for_save(self) -> None:
        """Block until this step's saves are done."""


class NoOpConnector(KVConnectorBase):
    pass
