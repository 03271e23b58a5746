"""Sigmoid routing of the mixture of experts (DeepSeek-V3 / GLM-5 routing); the experts themselves
are the ``fused_experts`` op (``vllm/kernels/moe.py``).

Routing: scores = sigmoid(x·Wᵀ) in fp32; choice uses scores + e_score_correction_bias (bias affects
the choice only); groups ranked by the sum of their top-2 biased scores, `topk_group` groups kept;
top-k experts among them; weights = the *unbiased* scores of the chosen experts, normalised to sum
to 1 (if `norm_topk_prob`), times `routed_scaling_factor`.
"""

from __future__ import annotations

import torch

from vllm.kernels.moe import route_topk


def route_tokens(
    router_logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] fp32 -> (weights [T, top_k] fp32, ids [T, top_k] int64): the
    ``route_topk`` op (one Triton kernel on CUDA)."""
    return route_topk(router_logits, bias, top_k, n_group, topk_group, norm_topk_prob, scaling)
