"""KV transfer between engines (P/D disaggregation, SPEC §7).

What lives here: the connector API (``base.py``: scheduler and worker halves, no-op defaults), the
resharding planner (``reshard.py``: which rows a decode rank reads from which prefill rank), the
NIXL connector (``nixl_connector.py``) with its ZMQ handshake (``side_channel.py``), and the
name → class factory (``factory.py``). What does not: when the scheduler calls the hooks and what
it does with their answers (``vllm/core``), the runner's calls (``vllm/worker``), the HTTP
``kv_transfer_params`` (``vllm/entrypoints``). The runner always holds a connector; without
--kv-transfer-config it is the no-op one, so the runner never asks "is there a connector?".
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.base import (  # noqa: F401
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    NoOpConnector,
    aggregate_outputs,
    step_output,
)
