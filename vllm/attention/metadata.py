"""Per-step attention metadata: what one rank's attention layers need to know about the batch.

Built by the model runner once per step with tensor ops; host-side lists (`*_cpu`) are copies of
scheduler data the runner already holds on the CPU, so reading them costs no device sync.
Features add their own typed part (`cp`, `hisparse`), None when the feature is off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from vllm.kernels.kv_cache import cache_slots
from vllm.kv_cache_interface import KVCacheLayout


@dataclass(frozen=True)
class CPMetadata:
    """Context parallelism of the step (SPEC §4-5): how new KV rows are gathered over PCP and how
    the cache is split over DCP. Token p is stored on DCP rank (p // interleave) % dcp_size."""

    dcp_size: int = 1
    dcp_rank: int = 0
    interleave: int = 1
    pcp_pad: int = 1  # tokens per PCP rank after padding (the all-gather of new KV rows)
    decode_pad: int = 1  # decode tokens per rank after padding (the DCP gathers of queries)


@dataclass
class HiSparseMetadata:
    """HiSparse's view of the step (SPEC §6): where each request's pages live."""

    step: int | torch.Tensor  # LRU stamp of this step ([1] on the device: the worker's step_t)
    req_slots: list[int]  # persistent slot of each request row (host)
    req_slots_t: torch.Tensor  # [B] the same on the device
    block_table_full: torch.Tensor  # [max_reqs, pages] device block per page (−1: host only)
    idx_block_table: torch.Tensor  # [B, pages] indexer-key pages (always on the device)
    idx_slot_mapping: torch.Tensor  # [T_kv] indexer slot of each new row, −1 = skip
    tokens_per_req: int = 1  # most decode tokens of one request (1 + drafts in a verify row)
    # filled during the step, layer by layer: the slots resolved for each IndexShare group, and
    # per layer the event its prefetched rows landed on
    group_slots: dict[int, torch.Tensor] = field(default_factory=dict)
    ready: dict[int, torch.cuda.Event] = field(default_factory=dict)


@dataclass
class MLAMetadata:
    layout: KVCacheLayout
    index_topk: int
    # ---- query tokens handled by this rank, grouped by request --------------------------------
    positions: torch.Tensor  # [T] int64, position of each query token in its request
    token_req: torch.Tensor  # [T] int64, request row (index into the per-request arrays below)
    query_start_loc_cpu: list[int]  # [B+1] this rank's tokens of request r are [qsl[r], qsl[r+1])
    # ---- per request of the step (every rank sees the same requests) ---------------------------
    seq_lens: torch.Tensor  # [B] context length after this step
    seq_lens_cpu: list[int]
    block_table: torch.Tensor  # [B, max_blocks] int32 (virtual block ids under DCP)
    is_prefill_cpu: list[bool]  # request runs the prefill path this step (global decision)
    use_dense_cpu: list[bool]  # prefill request served by the dense (MHA-form) path
    # ---- new KV rows written this step (the PCP-gathered rows under PCP) -----------------------
    slot_mapping: torch.Tensor  # [T_kv] local slot per new row, −1 = not stored on this rank
    positions_cpu: np.ndarray | None = None  # host copy of `positions` (prefill key ranges)
    decode_tokens: torch.Tensor | None = None  # [T_dec] rows of this rank's decode tokens
    # a fixed bound on the decode tokens' context lengths (CUDA graphs: shapes cannot follow the
    # batch); None: the longest decode request of this step
    max_decode_ctx: int | None = None
    # ---- features (None: off) -------------------------------------------------------------------
    cp: CPMetadata | None = None
    hisparse: HiSparseMetadata | None = None
    # the decode slots of the last top-k tensor seen (``decode_slots``): (topk, slots)
    _decode_slots: tuple[torch.Tensor, torch.Tensor] | None = field(
        default=None, repr=False, compare=False
    )

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @cached_property
    def decode_is_all(self) -> bool:
        """Every query row of this rank is a decode token, in order (``decode_tokens`` is
        arange(T): no request prefills this step, as in every CUDA-graph replay): per-token
        tensors are then used as they are, without a gather or a scatter."""
        return (
            self.decode_tokens is not None
            and not any(self.is_prefill_cpu)
            and self.decode_tokens.shape[0] == self.positions.shape[0]
        )

    def decode_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x[decode_tokens]`` of a per-token tensor x [T, ...]: x itself when every row
        decodes (:attr:`decode_is_all`)."""
        return x if self.decode_is_all else x[self.decode_tokens]

    def decode_slots(self, topk_pos: torch.Tensor) -> torch.Tensor:
        """int32 cache slots [T_dec, K] of the decode tokens' selected positions topk_pos
        [T_dec, K] (what the attention kernels take), −1 where none or not on this rank.
        Computed once per top-k tensor: the shared layers of an IndexShare group pass their
        full layer's tensor on unchanged, and reuse its slots."""
        hit = self._decode_slots
        if hit is not None and hit[0] is topk_pos:
            return hit[1]
        slots = self.slots_for(self.decode_rows(self.token_req), topk_pos, torch.int32)
        self._decode_slots = (topk_pos, slots)
        return slots

    def decode_reqs(self) -> list[int]:
        """Request rows that run the decode path this step."""
        return [r for r in range(self.num_reqs) if not self.is_prefill_cpu[r]]

    def decode_ctx_bound(self) -> int:
        """Width of the decode tokens' per-position buffers (indexer logits): no decode token's
        context is longer."""
        if self.max_decode_ctx is not None:
            return self.max_decode_ctx
        return max(self.seq_lens_cpu[r] for r in self.decode_reqs())

    def token_slices(self):
        """(request row, start, end) of this rank's query tokens, skipping empty requests."""
        q = self.query_start_loc_cpu
        for r in range(len(q) - 1):
            if q[r + 1] > q[r]:
                yield r, q[r], q[r + 1]

    def slots_for(
        self, req: torch.Tensor, pos: torch.Tensor, out_dtype: torch.dtype = torch.int64
    ) -> torch.Tensor:
        """Local cache slot of (request row, position) pairs (``kv_cache.cache_slots``); −1 where
        this rank does not own the token (DCP), pos < 0 or its block is −1. req: pos's shape, or [N] for pos
        [N, K] (one request per row; a row-broadcast view of [N] is taken as [N]). Token p lives
        on DCP rank (p // I) % N at local offset (off // (I·N))·I + off % I of virtual block
        p // (B·N)."""
        cp = self.cp or CPMetadata()
        if req.dim() == 2 and req.stride(1) == 0:
            req = req[:, 0]
        return cache_slots(
            self.block_table,
            req,
            pos,
            self.layout.block_size,
            cp.dcp_size,
            cp.dcp_rank,
            cp.interleave,
            out_dtype,
        )


def decode_token_rows(
    query_start_loc: list[int], is_prefill: list[bool], device: torch.device, h2d=None
) -> torch.Tensor | None:
    """[T_dec] this rank's token rows of the requests on the decode path (None: no decode), built
    once per step on the host and copied to the device (through ``h2d``, the runner's pinned
    staging, when given: a plain copy from pageable memory synchronises the stream)."""
    rows = [
        np.arange(query_start_loc[r], query_start_loc[r + 1])
        for r in range(len(is_prefill))
        if not is_prefill[r]
    ]
    if not rows:
        return None
    rows = np.concatenate(rows)
    return h2d(rows) if h2d is not None else torch.from_numpy(rows).to(device)
