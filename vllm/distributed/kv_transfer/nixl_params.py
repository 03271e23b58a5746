"""What the NixlConnector's two halves and the two engines exchange.

``kv_transfer_params`` returned by the prefill engine (JSON):

  do_remote_prefill: true, do_remote_decode: false   (what the decode engine must do)
  remote_engine_id: str          prefill engine id
  remote_request_id: str         the request id on the prefill engine (notifications use it)
  remote_host: str, remote_port: int
                                 side channel of prefill rank 0 of the replica; rank k listens on
                                 remote_port + k
  remote_block_ids: [[int]]      per prefill DCP rank, the request's block ids
  remote_num_tokens: int         prompt positions whose KV the blocks hold
  remote_world_size, remote_dcp_size, remote_interleave, remote_block_size: int
                                 the prefill replica's KV sharding (``reshard.KVShardLayout``)
"""

from __future__ import annotations

import msgspec

from vllm.distributed.kv_transfer.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.reshard import KVShardLayout

PARAM_KEYS = (
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "remote_num_tokens",
    "remote_world_size",
    "remote_dcp_size",
    "remote_interleave",
    "remote_block_size",
)


class NixlRecvReq(msgspec.Struct):
    """A request whose positions [lo, hi) the workers must pull; lo == hi: nothing to pull (a
    local prefix hit covered it), only notify the producer so it frees its blocks."""

    req_id: str
    local_block_ids: list[int]
    lo: int
    hi: int
    params: dict


class NixlConnectorMetadata(KVConnectorMetadata, tag=True):
    reqs_to_recv: list[NixlRecvReq] = []
    reqs_to_send: dict[str, float] = {}  # producer request id -> lease seconds from now


def source_layout(params: dict) -> KVShardLayout:
    missing = [k for k in PARAM_KEYS if k not in params]
    if missing:
        raise ValueError(f"kv_transfer_params misses {missing}")
    return KVShardLayout(
        params["remote_world_size"],
        params["remote_dcp_size"],
        params["remote_interleave"],
        params["remote_block_size"],
    )
