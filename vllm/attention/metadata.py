"""Per-step attention metadata: what one rank's attention layers need to know about the batch.

Built by the model runner (and, for PCP/DCP, by `distributed/pcp_manager.py`) with tensor ops;
host-side lists (`*_cpu`) are copies of scheduler data the runner already holds on the CPU, so
reading them costs no device sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.attention.kv_cache import KVCacheLayout


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
    # ---- parallel plumbing (None = single rank) --------------------------------------------------
    cp: object | None = None  # distributed.cp_attention.CPAttention
    dcp_size: int = 1
    dcp_rank: int = 0
    cp_interleave: int = 1
    positions_cpu: np.ndarray | None = None  # host copy of `positions` (prefill key ranges)
    # HiSparse: indexer pages live in their own pool (None = same as block_table)
    idx_block_table: torch.Tensor | None = None
    idx_slot_mapping: torch.Tensor | None = None
    block_table_full: torch.Tensor | None = None  # [max_reqs, pages] by request slot
    extras: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

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
        bs, n, i = self.layout.block_size, self.dcp_size, self.cp_interleave
        p = pos.long().clamp_min(0)
        vblock = self.block_table[req.long(), p // (bs * n)].long()
        off = p % (bs * n)
        local = (off // (i * n)) * i + off % i
        slot = vblock * bs + local
        owned = (pos >= 0) & ((p // i) % n == self.dcp_rank) & (vblock >= 0)
        return torch.where(owned, slot, -1)
