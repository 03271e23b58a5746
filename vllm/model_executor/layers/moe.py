"""Sigmoid routing of the mixture of experts (DeepSeek-V3 / GLM-5 routing); the experts themselves
are the ``fused_experts`` op (``vllm/kernels/moe.py``).

Routing: scores = sigmoid(x·Wᵀ) in fp32; choice uses scores + e_score_correction_bias (bias affects
the choice only); groups ranked by the sum of their top-2 biased scores, `topk_group` groups kept;
top-k experts among them; weights = the *unbiased* scores of the chosen experts, normalised to sum
to 1 (if `norm_topk_prob`), times `routed_scaling_factor`.
"""

from __future__ import annotations

import torch


def route_tokens(
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
