"""Producer and consumer "engines" made of real NixlConnector halves (one scheduler half, one
worker half per rank, each rank its own NIXL agent with its own registered caches), driven the
way the engine will drive them. Used in-process and from spawned producer processes."""

from __future__ import annotations

import random
import socket
import time
from dataclasses import dataclass

import msgspec
import numpy as np

from tests.distributed.kv_transfer.kv_helpers import SMALL_FP8, LogicalKV, empty_caches
from vllm.config.kv_transfer import KVTransferConfig
from vllm.core.request import RequestStatus
from vllm.distributed.kv_transfer import (
    KVConnectorContext,
    KVConnectorOutput,
    KVConnectorRole,
    aggregate_outputs,
)
from vllm.distributed.kv_transfer.nixl_connector import NixlConnector
from vllm.distributed.kv_transfer.nixl_params import NixlConnectorMetadata
from vllm.distributed.kv_transfer.reshard import KVShardLayout

NUM_LAYERS = 3  # layers 0 and 2 with an indexer cache (2 plays the MTP layer)
NUM_BLOCKS = 40


def bytes_per_row(layout=SMALL_FP8) -> int:
    """Bytes of one token over every layer's caches (3 MLA caches, 2 indexer caches)."""
    return 3 * layout.mla_bytes_per_token + 2 * layout.indexer_bytes_per_token


BYTES_PER_ROW = bytes_per_row(SMALL_FP8)


@dataclass
class FakeRequest:
    """The fields of vllm.core.request.Request the scheduler half reads."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.FINISHED_LENGTH
    kv_transfer_params: dict | None = None


def make_ctx(
    shard, role: str, rank: int = 0, model="tiny-glm", layout=SMALL_FP8, **cfg
) -> KVConnectorContext:
    config = KVTransferConfig.from_json({"kv_connector": "NixlConnector", "kv_role": role, **cfg})
    return KVConnectorContext(config, layout, shard, rank=rank, model_name=model)


_HANDED_OUT: set[int] = set()  # ports this process gave a server (bound later, maybe not yet)


def free_port_range(n: int) -> int:
    """A base port with n free consecutive ports after it, below Linux's ephemeral range
    (32768-60999): the OS hands ports there to every outgoing connection (gloo opens many), so
    a port probed free there can be taken before the server binds it. Never a port handed out
    before in this process: servers started together probe before any of them binds, and two
    overlapping ranges both probe free."""
    for _ in range(100):
        base = random.randint(20000, 32767 - n)
        if _HANDED_OUT.intersection(range(base, base + n)):
            continue
        socks = []
        try:
            for k in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + k))
            _HANDED_OUT.update(range(base, base + n))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


class Engine:
    """One engine replica: a scheduler half and one worker half (agent + caches) per rank."""

    def __init__(self, shard: KVShardLayout, role: str, layout=SMALL_FP8, **cfg):
        self.shard, self.layout = shard, layout
        cfg["layout"] = layout
        # one engine id for the scheduler and every worker, as the shared config gives them
        cfg.setdefault("engine_id", f"{role}-{random.getrandbits(32):08x}")
        # these engines step one at a time (a producer is idle while its consumer pulls): UCX's
        # progress thread serves the reads, as the engine's own polling does in a server
        cfg.setdefault("kv_connector_extra_config", {"nixl_progress_thread": True})
        self.sched = NixlConnector(make_ctx(shard, role, **cfg), KVConnectorRole.SCHEDULER)
        self.workers = [
            NixlConnector(make_ctx(shard, role, rank=k, **cfg), KVConnectorRole.WORKER)
            for k in range(shard.world_size)
        ]
        self.caches = [empty_caches(layout, NUM_LAYERS, NUM_BLOCKS) for _ in self.workers]
        for w, c in zip(self.workers, self.caches, strict=True):
            w.register_kv_caches(c)
        self._pending: dict = {}
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.invalid: set[int] = set()

    def step(self) -> KVConnectorOutput:
        """One engine step: metadata to every worker (through msgpack, as it will travel),
        start loads, collect and aggregate every rank's finished sets."""
        meta = self.sched.build_connector_meta(None)
        meta = msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=NixlConnectorMetadata)
        outs = []
        for w in self.workers:
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            sending, recving = w.get_finished([])
            invalid = w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
            outs.append(KVConnectorOutput(sorted(sending), sorted(recving), sorted(invalid)))
        out = aggregate_outputs(outs, self._pending)
        self.sched.update_connector_output(out)
        self.sending.update(out.finished_sending)
        self.recving.update(out.finished_recving)
        self.invalid.update(out.invalid_block_ids)
        return out

    def wait(self, what: str, req_ids, timeout_s: float) -> float:
        """Step until every id is in ``what`` (sending / recving); returns the seconds taken."""
        t0 = time.monotonic()
        while not set(req_ids) <= getattr(self, what):
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"{what} {sorted(getattr(self, what))}, want {sorted(req_ids)}")
            self.step()
            time.sleep(0.002)
        return time.monotonic() - t0

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()


class Producer(Engine):
    """Holds `requests` = [(req_id, num_tokens, seed)] prefilled, finished, blocks leased."""

    def __init__(self, shard, requests, **cfg):
        super().__init__(shard, "kv_producer", **cfg)
        pool = np.random.default_rng(0).permutation(NUM_BLOCKS).tolist()
        self.params = {}
        for req_id, n, seed in requests:
            blocks = [pool.pop() for _ in range(shard.num_blocks(n))]
            logical = LogicalKV(self.layout, n, NUM_LAYERS, seed)
            for k, c in enumerate(self.caches):
                logical.write_into(c, shard, k, blocks)
            req = FakeRequest(
                req_id, list(range(n)), n, kv_transfer_params={"do_remote_decode": True}
            )
            delay, params = self.sched.request_finished(req, blocks)
            assert delay
            self.params[req_id] = params
        self.step()  # the leases reach the workers


class Consumer(Engine):
    def __init__(self, shard, **cfg):
        super().__init__(shard, "kv_consumer", **cfg)
        self._next_block = 0

    def pull(self, req_id: str, params: dict, prompt_len: int) -> tuple[list[int], int]:
        """The scheduler's side of admitting a request with remote KV; returns (block ids,
        external tokens)."""
        req = FakeRequest(req_id, list(range(prompt_len)), kv_transfer_params=params)
        n, is_async = self.sched.get_num_new_matched_tokens(req, 0)
        assert is_async and n == min(params["remote_num_tokens"], prompt_len - 1)
        nb = self.shard.num_blocks(prompt_len)
        blocks = list(range(self._next_block + nb - 1, self._next_block - 1, -1))  # descending
        self._next_block += nb
        self.sched.update_state_after_alloc(req, blocks, n)
        return blocks, n

    def expected(self, num_tokens: int, seed: int, blocks, rank: int, hi: int):
        logical = LogicalKV(self.layout, num_tokens, NUM_LAYERS, seed)
        return logical.caches(self.shard, rank, blocks, NUM_BLOCKS, 0, hi)
