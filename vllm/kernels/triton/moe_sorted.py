"""The data movement around a grouped GEMM over expert-sorted rows (``vllm/kernels/moe_cutlass.py``),
the pairs sorted by expert (``moe_sort.py``): the activations quantised into the sorted order (or, quantised
already, gathered into it), and each token's outputs gathered back, weighted and summed. All
skip the rows past the local pairs' count, read on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.fp8_gemm import AMAX_FLOOR, FP8_DTYPE, FP8_MAX
from vllm.kernels.triton.fp8_gemm import _quant_groups
from vllm.kernels.triton.moe_grouped import combine_pairs
from vllm.kernels.triton.utils import check_cuda_or_interpreter, interpreting

__all__ = [
    "quantise_sorted_rows",
    "gather_quantised_rows",
    "combine_sorted",
]

# 128-column groups a program quantises (one row's): 1,024 columns, written to each of its pairs' rows
QUANT_BLOCK_G = 8

GATHER_BLOCK = 2048  # bytes of a row per program


# stride_xm stays specialised: unknown to be a multiple of 16, the row copy compiles to 1-byte loads.
@triton.jit(do_not_specialize=("stride_sm", "stride_sg"))
def _gather_kernel(
    xq_ptr,  # uint8 [T, K] (e4m3 bytes), row stride stride_xm
    sx_ptr,  # fp32 [T, G] scales, strides (stride_sm, stride_sg)
    src_ptr,  # int64 [P]: the source row of each sorted row
    grp_ptr,  # int64 [P]: the group of each sorted row
    off_ptr,  # int32 [E + 1]: group e's rows are [off[e], off[e + 1])
    n_ptr,  # int32: sorted rows from here on are skipped
    a_ptr,  # uint8 [P, K] contiguous
    sa_ptr,  # fp32 [G · P] group-major (_group_major)
    stride_xm,
    stride_sm,
    stride_sg,
    K: tl.constexpr,
    G: tl.constexpr,
    G_POW2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    if i >= tl.load(n_ptr):
        return
    src = tl.load(src_ptr + i)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < K
    tl.store(a_ptr + i * K + cols, tl.load(xq_ptr + src * stride_xm + cols, mask=m), mask=m)
    if tl.program_id(1) == 0:
        g = tl.arange(0, G_POW2)
        gm = g < G
        s = tl.load(sx_ptr + src * stride_sm + g * stride_sg, mask=gm)
        tl.store(sa_ptr + _group_major(grp_ptr, off_ptr, i, g, G), s, mask=gm)


@triton.jit
def _quant_scatter_kernel(
    x_ptr,  # [T, K] bf16/fp16/fp32, row stride stride_xm
    pos_ptr,  # int64 [T · TOP_K]: pair t·k + j -> its sorted row
    grp_ptr,  # int64 [P]: the group of each sorted row
    off_ptr,  # int32 [E + 1]
    n_ptr,  # int32: sorted rows from here on are skipped (other ranks' pairs)
    a_ptr,  # uint8 [P, K] contiguous (e4m3 bytes)
    sa_ptr,  # fp32 [G · P] group-major (_group_major)
    stride_xm,
    K: tl.constexpr,
    G: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    SOFT_FP8: tl.constexpr,
):
    """Token t's groups [BLOCK_G · pid1, ...) quantised once (the quantiser's arithmetic), the
    e4m3 bytes and scales stored at each of its local pairs' sorted rows."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    cols = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    m = cols < K
    x = tl.load(x_ptr + t * stride_xm + cols, mask=m, other=0.0).to(tl.float32)
    q, scale = _quant_groups(x, FLOOR, QMAX, SOFT_FP8)
    n = tl.load(n_ptr)
    for j in tl.static_range(TOP_K):
        i = tl.load(pos_ptr + t * TOP_K + j)
        if i < n:
            tl.store(a_ptr + i * K + cols, q, mask=m)
            tl.store(sa_ptr + _group_major(grp_ptr, off_ptr, i, g, G), scale, mask=g < G)


@triton.jit
def _group_major(grp_ptr, off_ptr, i, g, G: tl.constexpr):
    """Where sorted row i's scale of K block g goes in the group-major layout: its group e's
    [G, m_e] block (rows contiguous) at G · off[e]."""
    e = tl.load(grp_ptr + i)
    o = tl.load(off_ptr + e).to(tl.int64)
    m = tl.load(off_ptr + e + 1).to(tl.int64) - o
    return G * o + g * m + (i - o)


def quantise_sorted_rows(
    x: torch.Tensor,
    pos: torch.Tensor,
    grp: torch.Tensor,
    offsets: torch.Tensor,
    n_rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K], pos int64 [T·k] (pair t·k + j -> its sorted row), grp,
    offsets, n_rows as :func:`gather_quantised_rows` -> the same (a, sa) as that function gives
    for x's per-token-group quantisation (``quant_per_token_group``'s bits) and src = the sorted
    rows' tokens: each token quantised once and written to its local pairs' rows, so neither the
    [T, K] quantised copy nor a second pass over the [P, K] rows exists. K a multiple of 128."""
    check_cuda_or_interpreter(x, pos, grp, offsets, n_rows)
    t, k = x.shape
    p = pos.numel()
    if k % 128:
        raise ValueError(f"K ({k}) must be a multiple of 128")
    g = k // 128
    x = x if x.stride(-1) == 1 else x.contiguous()
    a = torch.empty(p, k, dtype=FP8_DTYPE, device=x.device)
    sa = torch.empty(g * p, dtype=torch.float32, device=x.device)
    if t and k:
        _quant_scatter_kernel[(t, triton.cdiv(g, QUANT_BLOCK_G))](
            x, pos, grp, offsets, n_rows, a.view(torch.uint8), sa, x.stride(0), K=k, G=g,
            TOP_K=p // t, BLOCK_G=QUANT_BLOCK_G, FLOOR=AMAX_FLOOR, QMAX=FP8_MAX,
            SOFT_FP8=interpreting(), num_warps=4,
        )  # fmt: skip
    return a, sa


def gather_quantised_rows(
    xq: torch.Tensor,
    sx: torch.Tensor,
    src: torch.Tensor,
    grp: torch.Tensor,
    offsets: torch.Tensor,
    n_rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """xq e4m3 [T, K] (unit last stride), sx fp32 [T, G] (any strides), src int64 [P] source rows,
    grp int64 [P] their groups (ascending), offsets int32 [E + 1], n_rows int32 device scalar ->
    (a e4m3 [P, K], sa fp32 [G · P]) with a[i] = xq[src[i]] and sx[src[i]] at sorted row i's
    places in the group-major layout (group e's [G, m_e] block at G · offsets[e]), for
    i < n_rows; later rows unset."""
    check_cuda_or_interpreter(xq, sx, src, grp, offsets, n_rows)
    t, k = xq.shape
    g = sx.shape[1]
    p = src.numel()
    a = torch.empty(p, k, dtype=xq.dtype, device=xq.device)
    sa = torch.empty(g * p, dtype=torch.float32, device=xq.device)
    if p and k:
        _gather_kernel[(p, triton.cdiv(k, GATHER_BLOCK))](
            xq.view(torch.uint8), sx, src, grp, offsets, n_rows, a.view(torch.uint8), sa,
            xq.stride(0), sx.stride(0), sx.stride(1), K=k, G=g, G_POW2=triton.next_power_of_2(g),
            BLOCK=GATHER_BLOCK, num_warps=4,
        )  # fmt: skip
    return a, sa


def combine_sorted(
    d: torch.Tensor,
    pos: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert_offset: int,
    e_loc: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """d [P, H] (unit last stride), pos int64 [T·k] (pair t·k + j -> its row of d), ids / weights
    [T, k] -> y [T, H] in ``dtype``: y[t] = Σ_j weights[t, j] · d[pos[t·k + j]] over the token's
    local slots, in slot order, in fp32; the rows of other ranks' pairs never read (the grouped
    kernels' combine, :func:`~vllm.kernels.triton.moe_grouped.combine_pairs`, with a row map)."""
    check_cuda_or_interpreter(d, pos, ids, weights)
    return combine_pairs(d, ids, expert_offset, e_loc, dtype, pos=pos, weights=weights)
