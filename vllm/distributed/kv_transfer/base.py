"""The KV connector API (upstream's ``KVConnectorBase_V1``): one class, two halves.

An engine builds one connector object per role: ``KVConnectorRole.SCHEDULER`` in the engine core
(beside the scheduler) and ``KVConnectorRole.WORKER`` in every worker (beside the model runner).
Every method has a no-op default, so the engine calls them unconditionally and
:class:`NoOpConnector` is what runs without ``--kv-transfer-config``.

A step, seen from the engine (upstream's order):

  scheduler, when a waiting request is first considered:
      n, is_async = get_num_new_matched_tokens(request, num_computed_tokens)
      allocate blocks for the local prefix hit + n tokens, then
      update_state_after_alloc(request, block_ids, n)
      (is_async: the request waits, holding its blocks, until a worker reports it loaded)
  scheduler, at the end of ``schedule()``:
      scheduler_output.kv_connector_metadata = build_connector_meta(scheduler_output)
  worker, around the forward:
      bind_connector_metadata(meta); start_load_kv(so)
      per layer: wait_for_layer_load(i) ... save_kv_layer(i)
      wait_for_save(); sending, recving = get_finished(so.finished_req_ids)
      invalid = get_block_ids_with_load_errors(); clear_connector_metadata()
      -> KVConnectorOutput(sending, recving, invalid) rides on the ModelRunnerOutput
  scheduler, on the aggregated outputs (:func:`aggregate_outputs`, every rank must agree):
      update_connector_output(output); finished_recving -> the request becomes schedulable
      (its external tokens count as computed, except those on ``invalid_block_ids``, which the
      ``kv_load_failure_policy`` recomputes or turns into an error); finished_sending -> free
      the request's blocks
  scheduler, when a request finishes:
      delay_free, kv_transfer_params = request_finished(request, block_ids)
      delay_free: keep the blocks until a worker reports the request in finished_sending;
      kv_transfer_params: returned to the client with the output (the P/D router forwards it)
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec
import torch

from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.reshard import KVShardLayout
from vllm.kv_cache_interface import KVCacheLayout

if TYPE_CHECKING:
    from vllm.core.messages import SchedulerOutput
    from vllm.core.request import RequestStatus


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata(msgspec.Struct, tag=True):
    """What the scheduler half tells the worker halves each step (msgpack-able; subclasses are
    tagged so a ``SchedulerOutput`` field typed as their union decodes to the right one)."""


class KVConnectorOutput(msgspec.Struct, omit_defaults=True):
    """What one worker reports each step (upstream's name). Request ids: the scheduler's."""

    finished_sending: list[str] = []  # producer: the request's blocks may be freed
    finished_recving: list[str] = []  # consumer: the load ended (done or failed)
    invalid_block_ids: list[int] = []  # consumer: blocks whose load failed
    failures: dict[str, str] = {}  # consumer: request id -> why its load failed
    stats: dict[str, float] = {}  # transfer counters since the last step (summed over ranks)

    @property
    def is_empty(self) -> bool:
        return not (
            self.finished_sending or self.finished_recving or self.invalid_block_ids or self.stats
        )


def aggregate_outputs(
    outputs: Sequence[KVConnectorOutput], pending: dict[str, dict[str, int]]
) -> KVConnectorOutput:
    """Combine one step's outputs of every worker of an engine replica. A request is finished
    sending / receiving once *every* rank has reported it (ranks report in different steps, so
    counts persist in ``pending`` — {"sending": {req: n}, "recving": {req: n}} — across calls);
    invalid blocks are the union."""
    n = len(outputs)
    done: dict[str, list[str]] = {"sending": [], "recving": []}
    for kind in done:
        counts = pending.setdefault(kind, {})
        for out in outputs:
            for req in getattr(out, f"finished_{kind}"):
                counts[req] = counts.get(req, 0) + 1
                if counts[req] == n:
                    del counts[req]
                    done[kind].append(req)
    invalid = sorted({b for out in outputs for b in out.invalid_block_ids})
    failures = {r: why for out in outputs for r, why in out.failures.items()}
    stats: dict[str, float] = {}
    for out in outputs:
        for k, v in out.stats.items():
            stats[k] = stats.get(k, 0) + v
    return KVConnectorOutput(done["sending"], done["recving"], invalid, failures, stats)


def step_output(
    connector: KVConnectorBase, finished_req_ids: Iterable[str]
) -> KVConnectorOutput | None:
    """The worker half's end of a step (base.py's order): finished sends and receives, blocks
    whose load failed, and the transfer counters; the step's metadata is cleared. None when
    there is nothing to report."""
    sending, recving = connector.get_finished(finished_req_ids)
    invalid = connector.get_block_ids_with_load_errors()
    failures, stats = connector.take_failures_and_stats()
    connector.clear_connector_metadata()
    out = KVConnectorOutput(sorted(sending), sorted(recving), sorted(invalid), failures, stats)
    return None if out.is_empty and not failures else out


class KVRequest(Protocol):
    """What the scheduler half reads of a request (``vllm.core.request.Request`` once it carries
    the request's ``kv_transfer_params``)."""

    request_id: str
    prompt_token_ids: Sequence[int]  # packed int32 (an array) in the engine core
    num_computed_tokens: int
    status: RequestStatus
    kv_transfer_params: dict | None


@dataclass(frozen=True)
class KVConnectorContext:
    """What a connector needs of the engine's configuration (no VllmConfig below the runner)."""

    config: KVTransferConfig | None  # --kv-transfer-config (None: only the offload tier runs)
    layout: KVCacheLayout  # byte layout of every layer's caches
    shard: KVShardLayout  # how this engine replica shards the KV over its ranks
    rank: int = 0  # worker: rank within the replica (PCP × TP order); scheduler: 0
    dp_rank: int = 0  # data-parallel replica (each replica is its own KV engine)
    model_name: str = ""
    offload_num_blocks: int = 0  # --kv-offloading-size: host-tier blocks on each rank (0: off)

    @classmethod
    def from_vllm_config(cls, vllm_config, rank: int = 0, dp_rank: int = 0) -> KVConnectorContext:
        mc, par = vllm_config.model_config, vllm_config.parallel_config
        return cls(
            config=vllm_config.kv_transfer_config,
            layout=KVCacheLayout.from_arch(mc.arch, vllm_config.cache_config.cache_dtype, mc.dtype),
            shard=KVShardLayout(
                par.prefill_context_parallel_size * par.tensor_parallel_size,
                par.decode_context_parallel_size,
                par.cp_kv_cache_interleave_size,
                vllm_config.cache_config.block_size,
            ),
            rank=rank,
            dp_rank=dp_rank,
            model_name=mc.served_model_name,
            offload_num_blocks=vllm_config.offload_num_blocks,
        )

    @classmethod
    def for_engine(cls, vllm_config, rank: int = 0, dp_rank: int = 0) -> KVConnectorContext | None:
        """The context of an engine that runs a KV connector, None for one that does not."""
        if not vllm_config.uses_kv_connector:
            return None
        return cls.from_vllm_config(vllm_config, rank, dp_rank)


# one layer's caches: the MLA rows and, for layers with a "full" indexer, the indexer keys
LayerKVCache = tuple[torch.Tensor, torch.Tensor | None]


class KVConnectorBase:
    """Both halves of a KV connector, every hook a no-op. Subclasses override what they use."""

    def __init__(self, ctx: KVConnectorContext | None = None, role: KVConnectorRole | None = None):
        self.ctx, self.role = ctx, role
        self._metadata: KVConnectorMetadata | None = None

    # ---- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: KVRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` (the local prefix hit) whose KV this connector
        can supply, and whether they arrive asynchronously (the request then waits for a worker
        to report it in ``finished_recving``). At least the last prompt token is always left to
        compute, so the request's first step has logits."""
        return 0, False

    def update_state_after_alloc(
        self, request: KVRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Blocks are allocated: ``block_ids`` are all the request's (virtual) block ids, the
        external tokens are positions [num_computed_tokens, + num_external_tokens)."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's instructions for the workers; resets the scheduler half's step state."""
        return KVConnectorMetadata()

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The aggregated worker outputs of a step (:func:`aggregate_outputs`)."""

    def request_finished(
        self, request: KVRequest, block_ids: list[int]
    ) -> tuple[bool, dict | None]:
        """(delay_free, kv_transfer_params): whether the scheduler must keep the request's
        blocks until a worker reports it in ``finished_sending`` (or, for a load still landing,
        ``finished_recving``), and the params to return to the client."""
        return False, None

    def take_scheduler_stats(self) -> dict[str, float]:
        """The scheduler half's counters since the last call (e.g. the offload tier's
        ``external_prefix_cache_queries`` / ``_hits``, in tokens)."""
        return {}

    # ---- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[LayerKVCache]) -> None:
        """Every attention layer's caches on this rank, in layer order (MTP layers last)."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def start_load_kv(self, so: SchedulerOutput) -> None:
        """Begin pulling remote KV for the requests the bound metadata lists (non-blocking)."""

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until layer ``layer_idx``'s remote KV is in place (layer-wise loads only)."""

    def save_kv_layer(self, layer_idx: int) -> None:
        """Offer layer ``layer_idx``'s new KV to remote consumers (push connectors only)."""

    def wait_for_save(self) -> None:
        """Block until this step's saves are done."""

    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        """(done_sending, done_recving) request ids since the last call. A failed load is
        reported here too, with its blocks in :meth:`get_block_ids_with_load_errors`."""
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (the engine applies
        ``kv_load_failure_policy`` to the requests holding them)."""
        return set()

    def take_failures_and_stats(self) -> tuple[dict[str, str], dict[str, float]]:
        """Why each load reported since the last call failed, and this rank's transfer counters
        since the last call (``kv_transfer_*``: bytes received, loads done, loads failed)."""
        return {}, {}

    def shutdown(self) -> None:
        """Release transfer resources (agents, sockets, threads)."""


class NoOpConnector(KVConnectorBase):
    """No KV transfer: what the engine runs without --kv-transfer-config."""
