"""Per-step attention metadata: what one rank's attention layers need to know about the batch.

Built by the model runner once per step with tensor ops; host-side lists (`*_cpu`) are copies of
scheduler data the runner already holds on the CPU, so reading them costs no device sync.
Features add their own typed part (`cp`, `hisparse`), None when the feature is off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

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

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

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

    def slots_for(self, req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Local cache slot of (request row, position) pairs; −1 where this rank does not own the
        token (DCP) or pos < 0. Token p lives on DCP rank (p // I) % N at local offset
        (off // (I·N))·I + off % I of virtual block p // (B·N)."""
        cp = self.cp or CPMetadata()
        bs, n, i = self.layout.block_size, cp.dcp_size, cp.interleave
        p = pos.long().clamp_min(0)
        vblock = self.block_table[req.long(), p // (bs * n)].long()
        off = p % (bs * n)
        local = (off // (i * n)) * i + off % i
        slot = vblock * bs + local
        owned = (pos >= 0) & ((p // i) % n == cp.dcp_rank) & (vblock >= 0)
        return torch.where(owned, slot, -1)


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
