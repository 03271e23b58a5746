"""How an attention layer reaches its KV: the seam between the layer's math and where rows live.

A ``KVAccess`` writes a step's new rows, reads a prefill request's whole context, and scores and
attends decode tokens. The model runner picks one implementation for the engine at start-up and
binds it to every attention layer:

  * :class:`LocalKVAccess` — every row of every request is in this rank's device cache (one rank,
    or PCP/TP/EP without DCP: PCP all-gathers the new rows before writing them);
  * ``vllm.distributed.cp_attention.DCPKVAccess`` — the cache is split across DCP ranks by token;
  * ``vllm.hisparse.worker.HiSparseKVAccess`` — decode KV in a pinned host pool, a GPU hot set.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm.attention.metadata import MLAMetadata
from vllm.kernels.indexer import indexer_logits_paged, indexer_topk
from vllm.kernels.kv_cache import (
    read_indexer_cache,
    read_mla_cache,
    write_indexer_cache,
    write_mla_cache,
)
from vllm.kernels.sparse_mla import sparse_mla_decode

if TYPE_CHECKING:
    from vllm.attention.layer import SparseMLAAttention
    from vllm.distributed.parallel_state import GroupCoordinator


@dataclass
class IndexerQuery:
    """The indexer's queries of this rank's tokens, as the scoring kernels take them."""

    q: torch.Tensor  # [T, Hi, D] e4m3 (FP8 cache) or fp32
    scale: torch.Tensor  # [T, Hi] fp32 power-of-two scales (ones without FP8)
    w: torch.Tensor  # [T, Hi] fp32 head weights


def context_dtype(cache: torch.Tensor) -> torch.dtype:
    """Dtype of a prefill's temporary full context: bf16 on CUDA (what the MQA prefill kernel
    reads), fp32 on CPU (the reference path, exact)."""
    return torch.bfloat16 if cache.is_cuda else torch.float32


class KVAccess(ABC):
    """Where an attention layer's KV rows live, as the layer sees it."""

    @abstractmethod
    def write(
        self,
        attn: SparseMLAAttention,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        index_k: torch.Tensor | None,
        meta: MLAMetadata,
    ) -> None:
        """Store this rank's new rows: kv_c [T, R], k_pe [T, rope], index_k [T, D] or None."""

    @abstractmethod
    def prefill_context(
        self, attn: SparseMLAAttention, meta: MLAMetadata, r: int, need_index: bool
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Full context of request row r: MLA rows [S, R + rope] (dequantised) and, if
        `need_index`, the indexer keys and scales. A collective where rows are split across
        ranks: every rank calls it for every prefill request."""

    @abstractmethod
    def decode_topk(
        self, attn: SparseMLAAttention, meta: MLAMetadata, iq: IndexerQuery
    ) -> torch.Tensor:
        """Indexer top-k positions [T_dec, index_topk] of this rank's decode tokens."""

    @abstractmethod
    def decode_attend(
        self, attn: SparseMLAAttention, meta: MLAMetadata, q_abs: torch.Tensor, topk_pos
    ) -> torch.Tensor:
        """Attention [T_dec, H, R] of the absorbed queries q_abs [T_dec, H, R + rope] over their
        selected positions topk_pos [T_dec, index_topk] (−1 = none), in fp32 or in q_abs's dtype
        (the caller rounds it to the model dtype for W_UV either way)."""


def gather_new_rows(
    pcp: GroupCoordinator | None, x: torch.Tensor, meta: MLAMetadata
) -> torch.Tensor:
    """This rank's new rows [T, ...] -> every PCP rank's, padded: [N·pcp_pad, ...] (identity
    without PCP). The slot mapping lists the gathered rows in this order."""
    if pcp is None or pcp.world_size == 1:
        return x
    padded = x.new_zeros((meta.cp.pcp_pad,) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    return pcp.all_gather(padded)


def write_rows(
    attn: SparseMLAAttention,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    index_k: torch.Tensor | None,
    meta: MLAMetadata,
    idx_slot_mapping: torch.Tensor,
) -> None:
    """Write gathered new rows: MLA rows at ``meta.slot_mapping``, indexer keys at
    ``idx_slot_mapping``."""
    write_mla_cache(attn.kv_cache, kv_c, k_pe, meta.slot_mapping, meta.layout)
    if index_k is not None:
        write_indexer_cache(attn.indexer_cache, index_k, idx_slot_mapping, meta.layout)


def local_decode_topk(
    attn: SparseMLAAttention, meta: MLAMetadata, iq: IndexerQuery, block_table: torch.Tensor
) -> torch.Tensor:
    """Top-k of this rank's decode tokens against indexer keys paged by ``block_table``."""
    rows = meta.decode_rows
    # each token's own causal context: a request verifying drafts has several decode tokens
    ctx = rows(meta.positions) + 1
    logits = indexer_logits_paged(
        rows(iq.q),
        rows(iq.scale),
        rows(iq.w),
        attn.indexer_cache,
        meta.layout,
        block_table,
        rows(meta.token_req),
        ctx,
        meta.decode_ctx_bound(),
    )
    return indexer_topk(logits, ctx, meta.index_topk)


class LocalKVAccess(KVAccess):
    """Every token's KV in this rank's cache. Under PCP each rank computes a share of the new
    tokens, so the new rows are all-gathered over the PCP group before they are written."""

    def __init__(self, pcp: GroupCoordinator | None = None):
        self.pcp = pcp

    def write(self, attn, kv_c, k_pe, index_k, meta):
        g = lambda x: gather_new_rows(self.pcp, x, meta)  # noqa: E731
        idx_k = g(index_k) if index_k is not None else None
        write_rows(attn, g(kv_c), g(k_pe), idx_k, meta, meta.slot_mapping)

    def prefill_context(self, attn, meta, r, need_index):
        s = meta.seq_lens_cpu[r]
        pos = torch.arange(s, device=meta.positions.device)
        slots = meta.slots_for(torch.full_like(pos, r), pos)
        rows = read_mla_cache(attn.kv_cache, slots, meta.layout, context_dtype(attn.kv_cache))
        idx = read_indexer_cache(attn.indexer_cache, slots, meta.layout) if need_index else None
        return rows, idx

    def decode_topk(self, attn, meta, iq):
        return local_decode_topk(attn, meta, iq, meta.block_table)

    def decode_attend(self, attn, meta, q_abs, topk_pos):
        slots = meta.decode_slots(topk_pos)
        # in q's dtype: the kernel's fp32 rows rounded once, as the caller would round them
        out, _ = sparse_mla_decode(
            q_abs, attn.kv_cache, slots, meta.layout, attn.scale, out_dtype=q_abs.dtype
        )
        return out
