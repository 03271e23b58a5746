"""Sigmoid-routed mixture of experts (DeepSeek-V3 / GLM-5 routing) — plain-torch references.

Routing: scores = sigmoid(x·Wᵀ) in fp32; choice uses scores + e_score_correction_bias (bias affects
the choice only); groups ranked by the sum of their top-2 biased scores, `topk_group` groups kept;
top-k experts among them; weights = the *unbiased* scores of the chosen experts, normalised to sum
to 1 (if `norm_topk_prob`), times `routed_scaling_factor`.
"""

from __future__ import annotations

import os

import torch
from torch import nn


def route_ref(
    router_logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] fp32 -> (weights [T, top_k] fp32, ids [T, top_k] int64)."""
    scores = router_logits.float().sigmoid()
    choice = scores + bias.float()
    t, e = choice.shape
    if n_group > 1:
        group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)
        group_idx = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        keep = group_mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e).bool()
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """Apply routed SwiGLU experts.

    x [T, H]; w13 [E_loc, 2I, H] (gate rows first, then up); w2 [E_loc, H, I]; ids/weights [T, k]
    with global expert ids; experts outside [expert_offset, expert_offset + E_loc) are ignored
    (their owner computes them). Returns [T, H] in x.dtype, accumulated in fp32.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = ids - expert_offset
    e_loc = w13.shape[0]
    for e in torch.unique(local[(local >= 0) & (local < e_loc)]).tolist():
        tok, slot = torch.where(local == e)
        gate, up = nn.functional.linear(x[tok], w13[e]).chunk(2, dim=-1)
        h = nn.functional.silu(gate) * up
        y = nn.functional.linear(h, w2[e]).float() * weights[tok, slot].unsqueeze(-1)
        out.index_add_(0, tok, y)
    return out.to(x.dtype)


def experts_dense(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert_offset: int = 0,
    max_bytes: int = 256 << 20,
) -> torch.Tensor:
    """:func:`experts_ref`'s result without a host sync: every local expert runs on every token,
    and each output is weighted by the token's routing weight for that expert (0 where the token
    did not choose it). Reads each local expert's weights once, as the grouped form does when most
    experts are chosen, which is the case for decode batches (T·k >= 2·E_loc). Experts go in groups
    whose [group, T, 2I] and [group, T, H] fp32 intermediates stay under ``max_bytes``."""
    t, h = x.shape
    e_loc, two_i = w13.shape[0], w13.shape[1]
    local = ids - expert_offset
    valid = (local >= 0) & (local < e_loc)
    # [T, E_loc + 1] routing weights; column E_loc collects the other ranks' experts
    dense_w = torch.zeros(t, e_loc + 1, dtype=torch.float32, device=x.device)
    dense_w.scatter_add_(
        1, torch.where(valid, local, e_loc), torch.where(valid, weights.float(), 0.0)
    )
    out = torch.zeros((t, h), dtype=torch.float32, device=x.device)
    group = max(1, max_bytes // max(1, t * (two_i + h) * 4))
    for e0 in range(0, e_loc, group):
        e1 = min(e_loc, e0 + group)
        gate, up = torch.matmul(x, w13[e0:e1].transpose(1, 2)).chunk(2, dim=-1)  # [g, T, I]
        y = torch.matmul(nn.functional.silu(gate) * up, w2[e0:e1].transpose(1, 2)).float()
        out += (y * dense_w[:, e0:e1].t().unsqueeze(-1)).sum(0)
    return out.to(x.dtype)


# decode-sized batches on CUDA take the sync-free dense form (see experts_dense)
DENSE_MAX_TOKENS = 256


def experts_forward(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """Routed experts: :func:`experts_dense` for decode-sized batches on CUDA where most local
    experts are chosen (T <= DENSE_MAX_TOKENS and T·k >= 2·E_loc: the grouped form would cost a
    host sync per chosen expert and read about the same weights), else :func:`experts_ref`.

    ``VLLM_MOE_BACKEND=grouped`` (read per call; default ``ref``) sends every CUDA batch, decode
    sizes included, to the sync-free Triton grouped GEMM (:mod:`vllm.kernels.moe_grouped`). It is
    opt-in until it has been measured on the GPU; CPU tensors are unaffected."""
    t = x.shape[0]
    if x.is_cuda and os.environ.get("VLLM_MOE_BACKEND", "ref") == "grouped":
        from vllm.kernels.moe_grouped import experts_grouped  # imports Triton

        return experts_grouped(x, w13, w2, ids, weights, expert_offset)
    if x.is_cuda and 0 < t <= DENSE_MAX_TOKENS and ids.numel() >= 2 * w13.shape[0]:
        return experts_dense(x, w13, w2, ids, weights, expert_offset)
    return experts_ref(x, w13, w2, ids, weights, expert_offset)
