"""The lightning indexer's scoring and top-k selection (DSA), plain-torch references.

    logit[t, s] = k_scale[s] · Σ_h w[t,h] · q_scale[t,h] · ReLU(q[t,h,:] · k[s,:])

``q``/``k`` are FP8 values (as fp32) with power-of-two scales when the KV cache is FP8, or full
precision with unit scales otherwise; ``w`` already carries n_heads^-0.5 · head_dim^-0.5.
Positions past a query's causal limit score −inf. Top-k keeps min(topk, limit) positions ordered by
(score descending, position ascending) — a total order, so every parallel layout selects the same
set — and pads with −1.
"""

from __future__ import annotations

import torch

_CHUNK = 256


def indexer_logits_ref(
    q: torch.Tensor, q_scale: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor
) -> torch.Tensor:
    """q [T, H, D], q_scale [T, H], w [T, H], k [S, D], k_scale [S] -> logits [T, S] fp32."""
    out = q.new_empty((q.shape[0], k.shape[0]), dtype=torch.float32)
    kf = k.float()
    for s in range(0, q.shape[0], _CHUNK):
        dots = torch.einsum("thd,sd->tsh", q[s : s + _CHUNK].float(), kf).relu_()
        coef = (w[s : s + _CHUNK].float() * q_scale[s : s + _CHUNK].float()).unsqueeze(1)
        out[s : s + _CHUNK] = (dots * coef).sum(-1) * k_scale.float().unsqueeze(0)
    return out


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


def merge_topk_ref(scores: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
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


def indexer_logits_cost(num_q: int, num_k: int, heads: int, dim: int) -> tuple[int, int]:
    """(flops, bytes) of the FP8 logits: QK per head plus the weighted head sum; bytes read once."""
    flops = 2 * num_q * num_k * heads * dim + 2 * num_q * num_k * heads
    nbytes = num_q * heads * (dim + 8) + num_k * (dim + 4) + num_q * num_k * 4
    return flops, nbytes
