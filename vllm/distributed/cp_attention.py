"""Attention data access across ranks: PCP gathers of new KV, DCP-sharded prefill and decode.

DCP (SPEC §5): token p lives on DCP rank (p // I) % N. A rank's local tokens are packed: local
index j of a request sits at slot block_table[r, j // 64]·64 + j % 64 and is global position
(j // I)·N·I + rank·I + j % I.
  * prefill: every rank's shard of a request's context is all-gathered into a temporary full copy
    (raw cache rows, dequantised after the gather), attended, and freed;
  * decode, `ag_rs`: all-gather the absorbed queries (and top-k) of the DCP group, attend each over
    the local shard returning out + LSE, then an LSE-corrected reduce-scatter returns each rank's
    own rows; `a2a`: one all-to-all of (out | LSE) and a local merge. An empty shard gives LSE −inf
    and zero output;
  * the sparse indexer scores the gathered queries against the local shard; (score, global
    position) candidates are all-gathered and the global top-k re-selected (exact; a union of local
    top-k's is not).
Every rank calls every collective for every request the step's *global* data says to, so the
control flow never diverges.
"""

from __future__ import annotations

import torch

from vllm.attention.kv_access import (
    IndexerQuery,
    KVAccess,
    context_dtype,
    gather_new_rows,
    write_rows,
)
from vllm.attention.metadata import MLAMetadata
from vllm.distributed.parallel_state import ParallelContext
from vllm.kernels.indexer import indexer_logits_paged, indexer_topk, merge_topk
from vllm.kernels.kv_cache import read_indexer_cache, read_mla_cache
from vllm.kernels.merge_attn import merge_attn_states
from vllm.kernels.sparse_mla import sparse_mla_decode


def local_len(seq_len: torch.Tensor | int, n: int, i: int, rank: int):
    """Tokens of a length-`seq_len` context that DCP rank `rank` holds."""
    full, rem = seq_len // (n * i), seq_len % (n * i)
    if isinstance(rem, torch.Tensor):
        return full * i + (rem - rank * i).clamp(0, i)
    return full * i + min(max(rem - rank * i, 0), i)


def local_to_global(j: torch.Tensor, n: int, i: int, rank: int) -> torch.Tensor:
    return (j // i) * n * i + rank * i + j % i


class DCPKVAccess(KVAccess):
    """The KV cache split across the DCP group by token (and new rows gathered over PCP)."""

    def __init__(self, pc: ParallelContext, backend: str, interleave: int):
        self.backend, self.i = backend, interleave
        self.dcp, self.pcp = pc.dcp, pc.pcp
        self.n, self.rank = self.dcp.world_size, self.dcp.rank_in_group

    def write(self, attn, kv_c, k_pe, index_k, meta):
        g = lambda x: gather_new_rows(self.pcp, x, meta)  # noqa: E731
        idx_k = g(index_k) if index_k is not None else None
        write_rows(attn, g(kv_c), g(k_pe), idx_k, meta, meta.slot_mapping)

    # ---- prefill: a temporary full copy of the context -------------------------------------------
    def prefill_context(self, attn, meta: MLAMetadata, r: int, need_index: bool):
        s, bs, dev = meta.seq_lens_cpu[r], meta.layout.block_size, meta.positions.device
        lpad = -(-s // (self.n * self.i)) * self.i
        j = torch.arange(lpad, device=dev)
        valid = j < local_len(s, self.n, self.i, self.rank)
        slots = torch.where(valid, meta.block_table[r, j // bs].long() * bs + j % bs, -1)
        cache = attn.kv_cache
        raw = cache.view(-1, cache.shape[-1])[slots.clamp_min(0)]  # raw rows: bytes for FP8
        raw = raw.masked_fill(~valid.unsqueeze(1), 0)
        p = torch.arange(s, device=dev)
        owner, lidx = (p // self.i) % self.n, (p // (self.i * self.n)) * self.i + p % self.i
        full = self.dcp.all_gather_stacked(raw)[owner, lidx]  # [S, row], global order
        rows = read_mla_cache(full.unsqueeze(0), p, meta.layout, context_dtype(cache))
        idx = None
        if need_index:
            k, ks = read_indexer_cache(attn.indexer_cache, slots, meta.layout)
            k = self.dcp.all_gather_stacked(k)[owner, lidx]
            ks = self.dcp.all_gather_stacked(ks)[owner, lidx]
            idx = (k, ks)
        return rows, idx

    # ---- decode ----------------------------------------------------------------------------------
    def _gather_rows(self, x: torch.Tensor, pad: int) -> torch.Tensor:
        """[T, ...] on each rank -> [N, pad, ...] (zero padded)."""
        buf = x.new_zeros((pad,) + tuple(x.shape[1:]))
        buf[: x.shape[0]] = x
        return self.dcp.all_gather_stacked(buf)

    def decode_topk(self, attn, meta: MLAMetadata, iq: IndexerQuery):
        tok = meta.decode_tokens
        pad, n, k = meta.cp.decode_pad, self.n, meta.index_topk
        q = self._gather_rows(iq.q[tok], pad).flatten(0, 1)
        qs = self._gather_rows(iq.scale[tok], pad).flatten(0, 1)
        w = self._gather_rows(iq.w[tok], pad).flatten(0, 1)
        tr = self._gather_rows(meta.token_req[tok], pad).flatten(0, 1)
        limit = self._gather_rows(meta.positions[tok] + 1, pad).flatten(0, 1)  # 0 for padding
        ctx = local_len(limit, n, self.i, self.rank)
        longest = meta.decode_ctx_bound()
        max_ctx = max(1, local_len(longest, n, self.i, 0))
        logits = indexer_logits_paged(
            q, qs, w, attn.indexer_cache, meta.layout, meta.block_table, tr, ctx, max_ctx
        )
        local = indexer_topk(logits, ctx, k).long()  # [N·pad, K] local indices
        score = torch.where(local >= 0, logits.gather(1, local.clamp_min(0)), float("-inf"))
        gpos = torch.where(local >= 0, local_to_global(local, n, self.i, self.rank), -1)
        all_s = self.dcp.all_gather_stacked(score)  # [N_ranks, N·pad, K]
        all_p = self.dcp.all_gather_stacked(gpos)
        merged = merge_topk(all_s.permute(1, 0, 2).flatten(1), all_p.permute(1, 0, 2).flatten(1), k)
        return merged[self.rank * pad : self.rank * pad + tok.shape[0]]

    def decode_attend(self, attn, meta: MLAMetadata, q_abs, topk_pos):
        tok = meta.decode_tokens
        pad, n = meta.cp.decode_pad, self.n
        t, h = q_abs.shape[0], q_abs.shape[1]
        q = self._gather_rows(q_abs, pad).flatten(0, 1)  # [N·pad, H, D]
        pos = self._gather_rows(topk_pos.long(), pad).flatten(0, 1)
        tr = self._gather_rows(meta.token_req[tok], pad).flatten(0, 1)
        valid_row = self._gather_rows(
            torch.ones(t, dtype=torch.bool, device=q.device), pad
        ).flatten(0, 1)
        pos = torch.where(valid_row.unsqueeze(1), pos, -1)
        slots = meta.slots_for(tr.unsqueeze(1).expand_as(pos), pos)  # −1 where another rank owns it
        out, lse = sparse_mla_decode(q, attn.kv_cache, slots, meta.layout, attn.scale)
        out, lse = out.view(n, pad, h, -1), lse.view(n, pad, h)
        if self.backend == "a2a":
            packed = torch.cat([out, lse.unsqueeze(-1)], dim=-1)  # [N(dest), pad, H, d_v + 1]
            got = self.dcp.all_to_all(packed.flatten(0, 1)).view(n, pad, h, -1)  # [N(src), ...]
            merged, _ = merge_attn_states(got[..., :-1], got[..., -1])
            return merged[:t]
        all_lse = self.dcp.all_gather_stacked(lse)  # [N(src), N(dest), pad, H]
        lse_g = torch.logsumexp(all_lse, dim=0)
        wgt = torch.nan_to_num(
            torch.exp(lse - lse_g.clamp_min(torch.finfo(torch.float32).min)), nan=0.0
        )
        return self.dcp.reduce_scatter((out * wgt.unsqueeze(-1)).flatten(0, 1))[:t]
