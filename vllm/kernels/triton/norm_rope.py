"""RMSNorm and rotary embedding in Triton (spec: :mod:`vllm.kernels.norm_rope`).

Both are memory-bound: each element is read once and written once, the arithmetic in fp32. Token
counts and strides change from step to step, so they are not specialised on (one compiled variant
per width, head count class and dtype: the warm-up's steps compile them all).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.fp8_gemm import AMAX_FLOOR, FP8_DTYPE, FP8_MAX
from vllm.kernels.triton.fp8_gemm import _quant_groups
from vllm.kernels.triton.utils import interpreting


@triton.jit
def _load_row(x_ptr, r_ptr, r, sx, sr, cols, mask, HAS_RES: tl.constexpr):
    """Columns ``cols`` of row r of x, or of x + residual rounded to x's dtype (torch's add: the
    sum in fp32, one rounding) when HAS_RES."""
    x = tl.load(x_ptr + r * sx + cols, mask=mask, other=0.0)
    if HAS_RES:
        res = tl.load(r_ptr + r * sr + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x


@triton.jit
def _row_tile(x_ptr, r_ptr, w_ptr, r, sx, sr, inv, g0, D: tl.constexpr, BLOCK_G: tl.constexpr,
              GROUP: tl.constexpr, HAS_RES: tl.constexpr):  # fmt: skip
    """Columns [g0·GROUP, (g0 + BLOCK_G)·GROUP) of row r as a [BLOCK_G, GROUP] tile, normalised
    (``inv`` = 1 / rms) with the reference's two roundings: (column offsets, the row's values in
    x's dtype (the sum with the residual under HAS_RES), fp32 output)."""
    cols = (g0 + tl.arange(0, BLOCK_G))[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    xs = _load_row(x_ptr, r_ptr, r, sx, sr, cols, cols < D, HAS_RES)
    x = xs.to(tl.float32)
    y = (x * inv).to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded to x's dtype, then
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)  # the weight's product
    return cols, xs, y * w


@triton.jit
def _inv_rms(x_ptr, r_ptr, r, sx, sr, eps, D: tl.constexpr, BLOCK_G: tl.constexpr,
             GROUP: tl.constexpr, HAS_RES: tl.constexpr):  # fmt: skip
    """1 / sqrt(mean(x_r²) + eps) over the whole row as one [BLOCK_G, GROUP] tile: both norm
    kernels reduce the same tile with the same warps, hence the same fp32 sum."""
    cols = tl.arange(0, BLOCK_G)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    x = _load_row(x_ptr, r_ptr, r, sx, sr, cols, cols < D, HAS_RES).to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / D + eps)


# Row strides stay specialised (Triton keys on "a multiple of 16"): unspecialised, the row's
# loads cannot be proven 16-byte aligned and compile to one 2-byte load an element.
@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [N, D], row stride sx
    r_ptr,  # [N, D], row stride sr: the residual added to x first (HAS_RES)
    w_ptr,  # [D]
    o_ptr,  # [N, D] contiguous
    s_ptr,  # [N, D] contiguous: x + residual (HAS_RES)
    sx,
    sr,
    eps,
    D: tl.constexpr,
    BLOCK_G: tl.constexpr,  # the row as a [BLOCK_G, GROUP] tile (norm_tile)
    GROUP: tl.constexpr,
    HAS_RES: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    inv = _inv_rms(x_ptr, r_ptr, r, sx, sr, eps, D, BLOCK_G, GROUP, HAS_RES)
    cols, xs, out = _row_tile(x_ptr, r_ptr, w_ptr, r, sx, sr, inv, 0, D, BLOCK_G, GROUP, HAS_RES)
    tl.store(o_ptr + r * D + cols, out.to(o_ptr.dtype.element_ty), mask=cols < D)
    if HAS_RES:
        tl.store(s_ptr + r * D + cols, xs, mask=cols < D)


def norm_tile(d: int) -> tuple[int, int, int]:
    """(BLOCK_G, GROUP, num_warps): a row of D as a [BLOCK_G, GROUP] tile (GROUP = 128 columns,
    the FP8 quantisation group, for D >= 128), the layout both norm kernels reduce."""
    group = min(128, triton.next_power_of_2(d))
    block_g = triton.next_power_of_2(triton.cdiv(d, group))
    return block_g, group, max(1, min(8, block_g * group // 256))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [N, D] with a unit last stride (a view for row-strided 2-D inputs: a split of a fused
    projection)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The norm of x; with ``residual`` (x's shape and dtype), of s = x + residual, returning
    (norm, s) from one pass (s rounded to x's dtype as torch's add rounds it)."""
    d = x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    s = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    n = x2.shape[0]
    if n:
        block_g, group, warps = norm_tile(d)
        _rms_norm_kernel[(n,)](
            x2, r2, weight, out, s, x2.stride(0), r2.stride(0), eps, D=d, BLOCK_G=block_g,
            GROUP=group, HAS_RES=residual is not None, num_warps=warps,
        )  # fmt: skip
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), s.view(x.shape)


@triton.jit  # row strides specialised, as _rms_norm_kernel's
def _rms_norm_quant_kernel(
    x_ptr,  # [N, D], row stride sx
    r_ptr,  # [N, D], row stride sr: the residual added to x first (HAS_RES)
    w_ptr,  # [D]
    o_ptr,  # [N, D] contiguous
    sum_ptr,  # [N, D] contiguous: x + residual (HAS_RES)
    q_ptr,  # uint8 view of e4m3 [N_pad, D] contiguous
    s_ptr,  # fp32 [N_pad, ng], strides (stride_sm, stride_sg)
    sx,
    sr,
    eps,
    n_rows,  # rows of x; rows n_rows..N_pad-1 of q and s are an all-zero row's
    stride_sm,
    stride_sg,
    D: tl.constexpr,
    BLOCK_G: tl.constexpr,  # the row as a [BLOCK_G, GROUP] tile for the sum (norm_tile)
    GROUP: tl.constexpr,  # = the quantisation group
    SPLIT_G: tl.constexpr,  # groups written and quantised by each program
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    SOFT_FP8: tl.constexpr,
    HAS_RES: tl.constexpr,
):
    # program (row, chunk): each sums the whole row (the tile and warps of _rms_norm_kernel, so
    # the same 1 / rms; the re-reads of a row hit L2), then writes and quantises its SPLIT_G
    # groups as quant_per_token_group would after a round trip of the output through memory
    # (zeros past D do not move a group's amax; padding rows are all zero); under HAS_RES it also
    # writes its groups of x + residual
    r = tl.program_id(0).to(tl.int64)
    g0 = tl.program_id(1) * SPLIT_G
    live = r < n_rows
    rr = tl.where(live, r, 0)
    inv = _inv_rms(x_ptr, r_ptr, rr, sx, sr, eps, D, BLOCK_G, GROUP, HAS_RES)
    cols, xs, out = _row_tile(x_ptr, r_ptr, w_ptr, rr, sx, sr, inv, g0, D, SPLIT_G, GROUP, HAS_RES)
    out = tl.where(live, out, 0.0).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + r * D + cols, out, mask=(cols < D) & live)
    if HAS_RES:
        tl.store(sum_ptr + r * D + cols, xs, mask=(cols < D) & live)
    q, scale = _quant_groups(out.to(tl.float32), FLOOR, QMAX, SOFT_FP8)
    tl.store(q_ptr + r * D + cols, q, mask=cols < D)
    gi = g0 + tl.arange(0, SPLIT_G)
    tl.store(s_ptr + r * stride_sm + gi * stride_sg, scale, mask=gi * GROUP < D)


# groups each program of rms_norm_quant writes and quantises: a 6,144-wide row in 3 programs.
# H100, graph replays (bench_norm_rope.py, 2026-12-06), D = 6,144, against rms_norm then
# quant_per_token_group: T = 1 3.0 µs with 2-16 groups a program (the two kernels ~4.2), 7 with
# 64; T = 64 5.0 µs with 16 (~5.4), 6.0 with 8, 9-15 with 2-4. Every program re-sums its whole
# row, so at prefill sizes the fused kernel loses (T = 8K: 0.16-1.6 ms against ~0.14): the
# decoder layer uses it at decode sizes only.
QUANT_SPLIT_G = 16


def rms_norm_quant(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group: int = 128,
    row_multiple: int = 1,
    split_g: int | None = None,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """:func:`rms_norm` and :func:`~vllm.kernels.triton.fp8_gemm.quant_per_token_group` of its
    output in one launch: (y [..., D], yq e4m3 [N_pad, D], scale fp32 [N_pad, ceil(D/group)] as
    an N-contiguous view), the same bits as the two calls; D > group = 128. ``split_g``: groups
    per program (default :data:`QUANT_SPLIT_G`; the benchmark compares others), at most half the
    row's. ``residual``:
    the norm of x + residual, and that sum appended to the result: (y, yq, scale, sum)."""
    d = x.shape[-1]
    block_g, tile_group, warps = norm_tile(d)
    if group != tile_group or block_g < 2:
        raise ValueError(
            f"rms_norm_quant: group {group} at D {d}; the norm's tile is {block_g} x {tile_group} "
            "(two groups at least: see split below)"
        )
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    n = x2.shape[0]
    n_pad = -(-n // row_multiple) * row_multiple
    ng = triton.cdiv(d, group)
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    total = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    q = torch.empty(n_pad, d, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(ng, n_pad, dtype=torch.float32, device=x.device).t()
    if n_pad:
        # at most half the row's groups a program: a program quantising the whole row would
        # share the sum's tile (the same addresses), which the compiler then lays out for the
        # e4m3 stores (16 bytes a thread, not 8 bf16 elements): another summation order than
        # rms_norm's, so other bits (sm_90a TTGIR; H100, 2026-12-07, D = 6,144 at 64 groups)
        split = min(triton.next_power_of_2(split_g or QUANT_SPLIT_G), max(1, block_g // 2))
        _rms_norm_quant_kernel[(n_pad, triton.cdiv(ng, split))](
            x2, r2, weight, out, total, q.view(torch.uint8), s, x2.stride(0), r2.stride(0), eps,
            n, s.stride(0), s.stride(1), D=d, BLOCK_G=block_g, GROUP=group, SPLIT_G=split,
            FLOOR=AMAX_FLOOR, QMAX=FP8_MAX, SOFT_FP8=interpreting(),
            HAS_RES=residual is not None, num_warps=warps,
        )  # fmt: skip
    if residual is None:
        return out.view(x.shape), q, s
    return out.view(x.shape), q, s, total.view(x.shape)


@triton.jit
def _bf16_bits(v):
    """fp32 -> the bf16 bit pattern (uint32, low 16 bits), rounded to nearest even as torch's
    cast does (NaN kept a quiet NaN): integer arithmetic, the same compiled or interpreted."""
    u = v.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(v != v, 0x7FC0, r).to(tl.uint32)


# the strides stay specialised (fixed by the model's shapes): unspecialised, a head's rope dims load
# 4 bytes at a time instead of 16
@triton.jit(do_not_specialize=("n_tok", "h"))
def _rope_kernel(
    x_ptr,  # [T, H, 2 * HALF], strides (sxt, sxh, 1); int32 pairs when PACKED
    o_ptr,  # same shape, strides (sot, soh, 1); may be x
    cos_ptr,  # [T, HALF] fp32 contiguous
    sin_ptr,
    n_tok,
    h,
    sxt,
    sxh,
    sot,
    soh,
    HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """A [BLOCK_T tokens, BLOCK_H heads] tile a program: each token's angles loaded once for all
    its heads, each head's rope dims one contiguous run. PACKED (bf16, interleaved): a pair
    (x0, x1) is one 32-bit word, unpacked and repacked with shifts (no register shuffles)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, HALF)
    tm = t < n_tok
    m = tm[:, None, None] & (hh < h)[None, :, None]
    ang = t[:, None] * HALF + j[None, :]
    c = tl.load(cos_ptr + ang, mask=tm[:, None], other=0.0)[:, None, :]
    s = tl.load(sin_ptr + ang, mask=tm[:, None], other=0.0)[:, None, :]
    xrow = (t * sxt)[:, None, None] + (hh * sxh)[None, :, None]
    orow = (t * sot)[:, None, None] + (hh * soh)[None, :, None]
    # every element this program writes it has read first (in place is safe: tiles are disjoint)
    if PACKED:
        w = tl.load(x_ptr + xrow + j[None, None, :], mask=m, other=0).to(tl.uint32, bitcast=True)
        x1 = (w << 16).to(tl.float32, bitcast=True)
        x2 = (w & 0xFFFF0000).to(tl.float32, bitcast=True)
        o = (_bf16_bits(x2 * c + x1 * s) << 16) | _bf16_bits(x1 * c - x2 * s)
        tl.store(o_ptr + orow + j[None, None, :], o.to(tl.int32, bitcast=True), mask=m)
    elif INTERLEAVE:
        d = tl.arange(0, 2 * HALF)
        x = tl.load(x_ptr + xrow + d[None, None, :], mask=m, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_H, HALF, 2)))
        o = tl.reshape(tl.join(x1 * c - x2 * s, x2 * c + x1 * s), (BLOCK_T, BLOCK_H, 2 * HALF))
        tl.store(o_ptr + orow + d[None, None, :], o.to(o_ptr.dtype.element_ty), mask=m)
    else:
        jj = j[None, None, :]
        x1 = tl.load(x_ptr + xrow + jj, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + xrow + HALF + jj, mask=m, other=0.0).to(tl.float32)
        tl.store(o_ptr + orow + jj, (x1 * c - x2 * s).to(o_ptr.dtype.element_ty), mask=m)
        tl.store(o_ptr + orow + HALF + jj, (x2 * c + x1 * s).to(o_ptr.dtype.element_ty), mask=m)


def _packable(a: torch.Tensor) -> bool:
    """bf16 pairs viewable as int32 words: even strides and offset (4-byte aligned pairs)."""
    return (
        a.dtype == torch.bfloat16
        and a.storage_offset() % 2 == 0
        and all(st % 2 == 0 for st in a.stride()[:-1])
        and a.data_ptr() % 4 == 0
    )


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleave: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.shape != x.shape:
        raise ValueError(f"rope out {tuple(out.shape)} for x {tuple(x.shape)}")
    t, d = x.shape[0], x.shape[-1]
    if cos.shape != (t, d // 2) or sin.shape != cos.shape:
        raise ValueError(f"rope angles {tuple(cos.shape)} for x {tuple(x.shape)}")
    if t == 0:
        return out
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    o3 = out if out.dim() == 3 else out.unsqueeze(1)
    packed = interleave and out.dtype == x.dtype and _packable(x3) and _packable(o3)
    if packed:  # strides and the angles' pairs now in 32-bit words
        x3, o3 = x3.view(torch.int32), o3.view(torch.int32)
    h, half = x3.shape[1], d // 2
    block_h = min(triton.next_power_of_2(h), max(1, 4096 // d))
    block_t = max(1, min(4096 // (d * block_h), triton.next_power_of_2(t)))
    grid = (triton.cdiv(t, block_t), triton.cdiv(h, block_h))
    _rope_kernel[grid](
        x3,
        o3,
        cos.float(),
        sin.float(),
        t,
        h,
        x3.stride(0),
        x3.stride(1),
        o3.stride(0),
        o3.stride(1),
        HALF=half,
        INTERLEAVE=interleave,
        PACKED=packed,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        num_warps=4 if block_t * block_h * d >= 2048 else 1,
    )
    return out
