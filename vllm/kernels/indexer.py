"""The lightning indexer (DSA, SPEC §2): scoring, top-k selection, and the DCP top-k merge.

    logit[t, s] = k_scale[s] · Σ_h w[t,h] · q_scale[t,h] · ReLU(q[t,h,:] · k[s,:])

``q``/``k`` are FP8 values with power-of-two scales when the KV cache is FP8, or full precision
with unit scales otherwise; ``w`` already carries n_heads^-0.5 · head_dim^-0.5. Positions past a
query's causal limit score −inf. Top-k keeps min(topk, limit) positions ordered by (score
descending, position ascending) — a total order, so every parallel layout selects the same set —
and pads with −1. CUDA tensors run the Triton kernels (``vllm/kernels/triton/indexer_logits.py``,
``topk.py``); elsewhere the references, except top-k, which selects without sorting whole rows
(:func:`topk_partial`, identical to :func:`topk_ref`).
"""

from __future__ import annotations

import torch

from vllm.kernels import is_pow2, kernel_module
from vllm.kernels.kv_cache import read_indexer_cache
from vllm.kv_cache_interface import KVCacheLayout


def indexer_logits(q, q_scale, w, k, k_scale) -> torch.Tensor:
    """Prefill scoring against one context: q [T, H, D], q_scale/w [T, H], k [S, D], k_scale [S]
    -> logits [T, S] fp32 (no mask; callers pass the causal limit to :func:`indexer_topk`).
    q and k may be ``torch.float8_e4m3fn`` (the kernel then uses FP8 tensor cores)."""
    fast = kernel_module("triton.indexer_logits", q, is_pow2(q.shape[-1]))
    if fast is not None:
        return fast.indexer_logits(q, q_scale, w, k, k_scale)
    return indexer_logits_ref(q, q_scale, w, k, k_scale)


def indexer_logits_paged(
    q, q_scale, w, cache, layout: KVCacheLayout, block_table, token_req, ctx_lens, max_ctx: int
) -> torch.Tensor:
    """Decode scoring against paged keys in *local* position space: key j of request r lives at
    slot block_table[r, j // block_size]·block_size + j % block_size. q [T, H, D]; token_req [T];
    ctx_lens [T] -> logits [T, max_ctx] fp32; columns j >= ctx_lens[t] are unspecified (the
    kernel does not write them; the reference writes −inf): read a row only below its context."""
    fast = kernel_module("triton.indexer_logits", q, is_pow2(layout.index_head_dim))
    if fast is not None:
        return fast.indexer_logits_paged(
            q, q_scale, w, cache, layout, block_table, token_req, ctx_lens, max_ctx
        )
    return indexer_logits_paged_ref(
        q, q_scale, w, cache, layout, block_table, token_req, ctx_lens, max_ctx
    )


def indexer_topk(logits: torch.Tensor, limit: torch.Tensor, topk: int) -> torch.Tensor:
    """logits [T, S], limit [T] -> int32 [T, topk]: the top-k set (ties to the lower position),
    −1 padded at the end; the order within a row is unspecified (the reference's is by score)."""
    fast = kernel_module("triton.topk", logits)
    if fast is not None:
        return fast.indexer_topk(logits, limit, topk)
    return topk_partial(logits, limit, topk)


_CHUNK = 256  # query rows per chunk of the prefill reference
_PAGED_CHUNK = 64  # decode rows per chunk: each holds [rows, max_ctx, H] fp32 dots


def indexer_logits_ref(
    q: torch.Tensor, q_scale: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor
) -> torch.Tensor:
    """q [T, H, D], q_scale [T, H], w [T, H], k [S, D], k_scale [S] -> logits [T, S] fp32.

    One matmul per head accumulated into [T, S] (a [T, S, H] product would be written, permuted
    and read back: twice the time on CPU at 16K keys)."""
    out = q.new_zeros((q.shape[0], k.shape[0]), dtype=torch.float32)
    kt = k.float().t()
    coef = w.float() * q_scale.float()
    for s in range(0, q.shape[0], _CHUNK):
        rows = out[s : s + _CHUNK]
        qs = q[s : s + _CHUNK].float()
        for h in range(q.shape[1]):
            rows.addcmul_(torch.mm(qs[:, h], kt).relu_(), coef[s : s + _CHUNK, h : h + 1])
    return out.mul_(k_scale.float().unsqueeze(0))


def topk_ref(logits: torch.Tensor, limit: torch.Tensor, topk: int) -> torch.Tensor:
    """logits [T, S] fp32, limit [T] (positions < limit are eligible) -> indices [T, topk] int32.

    Ties go to the lower position (stable sort); slots beyond min(topk, limit) are −1.
    """
    t, s = logits.shape
    pos = torch.arange(s, device=logits.device)
    masked = logits.masked_fill(pos.unsqueeze(0) >= limit.unsqueeze(1), float("-inf"))
    k = min(topk, s)
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]
    keep = torch.arange(k, device=logits.device).unsqueeze(0) < limit.clamp(max=k).unsqueeze(1)
    out = torch.full((t, topk), -1, dtype=torch.int32, device=logits.device)
    out[:, :k] = torch.where(keep, order, -1).to(torch.int32)
    return out


def topk_partial(logits: torch.Tensor, limit: torch.Tensor, topk: int) -> torch.Tensor:
    """:func:`topk_ref`'s result, same order, from a partial selection instead of a sort of every
    row (4x less time on CPU at 16K keys): the k-th largest score is the threshold, every score
    above it is in, and of the scores equal to it the lowest positions fill the rest."""
    t, s = logits.shape
    k = min(topk, s)
    pos = torch.arange(s, device=logits.device)
    masked = logits.masked_fill(pos.unsqueeze(0) >= limit.unsqueeze(1), float("-inf"))
    top = torch.topk(masked, k, dim=-1, sorted=False).values
    thr = top.amin(-1, keepdim=True)
    sel = masked >= thr
    # rows with more ties at the threshold than room: keep the lowest positions among the ties
    crowded = (sel.view(torch.uint8).sum(-1, dtype=torch.int32) > k).nonzero().squeeze(1)
    if crowded.numel():
        m, th = masked[crowded], thr[crowded]
        need = k - (top[crowded] > th).sum(-1, keepdim=True)
        tie = m == th
        sel[crowded] = (m > th) | (tie & (tie.cumsum(-1) <= need))
    cols = sel.nonzero()[:, 1].view(t, k)  # exactly k per row, positions ascending
    order = torch.sort(masked.gather(1, cols), dim=-1, descending=True, stable=True).indices
    keep = torch.arange(k, device=logits.device).unsqueeze(0) < limit.clamp(max=k).unsqueeze(1)
    out = torch.full((t, topk), -1, dtype=torch.int32, device=logits.device)
    out[:, :k] = torch.where(keep, cols.gather(1, order), -1).to(torch.int32)
    return out


def merge_topk(scores: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Global top-k from per-shard candidates: scores/positions [T, C] (position −1 = none).

    Orders by (score descending, position ascending), exactly as :func:`topk_ref` would have over
    the whole context, so the result is identical to the single-rank selection.
    """
    scores = scores.masked_fill(positions < 0, float("-inf"))
    big = torch.iinfo(torch.int64).max
    by_pos = torch.sort(positions.long().masked_fill(positions < 0, big), dim=-1, stable=True)
    scores = scores.gather(1, by_pos.indices)
    positions = positions.gather(1, by_pos.indices)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
    sel = positions.gather(1, order)
    sel = torch.where(scores.gather(1, order) == float("-inf"), -1, sel)
    out = torch.full((scores.shape[0], topk), -1, dtype=torch.int32, device=scores.device)
    out[:, : sel.shape[1]] = sel.to(torch.int32)
    return out


def indexer_logits_paged_ref(
    q, q_scale, w, cache, layout: KVCacheLayout, block_table, token_req, ctx_lens, max_ctx: int
):
    """The plain-torch reference of :func:`indexer_logits_paged`."""
    t = q.shape[0]
    out = torch.full((t, max_ctx), float("-inf"), device=q.device)
    bs = layout.block_size
    j = torch.arange(max_ctx, device=q.device)
    for s in range(0, t, _PAGED_CHUNK):
        tr = token_req[s : s + _PAGED_CHUNK].long()
        # positions past the block table (a generous max_ctx) are invalid for every row
        page = (j // bs).clamp(max=block_table.shape[1] - 1)
        slots = block_table[tr][:, page].long() * bs + j % bs  # [t, max_ctx]
        valid = j.unsqueeze(0) < ctx_lens[s : s + _PAGED_CHUNK].unsqueeze(1)
        k, ks = read_indexer_cache(cache, torch.where(valid, slots, -1), layout)
        dots = torch.einsum("thd,tsd->tsh", q[s : s + _PAGED_CHUNK].float(), k).relu_()
        coef = (w[s : s + _PAGED_CHUNK].float() * q_scale[s : s + _PAGED_CHUNK].float()).unsqueeze(
            1
        )
        logit = (dots * coef).sum(-1) * ks
        out[s : s + _PAGED_CHUNK] = logit.masked_fill(~valid, float("-inf"))
    return out


def indexer_logits_cost(num_q: int, num_k: int, heads: int, dim: int) -> tuple[int, int]:
    """(flops, bytes) of the FP8 logits: QK per head plus the weighted head sum; bytes read once."""
    flops = 2 * num_q * num_k * heads * dim + 2 * num_q * num_k * heads
    nbytes = num_q * heads * (dim + 8) + num_k * (dim + 4) + num_q * num_k * 4
    return flops, nbytes


def indexer_logits_paged_cost(
    num_q: int, ctx: int, heads: int = 32, dim: int = 128, key_bytes: int = 132
) -> tuple[int, int]:
    """(flops, bytes) of decode scoring: every token reads its request's ctx keys (+scales)."""
    flops = 2 * num_q * ctx * heads * (dim + 1)
    nbytes = num_q * (heads * (dim + 8) + ctx * (key_bytes + 4))
    return flops, nbytes


def topk_cost(num_rows: int, num_cols: int, topk: int = 2048, causal: bool = False):
    """(flops, bytes): no matrix work; the eligible logits read once from HBM, the indices written.
    ``causal``: the rows are the last num_rows queries of a num_cols context (limits S−T+1..S)."""
    eligible = num_rows * num_cols - (num_rows * (num_rows - 1) // 2 if causal else 0)
    return 0, eligible * 4 + num_rows * (topk * 4 + 4)
