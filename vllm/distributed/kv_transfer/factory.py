"""Connector name (``kv_connector`` of --kv-transfer-config) → class, imported on demand so that
``nixl`` is only imported by engines that use it."""

from __future__ import annotations

import importlib

from vllm.config.kv_transfer import KV_CONNECTORS
from vllm.distributed.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorRole,
    NoOpConnector,
)

_REGISTRY = {
    "NixlConnector": ("vllm.distributed.kv_transfer.nixl_connector", "NixlConnector"),
    "NoOpConnector": ("vllm.distributed.kv_transfer.base", "NoOpConnector"),
}
assert set(_REGISTRY) == set(KV_CONNECTORS)


def connector_class(name: str) -> type[KVConnectorBase]:
    if name not in _REGISTRY:
        raise ValueError(
            f"--kv-transfer-config: unknown kv_connector {name!r} (known: {sorted(_REGISTRY)})"
        )
    module, cls = _REGISTRY[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise ImportError(
            f"--kv-transfer-config kv_connector {name!r} needs a package that is missing: {e} "
            "(NIXL: pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1)"
        ) from e


def create_connector(ctx: KVConnectorContext | None, role: KVConnectorRole) -> KVConnectorBase:
    """The configured connector for ``role``: --kv-transfer-config's, the CPU offload tier
    (--kv-offloading-size), both in a ``MultiConnector``, or the no-op one."""
    if ctx is None:
        return NoOpConnector(ctx, role)
    connectors = []
    if ctx.config is not None:
        connectors.append(connector_class(ctx.config.kv_connector)(ctx, role))
    if ctx.offload_num_blocks > 0:
        from vllm.distributed.kv_transfer.offloading_connector import OffloadingConnector

        connectors.append(OffloadingConnector(ctx, role))
    if not connectors:
        return NoOpConnector(ctx, role)
    if len(connectors) == 1:
        return connectors[0]
    from vllm.distributed.kv_transfer.multi_connector import MultiConnector

    return MultiConnector(ctx, role, connectors)
