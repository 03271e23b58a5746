"""Sparse MLA attention in the absorbed (MQA) form: every KV row serves all heads.

Reference semantics (fp32):  for token t, head h, selected rows r ∈ S_t (slot != −1)
    s[t,h,r]  = sm_scale · q[t,h,:] · kv[r,:]                       (over all kv_lora + rope dims)
    lse[t,h]  = log Σ_r exp(s[t,h,r])                               (natural log; −inf if S_t = ∅)
    out[t,h]  = Σ_r exp(s[t,h,r] − lse[t,h]) · kv[r, :kv_lora_rank] (zeros if S_t = ∅)
"""

from __future__ import annotations

import torch

from vllm.attention.kv_cache import KVCacheLayout, read_mla_cache_ref

_CHUNK = 64  # query tokens per chunk: bounds the [chunk, topk, 576] gathered rows


def sparse_mla_attend_ref(
    q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sm_scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D]; kv [T, K, D] fp32 rows (already gathered); valid [T, K] bool.

    Returns out [T, H, d_v] fp32 and lse [T, H] fp32.
    """
    scores = torch.einsum("thd,tkd->thk", q.float(), kv) * sm_scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [T, H]
    p = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min))
    p = torch.nan_to_num(p, nan=0.0)
    out = torch.einsum("thk,tkd->thd", p, kv[..., :d_v])
    return out, lse


def sparse_mla_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    layout: KVCacheLayout,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over a paged cache (decode, and MQA prefill over a paged or flat cache).

    q: [T, H, kv_lora_rank + rope] (absorbed query); cache: MLA cache of ``layout``;
    indices: [T, K] int global slots, −1 = none. Returns out [T, H, kv_lora_rank] fp32 and
    lse [T, H] fp32 (−inf and zeros for a token with no valid slot).
    """
    t, h, _ = q.shape
    out = q.new_zeros((t, h, layout.kv_lora_rank), dtype=torch.float32)
    lse = q.new_full((t, h), float("-inf"), dtype=torch.float32)
    for s in range(0, t, _CHUNK):
        idx = indices[s : s + _CHUNK]
        kv = read_mla_cache_ref(cache, idx, layout)
        o, lse_c = sparse_mla_attend_ref(
            q[s : s + _CHUNK], kv, idx >= 0, sm_scale, layout.kv_lora_rank
        )
        out[s : s + _CHUNK], lse[s : s + _CHUNK] = o, lse_c
    return out, lse


def sparse_mla_cost(
    num_tokens: int,
    num_heads: int,
    topk: int,
    d_qk: int,
    d_v: int,
    row_bytes: int,
    q_bytes: int = 2,
    out_bytes: int = 2,
) -> tuple[int, int]:
    """(flops, bytes) of sparse MLA: QK over d_qk and PV over d_v for every selected row and head;
    bytes = gathered rows + indices + q + out (+ lse)."""
    flops = 2 * num_tokens * num_heads * topk * (d_qk + d_v)
    nbytes = num_tokens * topk * (row_bytes + 4) + num_tokens * num_heads * (
        d_qk * q_bytes + d_v * out_bytes + 4
    )
    return flops, nbytes


def merge_attn_states_ref(
    outs: torch.Tensor, lses: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine N partial attentions over disjoint key sets (DCP shards).

    outs [N, ..., d_v], lses [N, ...]: lse_g = logsumexp_i lse_i; out = Σ_i exp(lse_i − lse_g)·out_i.
    A shard with lse −inf contributes nothing; if every shard is empty the result is zeros, −inf.
    """
    lse_g = torch.logsumexp(lses, dim=0)
    w = torch.exp(lses - lse_g.unsqueeze(0).clamp_min(torch.finfo(torch.float32).min))
    w = torch.nan_to_num(w, nan=0.0)
    return (w.unsqueeze(-1) * outs).sum(dim=0), lse_g
