"""Routed SwiGLU experts with FP8 block-scaled weights as two grouped GEMMs in Triton, with no host
synchronisation (spec and scale layout: :func:`vllm.kernels.moe.experts_ref`).

    experts_grouped_fp8(x, w13, w2, ids, weights, offset, w13_scale, w2_scale) ≈ experts_ref(...)

x [T, H] bf16/fp16/fp32; w13 e4m3 [E_loc, 2I, H] with w13_scale fp32 [E_loc, 2·ceil(I/128),
ceil(H/128)] (gate's row blocks, then up's); w2 e4m3 [E_loc, H, I] with w2_scale fp32
[E_loc, ceil(H/128), ceil(I/128)]; ids/weights [T, k]. Returns [T, H] in x.dtype.

How (the bf16 kernel's layout, ``moe_grouped.py``): x is quantised once per token-group of 128
(:func:`~vllm.kernels.triton.fp8_gemm.quant_per_token_group`); the P = T·k pairs are sorted by
local expert into BLOCK_M-row blocks (:func:`~vllm.kernels.triton.moe_grouped.sort_pairs_by_expert`,
sync-free). GEMM 1: a program owns BLOCK_N = 128 intermediate columns of one block and runs the
gate and the up tile of those columns over the same x rows (two fp32 accumulators, each K step
scaled by sx · s_gate / sx · s_up); its epilogue forms SiLU(gate)·up in fp32 and, since its 128
columns are exactly one quantisation group, quantises them on the spot: e4m3 [P, I] and one scale
per pair and group — the intermediate never exists in 16 or 32 bits in memory. GEMM 2 reads those,
scales each row by its routing weight and writes fp32 [P, H]; a last pass sums each token's local
slots in slot order and casts (deterministic, no atomics). Rows of invalid pairs are never loaded,
written or summed (no zero fill of the [P, H] buffer). One fixed sequence of launches: CUDA-graph capturable.

Rounding against the reference: both keep gate, up and SiLU·up in fp32 and quantise that, so
they differ by the fp32 sum order (and on Hopper the tensor cores' ~14-bit addition inside a
128-deep block), then by the output's rounding to x.dtype.

Traffic: each chosen expert's e4m3 weights once per BLOCK_M-row block of its pairs (once for
decode batches), half the bf16 kernel's bytes; activations: x read once and written/read as e4m3,
the intermediate written and read once in e4m3, the fp32 [P, H] partial sums written and read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.fp8_gemm import AMAX_FLOOR, FP8_DTYPE, FP8_MAX
from vllm.kernels.triton.fp8_gemm import quant_per_token_group
from vllm.kernels.triton.moe_grouped import (
    GROUP_M,
    combine_pairs,
    grouped_pids,
    sort_pairs_by_expert,
)
from vllm.kernels.triton.utils import check_cuda_or_interpreter, e4m3_bits, interpreting, record

__all__ = ["experts_grouped_fp8", "TUNE"]

_UPCAST = interpreting()
GROUP = 128  # the block of the scales, and the activation quantisation group

# Row tile by batch size (fixed table, no autotuning); column tiles are one scale group (GEMM 1
# must hold a whole group of the intermediate to quantise it). From
# benchmarks/kernels/bench_fp8_moe.py --sweep (H100, 2026-12-05): the 16-row tile is the best of
# ten at 64-256 decode tokens; at 8K tokens 128 rows, 8 warps, 4 stages beat the 64-row tile by
# 1.10x (13.27 against 14.57 ms).
TUNE = {
    "small": {"max_pairs_per_expert": 32, "block_m": 16, "num_warps": 4, "num_stages": 4},
    "large": {"block_m": 128, "num_warps": 8, "num_stages": 4},
}

# Row tiles up to which the K loops run without K and column masks (sizes multiples of 128).
# H100, 2026-12-07, bench_fp8_moe.py, one process: decode (16-row tile) 0.401 / 0.419 / 0.452 ms
# against 0.405 / 0.423 / 0.463 masked at T = 64 / 128 / 256; prefill (128 rows, 8 warps, at 255
# registers) 10.30 against 9.97 ms: there the unmasked loads spill more (16 bytes against 4).
EVEN_MAX_BLOCK_M = 16


@triton.jit
def _dot(a, w, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, w)


@triton.jit
def _gate_up_kernel(
    a_ptr,  # e4m3 [T, H]: x quantised, strides (stride_am, 1)
    as_ptr,  # fp32 [T, ceil(H/128)], strides (stride_asm, stride_ask)
    w_ptr,  # e4m3 [E_loc, 2I, H], strides (stride_we, stride_wn, 1)
    ws_ptr,  # fp32 [E_loc, 2·ceil(I/128), ceil(H/128)], strides (stride_wse, stride_wsn, stride_wsk)
    hq_ptr,  # uint8 view of e4m3 [P, I], strides (stride_hm, 1)
    hs_ptr,  # fp32 [P, ceil(I/128)], strides (stride_hsm, stride_hsg)
    sorted_pairs_ptr,  # int32 [NB · BLOCK_M]: pair ids grouped by expert, P = empty slot
    block_expert_ptr,  # int32 [NB]: local expert of each block, −1 = past the end
    num_pairs,
    num_m,  # NB
    inter,  # I
    H,
    up_scale_row,  # ceil(I/128): first scale row of the up half
    stride_am,
    stride_asm,
    stride_ask,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_hm,
    stride_hsm,
    stride_hsg,
    TOP_K: tl.constexpr,
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # = GROUP: one quantisation group of the intermediate
    BLOCK_K: tl.constexpr,  # = GROUP: one scale group of H
    EVEN: tl.constexpr,  # H and I multiples of 128: no K or column masks (rows stay masked)
):
    pid_m, pid_n = grouped_pids(num_m, tl.cdiv(inter, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    pmask = pair < num_pairs
    pair = pair.to(tl.int64)
    tok = pair // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] intermediate columns
    nmask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    e64 = expert.to(tl.int64)
    a_ptrs = a_ptr + tok[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    g_ptrs = w_ptr + e64 * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + inter * stride_wn  # up rows I + n
    as_ptrs = as_ptr + tok * stride_asm  # [BLOCK_M]
    gs_ptr = ws_ptr + e64 * stride_wse + (pid_n * BLOCK_N // 128) * stride_wsn  # scalar per k
    us_ptr = gs_ptr + up_scale_row * stride_wsn
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in range(0, tl.cdiv(H, BLOCK_K)):
        if EVEN:
            a = tl.load(a_ptrs, mask=pmask[:, None], other=0.0)
            wg = tl.load(g_ptrs)
            wu = tl.load(u_ptrs)
        else:
            kmask = offs_k < H - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=pmask[:, None] & kmask[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            wu = tl.load(u_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        sa = tl.load(as_ptrs, mask=pmask, other=0.0)[:, None]
        gate += _dot(a, wg, UPCAST) * (sa * tl.load(gs_ptr))
        up += _dot(a, wu, UPCAST) * (sa * tl.load(us_ptr))
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
        as_ptrs += stride_ask
        gs_ptr += stride_wsk
        us_ptr += stride_wsk
    # SiLU·up, then quantise the group (masked columns are silu(0)·0 = 0: they do not move amax)
    h = gate / (1.0 + tl.exp(-gate)) * up
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(h), axis=1), FLOOR), QMAX)  # [BLOCK_M]
    q = tl.minimum(tl.maximum(tl.math.div_rn(h, scale[:, None]), -QMAX), QMAX)
    smask = pmask[:, None] & nmask[None, :]
    tl.store(hq_ptr + pair[:, None] * stride_hm + offs_n[None, :], e4m3_bits(q, UPCAST), mask=smask)
    tl.store(hs_ptr + pair * stride_hsm + pid_n * stride_hsg, scale, mask=pmask)


@triton.jit
def _down_kernel(
    a_ptr,  # e4m3 [P, I]: the quantised intermediate, strides (stride_am, 1)
    as_ptr,  # fp32 [P, ceil(I/128)], strides (stride_asm, stride_ask)
    w_ptr,  # e4m3 [E_loc, H, I], strides (stride_we, stride_wn, 1)
    ws_ptr,  # fp32 [E_loc, ceil(H/128), ceil(I/128)], strides (stride_wse, stride_wsn, stride_wsk)
    out_ptr,  # fp32 [P, H], strides (stride_om, 1)
    sorted_pairs_ptr,
    block_expert_ptr,
    route_w_ptr,  # fp32 [P] routing weights
    num_pairs,
    num_m,  # NB
    H,
    inter,  # I
    stride_am,
    stride_asm,
    stride_ask,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_om,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # divides 128: one weight scale row per tile
    BLOCK_K: tl.constexpr,  # = GROUP
    EVEN: tl.constexpr,  # I and H multiples of the tiles: no K or column masks (rows stay masked)
):
    pid_m, pid_n = grouped_pids(num_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    pmask = pair < num_pairs
    pair = pair.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] hidden columns
    nmask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    e64 = expert.to(tl.int64)
    a_ptrs = a_ptr + pair[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + e64 * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    as_ptrs = as_ptr + pair * stride_asm
    ws_ptr = ws_ptr + e64 * stride_wse + (pid_n * BLOCK_N // 128) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in range(0, tl.cdiv(inter, BLOCK_K)):
        if EVEN:
            a = tl.load(a_ptrs, mask=pmask[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            kmask = offs_k < inter - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=pmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        sa = tl.load(as_ptrs, mask=pmask, other=0.0)[:, None]
        acc += _dot(a, w, UPCAST) * (sa * tl.load(ws_ptr))
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        as_ptrs += stride_ask
        ws_ptr += stride_wsk
    acc = acc * tl.load(route_w_ptr + pair, mask=pmask, other=0.0)[:, None]
    o_ptrs = out_ptr + pair[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc, mask=pmask[:, None] & nmask[None, :])


def _config(num_pairs: int, num_local_experts: int, num_experts: int | None = None) -> dict:
    """Row tile by the pairs expected on this rank's experts: all of them, or under EP (routing
    spread over ``num_experts``) their share, which is what the tiles are filled with."""
    small = TUNE["small"]
    if num_experts:
        num_pairs = -(-num_pairs * num_local_experts // num_experts)
    if num_pairs <= small["max_pairs_per_expert"] * num_local_experts:
        return small
    return TUNE["large"]


def experts_grouped_fp8(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert_offset: int,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    cfg: dict | None = None,
    num_experts: int | None = None,
    x_quant: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`experts_ref`'s FP8 result by two grouped GEMMs, without a host sync (module
    docstring). ``cfg`` overrides the row tile choice (tests, the benchmark's sweep);
    ``num_experts``: the model's routed experts, when only some are local (EP); ``x_quant``:
    x's per-token-group quantisation (e4m3 [T, H], scales [T, ceil(H/128)], any strides) when
    its producer made it (``quant_per_token_group``'s bytes), else x is quantised here. Scratch:
    e4m3 x [T, H], e4m3 intermediate [P, I] with its scales, fp32 partial sums [P, H]."""
    t, h = x.shape
    e_loc, two_i = w13.shape[0], w13.shape[1]
    inter = two_i // 2
    gi, gh = triton.cdiv(inter, GROUP), triton.cdiv(h, GROUP)
    if w13.shape != (e_loc, 2 * inter, h) or w2.shape != (e_loc, h, inter):
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit x {(t, h)}")
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(f"w13 {w13.dtype} / w2 {w2.dtype}: e4m3 expected")
    if w13_scale.shape != (e_loc, 2 * gi, gh) or w2_scale.shape != (e_loc, gh, gi):
        raise ValueError(f"w13_scale {tuple(w13_scale.shape)} / w2_scale {tuple(w2_scale.shape)}")
    if ids.dim() != 2 or ids.shape[0] != t or weights.shape != ids.shape:
        raise ValueError(f"ids {tuple(ids.shape)} / weights {tuple(weights.shape)} mismatch")
    check_cuda_or_interpreter(x, w13, w2, ids, weights, w13_scale, w2_scale)
    top_k = ids.shape[1]
    p = t * top_k
    if p == 0 or e_loc == 0:
        return torch.zeros_like(x)
    cfg = cfg or _config(p, e_loc, num_experts)
    bm, opts = cfg["block_m"], dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    sorted_pairs, block_expert = sort_pairs_by_expert(ids, expert_offset, e_loc, bm)
    nb = block_expert.numel()
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("w13 and w2 need a contiguous last dim")
    if x_quant is None:
        xq, sx = quant_per_token_group(x, GROUP)  # [T, H] e4m3, [T, gh]
    else:
        xq, sx = x_quant
        if xq.shape != (t, h) or sx.shape != (t, gh) or xq.stride(-1) != 1:
            raise ValueError(f"x_quant {tuple(xq.shape)} / {tuple(sx.shape)} does not fit x")
    # no K or column masks where the sizes allow (every GLM-5.3 size) and the row tile is at most
    # EVEN_MAX_BLOCK_M (cfg "even" False: the masked form, for the benchmark)
    even = cfg.get("even", bm <= EVEN_MAX_BLOCK_M) and h % GROUP == 0 and inter % GROUP == 0
    hq = torch.empty(p, inter, dtype=FP8_DTYPE, device=x.device)  # invalid rows unset
    hs = torch.empty(gi, p, dtype=torch.float32, device=x.device).t()  # [P, gi]
    compiled = _gate_up_kernel[(nb * gi,)](
        xq, sx, w13, w13_scale, hq.view(torch.uint8), hs, sorted_pairs, block_expert, p, nb, inter,
        h,
        gi, xq.stride(0), sx.stride(0), sx.stride(1), w13.stride(0), w13.stride(1),
        w13_scale.stride(0), w13_scale.stride(1), w13_scale.stride(2), hq.stride(0),
        hs.stride(0), hs.stride(1),
        TOP_K=top_k, FLOOR=AMAX_FLOOR, QMAX=FP8_MAX, UPCAST=_UPCAST, BLOCK_M=bm, BLOCK_N=GROUP,
        BLOCK_K=GROUP, EVEN=even, **opts,
    )  # fmt: skip
    record("moe_fp8_gate_up", compiled)
    out = torch.empty(p, h, dtype=torch.float32, device=x.device)  # [P, H]; invalid rows unset
    route_w = weights.reshape(-1).float().contiguous()  # [P]
    block_n = cfg.get("block_n", GROUP)
    compiled = _down_kernel[(nb * triton.cdiv(h, block_n),)](
        hq, hs, w2, w2_scale, out, sorted_pairs, block_expert, route_w, p, nb, h, inter,
        hq.stride(0), hs.stride(0), hs.stride(1), w2.stride(0), w2.stride(1),
        w2_scale.stride(0), w2_scale.stride(1), w2_scale.stride(2), out.stride(0),
        UPCAST=_UPCAST, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=GROUP,
        EVEN=even and h % block_n == 0, **opts,
    )  # fmt: skip
    record("moe_fp8_down", compiled)
    return combine_pairs(out, ids, expert_offset, e_loc, x.dtype)
