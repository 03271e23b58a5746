"""The sparse-MLA attention layer: cache writes, top-k selection, and attention.

The model computes projections; this layer owns everything that touches the KV cache:
  1. write the step's new latent rows (c_kv | roped k_pe) and indexer keys into the paged caches;
  2. pick each query's positions: the indexer's top-k on "full" layers, the previous full layer's
     choice on "shared" layers, every causal position when the context is no longer than
     `index_topk`;
  3. attend. Prefill requests read their whole context as one flat tensor (the temporary full copy
     that PCP×DCP gathers) and use either the dense MHA form (context ≤ index_topk, unless
     `sparse_mla_force_mqa`) or the absorbed MQA form over the selected rows; decode tokens use the
     absorbed form over the paged cache.

Where the rows live (this rank, DCP shards, a host pool) is the business of the layer's
``kv_access`` (`vllm/attention/kv_access.py`), bound once at start-up by the model runner.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from vllm.attention.kv_access import IndexerQuery, KVAccess, LocalKVAccess
from vllm.attention.metadata import MLAMetadata
from vllm.kernels.indexer import indexer_logits, indexer_topk
from vllm.kernels.kv_cache import quantize_indexer_fp8
from vllm.kernels.sparse_mla import sparse_mla_prefill

# the dense prefill's SDPA backends, in torch's order of preference (cuDNN's left out: see
# SparseMLAAttention._dense_attend_sdpa)
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class IndexerInputs:
    q: torch.Tensor  # [T, Hi, D] roped (rope dims first) and Hadamard-rotated
    w: torch.Tensor  # [T, Hi] fp32 head weights, × Hi^-0.5 · D^-0.5
    k: torch.Tensor  # [T, D] roped and rotated key


# Prefill scores a run of queries against its keys as one [rows, keys] fp32 logits matrix; runs
# are cut into row pieces so that matrix stays under this many bytes (2K queries at 1M keys would
# otherwise take 8.6 GB)
PREFILL_LOGITS_MAX_BYTES = 1 << 30
# prefill query tokens per sparse-attention call (bounds the fp32 absorbed queries and outputs)
PREFILL_ATTN_MAX_TOKENS = 8192


class SparseMLAAttention(nn.Module):
    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        qk_nope: int,
        v_dim: int,
        kv_lora_rank: int,
        rope_dim: int,
        scale: float,
        has_indexer: bool,
        force_mqa: bool = False,
    ):
        super().__init__()
        self.layer_idx, self.num_heads = layer_idx, num_heads
        self.qk_nope, self.v_dim, self.kv_lora_rank, self.rope_dim = (
            qk_nope,
            v_dim,
            kv_lora_rank,
            rope_dim,
        )
        self.scale, self.has_indexer, self.force_mqa = scale, has_indexer, force_mqa
        self.w_uk: torch.Tensor | None = None  # [H, qk_nope, R]
        self.w_uv: torch.Tensor | None = None  # [H, v_dim, R]
        # bound by the model runner at start-up
        self.kv_cache: torch.Tensor | None = None
        self.indexer_cache: torch.Tensor | None = None
        self.kv_access: KVAccess = LocalKVAccess()

    def bind_kv(
        self, kv_cache: torch.Tensor, indexer_cache: torch.Tensor | None, kv_access: KVAccess
    ) -> None:
        """The layer's caches (``indexer_cache`` None without an indexer) and how to reach
        the KV rows (:mod:`vllm.attention.kv_access`)."""
        self.kv_cache, self.indexer_cache, self.kv_access = kv_cache, indexer_cache, kv_access

    def set_kv_b(self, kv_b: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        """kv_b_proj weight [H·(qk_nope + v), R] -> absorbed W_UK, W_UV in ``dtype`` (the model's:
        bf16 on the GPU, where the absorption GEMMs are batched bf16 matmuls with fp32
        accumulation, as upstream's MLA; fp32 models keep fp32)."""
        w = kv_b.view(self.num_heads, self.qk_nope + self.v_dim, self.kv_lora_rank).to(dtype)
        self.w_uk = w[:, : self.qk_nope].contiguous()
        self.w_uv = w[:, self.qk_nope :].contiguous()

    # ------------------------------------------------------------------------------------------
    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        idx: IndexerInputs | None,
        prev_topk: torch.Tensor | None,
        meta: MLAMetadata,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q_nope [T, H, nope], q_pe [T, H, rope] (roped), kv_c [T, R] (normed), k_pe [T, rope]
        (roped). Returns attention output [T, H, v_dim] in q's dtype (written into ``out`` when
        given: a piecewise graph's static buffer) and the top-k positions [T, index_topk] (−1
        padded; rows of dense/short tokens are −1) for shared layers."""
        self.kv_access.write(self, kv_c, k_pe, idx.k if idx is not None else None, meta)
        iq = None
        # the indexer's queries are read only by decode tokens and sparse prefills: a step of
        # dense prompts (each no longer than index_topk) skips their quantisation (both facts are
        # global under PCP and DCP: every rank decides alike)
        needs_iq = meta.decode_tokens is not None or any(
            p and not (d and not self.force_mqa)
            for p, d in zip(meta.is_prefill_cpu, meta.use_dense_cpu, strict=True)
        )
        if idx is not None and needs_iq:
            if meta.layout.is_fp8:
                qv, qs = quantize_indexer_fp8(idx.q)
                # e4m3 values as they are: the fast kernels use FP8 tensor-core dots
                iq = IndexerQuery(qv, qs, idx.w.float())
            else:
                ones = torch.ones(idx.q.shape[:2], device=idx.q.device)
                iq = IndexerQuery(idx.q.float(), ones, idx.w.float())
        # in q's dtype: each row is computed in fp32 and rounded once, as a whole-batch fp32 buffer
        # cast at the end would be, without holding T × H × 512 fp32 values
        shape = (q_nope.shape[0], self.num_heads, self.v_dim)
        # every request's rows are written below: a prefill request's by _prefill, the others'
        # (decode_tokens: every row of each request not prefilling) by _decode; only rows past
        # the last request's (none in the runner's steps) are zeroed. When every row decodes the
        # top-k a full layer computes needs no -1 fill either
        every = meta.decode_is_all
        if out is None:
            out = torch.empty(shape, dtype=q_nope.dtype, device=q_nope.device)
        elif out.shape != shape or out.dtype != q_nope.dtype:
            raise ValueError(f"out {tuple(out.shape)} {out.dtype}: {shape} {q_nope.dtype}")
        end = meta.query_start_loc_cpu[-1]
        if end < shape[0]:
            out[end:].zero_()
        topk = prev_topk
        if topk is None:
            kshape = (q_nope.shape[0], meta.index_topk)
            if every and iq is not None:
                topk = torch.empty(kshape, dtype=torch.int32, device=q_nope.device)
            else:
                topk = torch.full(kshape, -1, dtype=torch.int32, device=q_nope.device)
        self._prefill(meta, q_nope, q_pe, iq, topk, out)
        self._decode(meta, q_nope, q_pe, iq, topk, out)
        return out, topk

    def _absorb(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """MQA query [T, H, kv_lora_rank + rope] in W_UK's dtype: q_nope absorbed through W_UK,
        then q_pe. The attention kernels take bf16 queries (their MMAs round fp32 ones anyway).
        The batched GEMM writes its head-major product straight into the query's first R
        columns (no concatenation reading it back)."""
        w = self.w_uk
        t, r = q_nope.shape[0], self.kv_lora_rank
        q = torch.empty((t, self.num_heads, r + q_pe.shape[-1]), dtype=w.dtype, device=w.device)
        torch.bmm(q_nope.to(w.dtype).transpose(0, 1), w, out=q[..., :r].transpose(0, 1))
        q[..., r:] = q_pe
        return q

    def _unabsorb(self, o: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output over the latent rows [T, H, R] -> [T, H, v] through W_UV, written
        into ``out`` (a [T, H, v] tensor of W_UV's dtype) when given."""
        w = self.w_uv
        o = o.to(w.dtype).transpose(0, 1)  # [H, T, R]
        if out is None:
            return torch.bmm(o, w.transpose(1, 2)).transpose(0, 1)
        torch.bmm(o, w.transpose(1, 2), out=out.transpose(0, 1))
        return out

    def _needs_scoring(self, meta: MLAMetadata, pos: torch.Tensor) -> torch.Tensor:
        return pos + 1 > meta.index_topk

    def _all_positions(self, meta: MLAMetadata, pos: torch.Tensor) -> torch.Tensor:
        ar = torch.arange(meta.index_topk, device=pos.device)
        return torch.where(ar.unsqueeze(0) <= pos.unsqueeze(1), ar, -1).to(torch.int32)

    def _prefill(self, meta, q_nope, q_pe, iq, topk, out):
        for r in range(meta.num_reqs):
            if not meta.is_prefill_cpu[r]:
                continue
            lo, hi = meta.query_start_loc_cpu[r], meta.query_start_loc_cpu[r + 1]
            dense = meta.use_dense_cpu[r] and not self.force_mqa
            need_index = iq is not None and not dense
            # collective under PCP×DCP: every rank calls it for every prefill request
            rows, ikeys = self.kv_access.prefill_context(self, meta, r, need_index)
            if hi == lo:
                continue
            pos = meta.positions[lo:hi]
            if dense:
                tail = meta.positions_cpu is not None and _is_tail(
                    meta.positions_cpu[lo:hi], rows.shape[0]
                )
                out[lo:hi] = self._dense_attend(q_nope[lo:hi], q_pe[lo:hi], rows, pos, tail)
                continue
            if iq is not None:
                sel = self._all_positions(meta, pos)
                score = self._needs_scoring(meta, pos)
                # decided on the host when positions are known there (no device sync)
                if meta.positions_cpu is not None:
                    any_score = bool((meta.positions_cpu[lo:hi] + 1 > meta.index_topk).any())
                else:
                    any_score = bool(score.any())
                if any_score:
                    chosen = self._prefill_topk(meta, iq, ikeys, lo, hi, pos)
                    sel = torch.where(score.unsqueeze(1), chosen, sel)
                topk[lo:hi] = sel
            # in pieces: the fp32 absorbed queries and outputs take ~0.4 MB per token at 64 heads
            for a in range(lo, hi, PREFILL_ATTN_MAX_TOKENS):
                b = min(hi, a + PREFILL_ATTN_MAX_TOKENS)
                o, _ = sparse_mla_prefill(
                    self._absorb(q_nope[a:b], q_pe[a:b]),
                    rows,
                    topk[a:b],
                    self.scale,
                    self.kv_lora_rank,
                )
                out[a:b] = self._unabsorb(o)

    def _prefill_topk(self, meta, iq, ikeys, lo, hi, pos):
        """Indexer top-k for query tokens [lo, hi) of one request. Each run of consecutive
        positions (a PCP chunk, or the whole chunk on one rank) scores only the keys up to its last
        position: causal work, which the PCP V pattern then balances."""
        k, ks = ikeys
        out = torch.empty((hi - lo, meta.index_topk), dtype=torch.int32, device=pos.device)
        if meta.positions_cpu is None:
            runs, lasts = [(0, hi - lo)], [k.shape[0]]
        else:
            p = meta.positions_cpu[lo:hi]
            cuts = (np.nonzero(np.diff(p) != 1)[0] + 1).tolist()
            runs = list(zip([0] + cuts, cuts + [hi - lo], strict=True))
            lasts = [int(p[b - 1]) + 1 for _, b in runs]
        pieces = []
        for (a, b), last in zip(runs, lasts, strict=True):
            rows = max(1, PREFILL_LOGITS_MAX_BYTES // (4 * max(last, 1)))
            for a2 in range(a, b, rows):
                b2 = min(b, a2 + rows)
                # a piece of a run of consecutive positions scores keys up to its own last one
                last2 = last if b2 == b or meta.positions_cpu is None else last - (b - b2)
                pieces.append((a2, b2, last2))
        for a, b, last in pieces:
            logits = indexer_logits(
                iq.q[lo + a : lo + b],
                iq.scale[lo + a : lo + b],
                iq.w[lo + a : lo + b],
                k[:last],
                ks[:last],
            )
            out[a:b] = indexer_topk(logits, pos[a:b] + 1, meta.index_topk)
        return out

    def _decode(self, meta, q_nope, q_pe, iq, topk, out):
        tok = meta.decode_tokens
        if tok is None:  # no request on the decode path (a global fact: no rank calls below)
            return
        every, rows = meta.decode_is_all, meta.decode_rows
        # under DCP the gathered queries of other ranks are scored too: always call (collective)
        if iq is not None:
            pos = rows(meta.positions)
            sel = self._all_positions(meta, pos)
            scored = self.kv_access.decode_topk(self, meta, iq)
            needs = self._needs_scoring(meta, pos).unsqueeze(1)
            if every:
                torch.where(needs, scored.to(topk.dtype), sel, out=topk)
            else:
                topk[tok] = torch.where(needs, scored, sel)
        q_abs = self._absorb(rows(q_nope), rows(q_pe))
        o = self.kv_access.decode_attend(self, meta, q_abs, rows(topk))
        if every and out.dtype == self.w_uv.dtype:
            self._unabsorb(o, out)
        else:
            out[tok] = self._unabsorb(o).to(out.dtype)

    def _dense_attend(self, q_nope, q_pe, rows, pos, tail: bool = False):
        """MHA form over the full context rows [S, R + rope]: K/V expanded per head through
        W_UK/W_UV. bf16/fp16 queries take the fused SDPA kernels (flash attention on the GPU when
        the queries are the context's last T positions, ``tail``); fp32 ones the reference."""
        if q_nope.dtype in (torch.bfloat16, torch.float16):
            return self._dense_attend_sdpa(q_nope, q_pe, rows, pos, tail)
        return self._dense_attend_fp32(q_nope, q_pe, rows, pos)

    def _dense_attend_sdpa(self, q_nope, q_pe, rows, pos, tail: bool):
        dt, h, s = q_nope.dtype, self.num_heads, rows.shape[0]
        r = self.kv_lora_rank
        c, kpe = rows[:, :r].to(dt), rows[:, r:].to(dt)
        # token-major [S, H, d] operands (one GEMM each, no permuted copies): the layout flash
        # attention reads natively ([B, S, H, d] with the head dim contiguous)
        # K [S, H, nope + rope] written in place: each head's GEMM into its nope columns (a
        # batched GEMM with a strided output, c shared by every head), the rope key broadcast
        # into the rest (no concatenation reading the GEMM's output back)
        k = torch.empty((s, h, self.qk_nope + kpe.shape[-1]), dtype=dt, device=c.device)
        torch.bmm(
            c.unsqueeze(0).expand(h, s, r),
            self.w_uk.to(dt).transpose(1, 2),
            out=k[..., : self.qk_nope].transpose(0, 1),
        )
        k[..., self.qk_nope :] = kpe.unsqueeze(1)
        v = torch.mm(c, self.w_uv.to(dt).view(h * self.v_dim, r).t()).view(s, h, self.v_dim)
        q = joined(q_nope, q_pe)  # the model's [T, H, nope + rope] query, rotated in place
        if q is None:
            q = torch.cat([q_nope, q_pe.to(dt)], -1)
        t = q.shape[0]
        # 4-D [1, H, ., .] views: the fused kernels take no other rank (3-D inputs fall back to
        # the math path, which materialises the scores)
        q, k, v = (a.transpose(0, 1).unsqueeze(0) for a in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        # not cuDNN's: it builds and compiles (NVRTC) a graph for every new (T, S), and a
        # server's chunks come in every length: tens of ms inside each step, half of a C = 64
        # run's worker time on an H100. Flash attention takes any length as it is.
        with sdpa_kernel(_SDPA_BACKENDS):
            if tail and t == s:  # the whole context: plain causal
                o = sdpa(q, k, v, is_causal=True, scale=self.scale)
            elif tail:  # query i at position S − T + i: causal, aligned to the last key
                from torch.nn.attention.bias import causal_lower_right

                o = sdpa(q, k, v, causal_lower_right(t, s), scale=self.scale)
            else:
                mask = torch.arange(s, device=pos.device).unsqueeze(0) <= pos.unsqueeze(1)
                o = sdpa(q, k, v, mask, scale=self.scale)
        return o[0].transpose(0, 1)  # [T, H, v]

    def _dense_attend_fp32(self, q_nope, q_pe, rows, pos):
        """The MHA form in fp32 (fp32 models, and the fused path's reference in the tests)."""
        rows = rows.float()
        c, kpe = rows[:, : self.kv_lora_rank], rows[:, self.kv_lora_rank :]
        k_nope = torch.einsum("sr,hnr->hsn", c, self.w_uk.float())  # [H, S, nope]
        v = torch.einsum("sr,hvr->hsv", c, self.w_uv.float())  # [H, S, v]
        scores = torch.einsum("thn,hsn->ths", q_nope.float(), k_nope)
        scores = scores + torch.einsum("thp,sp->ths", q_pe.float(), kpe)
        s = torch.arange(rows.shape[0], device=rows.device)
        scores = scores.mul(self.scale).masked_fill(
            (s.unsqueeze(0) > pos.unsqueeze(1)).unsqueeze(1), float("-inf")
        )
        p = torch.softmax(scores, dim=-1)
        return torch.einsum("ths,hsv->thv", p, v)


def joined(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """The tensor [..., n + m] whose last dim a [..., n] and b [..., m] split (adjacent views of
    one tensor with the same strides), as a view; None if they are not."""
    if (
        a.dtype != b.dtype
        or a.shape[:-1] != b.shape[:-1]
        or a.stride() != b.stride()
        or a.stride(-1) != 1
        or b.data_ptr() != a.data_ptr() + a.shape[-1] * a.element_size()
    ):
        return None
    width = a.shape[-1] + b.shape[-1]
    span = width  # elements under each stride, innermost first: rows must not overlap
    for st, n in sorted(zip(a.stride()[:-1], a.shape[:-1], strict=True)):
        if n > 1 and st < span:
            return None
        span = max(span, st * n)
    return a.as_strided((*a.shape[:-1], width), a.stride())


def _is_tail(positions: np.ndarray, num_keys: int) -> bool:
    """Positions are the last len(positions) of num_keys, in order (a prefill chunk on one rank)."""
    n = len(positions)
    return n > 0 and int(positions[0]) == num_keys - n and bool((np.diff(positions) == 1).all())
