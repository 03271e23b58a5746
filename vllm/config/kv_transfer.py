"""``--kv-transfer-config``: which KV connector moves KV between engines (P/D disaggregation).

Keys follow upstream vLLM's ``KVTransferConfig``; the NIXL-specific ones (side channel, lease and
load timeouts) are first-class fields here rather than entries of ``kv_connector_extra_config``,
so that a typo is refused instead of ignored.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, fields

from vllm.config.flags import parse_json_flag

FLAG = "--kv-transfer-config"
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
# connector names the factory knows (``vllm.distributed.kv_transfer.factory``); kept here so the
# config can refuse an unknown name without importing the connectors
KV_CONNECTORS = ("NixlConnector", "NoOpConnector")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str | None = None
    kv_role: str | None = None  # kv_producer (prefill) | kv_consumer (decode) | kv_both
    kv_load_failure_policy: str = "recompute"  # or "fail": the request errors
    engine_id: str | None = None  # unique per engine; from_json draws a random one if absent
    kv_ip: str = "127.0.0.1"  # host consumers reach this engine's side channel at
    kv_port: int = 14579  # upstream's port key (connectors that need one more port)
    side_channel_port: int = 5600  # base ZMQ port: engine rank k listens on base + k
    kv_lease_timeout_s: float = 480.0  # producer frees a finished request's blocks after this
    kv_load_timeout_s: float = 60.0  # consumer gives a load up (and reports it failed) after this
    kv_connector_extra_config: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_json(cls, value) -> KVTransferConfig | None:
        """Parse and validate the flag's JSON; None when the flag is absent or ``{}``."""
        raw = parse_json_flag(value, FLAG)
        if not raw:
            return None
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{FLAG}: unknown keys {sorted(unknown)} (known: {sorted(known)})")
        # one id shared by the engine's scheduler and workers (they receive this config)
        raw.setdefault("engine_id", uuid.uuid4().hex)
        cfg = cls(**raw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.kv_connector is None:
            raise ValueError(f"{FLAG}: kv_connector is required (one of {list(KV_CONNECTORS)})")
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(
                f"{FLAG}: unknown kv_connector {self.kv_connector!r} (known: {list(KV_CONNECTORS)})"
            )
        if self.kv_role not in KV_ROLES:
            raise ValueError(
                f"{FLAG}: kv_role must be one of {list(KV_ROLES)}, got {self.kv_role!r}"
            )
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"{FLAG}: kv_load_failure_policy must be one of {list(KV_LOAD_FAILURE_POLICIES)}, "
                f"got {self.kv_load_failure_policy!r}"
            )
        if self.engine_id is not None and (
            not isinstance(self.engine_id, str) or not self.engine_id
        ):
            raise ValueError(
                f"{FLAG}: engine_id must be a non-empty string, got {self.engine_id!r}"
            )
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"{FLAG}: kv_ip must be a host name or address, got {self.kv_ip!r}")
        for name in ("kv_port", "side_channel_port"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 65536:
                raise ValueError(f"{FLAG}: {name} must be a port in 1..65535, got {v!r}")
        for name in ("kv_lease_timeout_s", "kv_load_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"{FLAG}: {name} must be a number of seconds > 0, got {v!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(f"{FLAG}: kv_connector_extra_config must be an object")
