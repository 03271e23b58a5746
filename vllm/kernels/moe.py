"""Routed SwiGLU experts (the MoE layer's expert computation, after routing).

    out[t] = Σ_j weights[t, j] · (silu(x[t]·gateᵀ) * (x[t]·upᵀ)) · w2ᵀ   (local experts; fp32 sum)

``fused_experts`` picks, per call: on CUDA, the sync-free dense form (:func:`experts_dense`) for
decode-sized batches where most local experts are chosen (T <= DENSE_MAX_TOKENS and
T·k >= 2·E_loc), else the Triton grouped GEMM (``vllm/kernels/triton/moe_grouped.py``, sync-free
and CUDA-graph capturable). Measured on an H200 at GLM-5.3 expert shapes (32 local experts, top-8):
dense 0.676 / 0.818 ms against grouped 0.696 / 1.020 ms at 16 / 64 tokens; grouped 1.097 / 2.405 ms
at 256 / 4096 tokens against 6.04 / 6.35 ms for the reference's per-expert loop. Elsewhere
:func:`experts_ref`, the reference (a host sync and six launches per chosen expert).

FP8 experts (e4m3 w13/w2 with block scales, ``w13_scale``/``w2_scale``): on Hopper, for prefill
batches (:func:`vllm.kernels.moe_cutlass.takes`) where ``vllm._C`` has it, CUTLASS's grouped GEMM
(``vllm/kernels/moe_cutlass.py``); otherwise on CUDA the Triton FP8 grouped GEMM (``vllm/kernels/triton/moe_grouped_fp8.py``: weights stay e4m3, activations quantised
per token-group of 128, SiLU·up fused into the first GEMM's epilogue), elsewhere the reference,
which runs each chosen expert through :func:`vllm.kernels.fp8_gemm.fp8_block_linear_ref`.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.kernels import kernel_module, moe_cutlass, use_kernels
from vllm.kernels.fp8_gemm import FP8_DTYPE, fp8_block_linear_ref

# decode-sized batches on CUDA take the dense form up to here (it reads every local expert once)
DENSE_MAX_TOKENS = 64


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert_offset: int = 0,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    num_experts: int | None = None,
    x_quant: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Apply routed SwiGLU experts (contract: :func:`experts_ref`). ``num_experts``: the model's
    routed experts (a tiling hint when this rank holds only some of them; no effect on results).
    ``x_quant``: for e4m3 experts, x's per-token-group quantisation made by its producer (the
    bytes ``per_token_group_quant_fp8`` gives: the same result), read instead of quantising x."""
    if w13.dtype == FP8_DTYPE:
        _check_fp8(w13, w2, w13_scale, w2_scale)
        if (
            use_kernels(x)
            and moe_cutlass.takes(ids, w13.shape[0], num_experts)
            and moe_cutlass.unavailable(x, w13, w2) is None
        ):
            return moe_cutlass.experts_cutlass_fp8(
                x, w13, w2, ids, weights, expert_offset, w13_scale, w2_scale, x_quant=x_quant
            )
        fast = kernel_module("triton.moe_grouped_fp8", x)
        if fast is not None:
            return fast.experts_grouped_fp8(
                x, w13, w2, ids, weights, expert_offset, w13_scale, w2_scale,
                num_experts=num_experts, x_quant=x_quant,
            )  # fmt: skip
        return experts_ref(x, w13, w2, ids, weights, expert_offset, w13_scale, w2_scale)
    if use_kernels(x) and 0 < x.shape[0] <= DENSE_MAX_TOKENS and ids.numel() >= 2 * w13.shape[0]:
        return experts_dense(x, w13, w2, ids, weights, expert_offset)
    fast = kernel_module("triton.moe_grouped", x, w13.dtype == x.dtype == w2.dtype)
    if fast is not None:
        return fast.experts_grouped(x, w13, w2, ids, weights, expert_offset)
    return experts_ref(x, w13, w2, ids, weights, expert_offset)


def route_topk(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    norm: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid routing (DeepSeek-V3 / GLM-5): logits [T, E] fp32 -> (weights [T, top_k] fp32,
    ids [T, top_k] int64, by decreasing biased score). scores = sigmoid(logits); the choice
    ranks scores + bias (groups of E / n_group ranked by the sum of their top-2, ``topk_group``
    kept); weights = the chosen experts' unbiased scores, normalised to sum to 1 if ``norm``,
    times ``scaling``. One Triton kernel on CUDA without groups (GLM-5.3's n_group = 1): the same
    ids (ties to the lower expert id; the reference's tie order is torch.topk's), weights
    within an ulp (the sum's order); :func:`route_topk_ref` elsewhere."""
    ok = (
        (n_group == 1 or topk_group >= n_group)
        and top_k >= 1
        and top_k & (top_k - 1) == 0
        and logits.dim() == 2
        and logits.dtype == torch.float32
        and logits.stride(-1) == 1
        and top_k <= logits.shape[-1] <= 4096
    )
    fast = kernel_module("triton.moe_route", logits, ok)
    if fast is not None:
        return fast.route_topk(logits, bias, top_k, norm, scaling)
    return route_topk_ref(logits, bias, top_k, n_group, topk_group, norm, scaling)


def route_topk_ref(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    norm: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.float().sigmoid()
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
    if norm:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def fp8_scale_shapes(
    num_local_experts: int, hidden: int, inter: int, block: int = 128
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Shapes of (w13_scale, w2_scale) for e4m3 experts w13 [E, 2I, H], w2 [E, H, I]:
    [E, 2·ceil(I/128), ceil(H/128)] (gate's row blocks, then up's) and
    [E, ceil(H/128), ceil(I/128)]."""
    gi, gh = -(-inter // block), -(-hidden // block)
    return (num_local_experts, 2 * gi, gh), (num_local_experts, gh, gi)


def _check_fp8(w13, w2, w13_scale, w2_scale) -> None:
    e_loc, two_i, h = w13.shape
    if w2.dtype != FP8_DTYPE or w13_scale is None or w2_scale is None:
        raise ValueError("e4m3 experts need e4m3 w13 and w2 and both w13_scale and w2_scale")
    if w13_scale.dtype != torch.float32 or w2_scale.dtype != torch.float32:
        raise ValueError(f"expert scales must be float32, got {w13_scale.dtype} / {w2_scale.dtype}")
    s13, s2 = fp8_scale_shapes(e_loc, h, two_i // 2)
    if tuple(w13_scale.shape) != s13 or tuple(w2_scale.shape) != s2:
        raise ValueError(
            f"w13_scale {tuple(w13_scale.shape)} / w2_scale {tuple(w2_scale.shape)}: expected "
            f"{s13} / {s2} for w13 {tuple(w13.shape)} (see experts_ref)"
        )


def experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert_offset: int = 0,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply routed SwiGLU experts.

    x [T, H]; w13 [E_loc, 2I, H] (gate rows first, then up); w2 [E_loc, H, I]; ids/weights [T, k]
    with global expert ids; experts outside [expert_offset, expert_offset + E_loc) are ignored
    (their owner computes them). Returns [T, H] in x.dtype, accumulated in fp32.

    FP8 experts: w13 and w2 e4m3 with fp32 block scales of 128 × 128 tiles,
    w13_scale [E_loc, 2·ceil(I/128), ceil(H/128)] and w2_scale [E_loc, ceil(H/128), ceil(I/128)]
    (:func:`fp8_scale_shapes`). w13's scale rows are per half: gate row r (0 <= r < I) uses scale
    row r // 128 and up row I + r uses scale row ceil(I/128) + r // 128, so gate and up never
    share a tile even when I is not a multiple of 128 (when it is, this is simply gate's scales
    concatenated with up's). Columns: H column c uses scale column c // 128; w2's column (I) c
    uses c // 128 of this rank's I. A loader whose TP shard of I starts inside a 128-block and
    spans two of the checkpoint's blocks cannot express that with one scale per local block and
    must requantise the shard. Semantics: each chosen expert is three
    :func:`~vllm.kernels.fp8_gemm.fp8_block_linear_ref` calls in fp32 (gate, up on x; down on
    SiLU(gate)·up), so x and the intermediate are quantised per token-group of 128 and nothing is
    rounded to x.dtype before the output (the kernel never holds the intermediate in 16 bits).
    """
    fp8 = w13.dtype == FP8_DTYPE
    if fp8:
        _check_fp8(w13, w2, w13_scale, w2_scale)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = ids - expert_offset
    e_loc, inter = w13.shape[0], w13.shape[1] // 2
    for e in torch.unique(local[(local >= 0) & (local < e_loc)]).tolist():
        tok, slot = torch.where(local == e)
        if fp8:  # intermediates in fp32 (x's e4m3 rounding is the same from x.dtype or fp32)
            gi, xt = w13_scale.shape[1] // 2, x[tok].float()
            gate = fp8_block_linear_ref(xt, w13[e, :inter], w13_scale[e, :gi])
            up = fp8_block_linear_ref(xt, w13[e, inter:], w13_scale[e, gi:])
            h = nn.functional.silu(gate) * up
            y = fp8_block_linear_ref(h, w2[e], w2_scale[e])
        else:
            gate, up = nn.functional.linear(x[tok], w13[e]).chunk(2, dim=-1)
            h = nn.functional.silu(gate) * up
            y = nn.functional.linear(h, w2[e])
        out.index_add_(0, tok, y.float() * weights[tok, slot].unsqueeze(-1))
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


def fused_experts_cost(
    num_tokens: int,
    top_k: int,
    num_local_experts: int,
    hidden: int,
    inter: int,
    num_valid_pairs: int | None = None,
    num_experts_hit: int | None = None,
    elem_bytes: int = 2,
) -> tuple[int, int]:
    """(flops, bytes) of the grouped GEMM form. Flops: the valid pairs' three [H, I] products
    (padding slots not counted). Bytes: each chosen expert's weights once (at most E_loc and the
    number of valid pairs; read once per block, which is once for decode batches) plus the
    activations: x rows per pair, gate/up and SiLU·up written and read back, the fp32 [P, H]
    partial sums written and read back, the output written. Defaults: every pair local."""
    pairs = num_tokens * top_k
    valid = pairs if num_valid_pairs is None else num_valid_pairs
    hit = min(num_local_experts, valid) if num_experts_hit is None else num_experts_hit
    flops = 2 * valid * 3 * inter * hidden
    weights = hit * 3 * inter * hidden * elem_bytes
    acts = (
        valid * hidden * elem_bytes  # x rows gathered by GEMM 1
        + 2 * valid * 2 * inter * elem_bytes  # gate/up: written, read by the activation
        + 2 * valid * inter * elem_bytes  # SiLU·up: written, read by GEMM 2
        + 2 * pairs * hidden * 4  # fp32 partial sums: zeroed/written, summed over k
        + num_tokens * hidden * elem_bytes  # output
    )
    return flops, weights + acts


def fused_experts_fp8_cost(
    num_tokens: int,
    top_k: int,
    num_local_experts: int,
    hidden: int,
    inter: int,
    num_valid_pairs: int | None = None,
    num_experts_hit: int | None = None,
    x_bytes: int = 2,
) -> tuple[int, int]:
    """(flops, bytes) of the FP8 grouped form (``moe_grouped_fp8``), as
    :func:`fused_experts_cost`: each chosen expert's e4m3 weights and fp32 block scales once; x
    read and written/read back as e4m3 (each valid pair reads its row); the e4m3 SiLU·up written
    and read once with its scales; the fp32 [P, H] partial sums written and read; the output."""
    pairs = num_tokens * top_k
    valid = pairs if num_valid_pairs is None else num_valid_pairs
    hit = min(num_local_experts, valid) if num_experts_hit is None else num_experts_hit
    flops = 2 * valid * 3 * inter * hidden
    scales = 3 * -(-inter // 128) * -(-hidden // 128) * 4
    weights = hit * (3 * inter * hidden + scales)
    acts = (
        num_tokens * hidden * (x_bytes + 1)  # x read, e4m3 x written
        + valid * hidden  # e4m3 x rows gathered by GEMM 1
        + 2 * valid * inter  # e4m3 SiLU·up: written, read by GEMM 2
        + 2 * pairs * hidden * 4  # fp32 partial sums: zeroed/written, summed over k
        + num_tokens * hidden * x_bytes  # output
    )
    return flops, weights + acts
