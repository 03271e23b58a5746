"""Sigmoid routing of the mixture of experts (DeepSeek-V3 / GLM-5 routing); the experts themselves
are the ``fused_experts`` op (``vllm/kernels/moe.py``).

Routing: scores = sigmoid(x·Wᵀ) in fp32; choice uses scores + e_score_correction_bias (bias affects
the choice only); groups ranked by the sum of their top-2 biased scores, `topk_group` groups kept;
top-k experts among them; weights = the *unbiased* scores of the chosen experts, normalised to sum
to 1 (if `norm_topk_prob`), times `routed_scaling_factor`.
"""

from __future__ import annotations

import os

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


_side_streams: dict[int, torch.cuda.Stream] = {}


def shared_experts_stream(x: torch.Tensor) -> torch.cuda.Stream | None:
    """The CUDA stream the shared expert runs on beside the router and the routed experts, or
    None (run it in line): on CUDA, up to ``VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD`` tokens
    (256), unless ``VLLM_DISABLE_SHARED_EXPERTS_STREAM=1`` (upstream vLLM's names and defaults).
    At decode sizes the shared expert's narrow GEMMs each carry a few µs of fixed cost and the
    router's fp32 GEMM runs on the SIMT units: side by side, one hides the other. One stream per
    device, made at first use; the environment is read at each call (a capture sees the value of
    its own time)."""
    if not x.is_cuda or x.shape[0] == 0:
        return None
    if os.environ.get("VLLM_DISABLE_SHARED_EXPERTS_STREAM", "0").lower() in ("1", "true"):
        return None
    if x.shape[0] > int(os.environ.get("VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD", "256")):
        return None
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    s = _side_streams.get(dev)
    if s is None:
        s = _side_streams[dev] = torch.cuda.Stream(device=dev)
    return s
