"""--kv-transfer-config: parsed into a frozen KVTransferConfig, every mistake named; the
connector factory's names and the no-op default."""

from __future__ import annotations

import pytest

from vllm.config import KVTransferConfig
from vllm.config.kv_transfer import KV_CONNECTORS
from vllm.distributed.kv_transfer import KVConnectorRole, NoOpConnector
from vllm.distributed.kv_transfer.factory import connector_class, create_connector

OK = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def test_parse_defaults_and_roles():
    assert KVTransferConfig.from_json(None) is None
    assert KVTransferConfig.from_json("{}") is None
    cfg = KVTransferConfig.from_json('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    assert cfg.kv_load_failure_policy == "recompute" and cfg.engine_id  # drawn once, shared
    assert cfg.is_kv_producer and cfg.is_kv_consumer
    prod = KVTransferConfig.from_json(dict(OK, kv_role="kv_producer", engine_id="p0"))
    assert prod.is_kv_producer and not prod.is_kv_consumer and prod.engine_id == "p0"
    with pytest.raises(AttributeError):
        cfg.kv_role = "kv_consumer"  # frozen


@pytest.mark.parametrize(
    "raw,match",
    [
        ("[1]", "--kv-transfer-config must be a JSON object"),
        ("{bad", "--kv-transfer-config must be a JSON object"),
        ({"kv_role": "kv_both"}, "kv_connector is required"),
        ({"kv_connector": "Nixl", "kv_role": "kv_both"}, r"unknown kv_connector 'Nixl'.*Nixl"),
        (dict(OK, kv_role="producer"), r"kv_role must be one of .*got 'producer'"),
        (dict(OK, kv_load_failure_policy="retry"), r"kv_load_failure_policy .*got 'retry'"),
        (dict(OK, kv_rank=0), r"unknown keys \['kv_rank'\]"),
        (dict(OK, side_channel_port=70000), "side_channel_port must be a port"),
        (dict(OK, kv_port="1"), "kv_port must be a port"),
        (dict(OK, kv_lease_timeout_s=0), "kv_lease_timeout_s must be a number of seconds > 0"),
        (dict(OK, kv_load_timeout_s=True), "kv_load_timeout_s must be a number"),
        (dict(OK, engine_id=""), "engine_id must be a non-empty string"),
        (dict(OK, kv_connector_extra_config=[]), "kv_connector_extra_config must be an object"),
    ],
)
def test_errors_name_the_flag_and_value(raw, match):
    with pytest.raises(ValueError, match=match) as e:
        KVTransferConfig.from_json(raw)
    assert "--kv-transfer-config" in str(e.value)


def test_factory():
    assert set(KV_CONNECTORS) == {"NixlConnector", "NoOpConnector"}
    assert isinstance(create_connector(None, KVConnectorRole.WORKER), NoOpConnector)
    with pytest.raises(ValueError, match="unknown kv_connector 'Foo'"):
        connector_class("Foo")


def test_noop_hooks_keep_the_runner_signatures():
    c = NoOpConnector()
    c.start_load_kv(None)
    c.wait_for_layer_load(0)
    c.save_kv_layer(0)
    c.wait_for_save()
    assert c.get_finished([]) == (set(), set())
    assert c.get_num_new_matched_tokens(None, 0) == (0, False)
    assert c.request_finished(None, []) == (False, None)
    assert c.get_block_ids_with_load_errors() == set()
