"""RMSNorm and rotary embedding in Triton (spec: :mod:`vllm.kernels.norm_rope`).

Both are memory-bound: each element is read once and written once, the arithmetic in fp32. Token
counts and strides change from step to step, so they are not specialised on (one compiled variant
per width, head count class and dtype: the warm-up's steps compile them all).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=("sx",))
def _rms_norm_kernel(
    x_ptr,  # [N, D], row stride sx
    w_ptr,  # [D]
    o_ptr,  # [N, D] contiguous
    sx,
    eps,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    cm = cols < D
    x = tl.load(x_ptr + r * sx + cols, mask=cm, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    # rounded to x's dtype, then the weight's product rounded to the output's (the reference's
    # two roundings)
    y = (x * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    tl.store(o_ptr + r * D + cols, (y * w).to(o_ptr.dtype.element_ty), mask=cm)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    x2 = x.reshape(-1, d)  # a view for row-strided 2-D inputs (a split of a fused projection)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    n = x2.shape[0]
    if n:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(n,)](
            x2,
            weight,
            out,
            x2.stride(0),
            eps,
            D=d,
            BLOCK_D=block,
            num_warps=max(1, min(8, block // 256)),
        )
    return out.view(x.shape)


@triton.jit(do_not_specialize=("n_rows", "h", "sxt", "sxh", "sot", "soh"))
def _rope_kernel(
    x_ptr,  # [T, H, 2 * HALF], strides (sxt, sxh, 1)
    o_ptr,  # same shape, strides (sot, soh, 1); may be x
    cos_ptr,  # [T, HALF] fp32 contiguous
    sin_ptr,
    n_rows,  # T * H
    h,
    sxt,
    sxh,
    sot,
    soh,
    HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """BLOCK_R (token, head) rows a program, each read and written as one contiguous run of
    2·HALF elements (the interleaved pairs split and joined in registers)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    m = (rows < n_rows)[:, None]
    t, hh = rows // h, rows % h
    j = tl.arange(0, HALF)
    c = tl.load(cos_ptr + t[:, None] * HALF + j[None, :], mask=m, other=0.0)
    s = tl.load(sin_ptr + t[:, None] * HALF + j[None, :], mask=m, other=0.0)
    xb = x_ptr + (t * sxt + hh * sxh)[:, None]
    ob = o_ptr + (t * sot + hh * soh)[:, None]
    # every element this program writes it has read first (in place is safe: rows are disjoint)
    if INTERLEAVE:
        d = tl.arange(0, 2 * HALF)
        x = tl.load(xb + d[None, :], mask=m, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_R, HALF, 2)))
        o = tl.reshape(tl.join(x1 * c - x2 * s, x2 * c + x1 * s), (BLOCK_R, 2 * HALF))
        tl.store(ob + d[None, :], o.to(o_ptr.dtype.element_ty), mask=m)
    else:
        x1 = tl.load(xb + j[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xb + HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(ob + j[None, :], (x1 * c - x2 * s).to(o_ptr.dtype.element_ty), mask=m)
        tl.store(ob + HALF + j[None, :], (x2 * c + x1 * s).to(o_ptr.dtype.element_ty), mask=m)


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
    h = x3.shape[1]
    n = t * h
    block_r = max(1, min(4096 // d, triton.next_power_of_2(n)))
    _rope_kernel[(triton.cdiv(n, block_r),)](
        x3,
        o3,
        cos.float(),
        sin.float(),
        n,
        h,
        x3.stride(0),
        x3.stride(1),
        o3.stride(0),
        o3.stride(1),
        HALF=d // 2,
        INTERLEAVE=interleave,
        BLOCK_R=block_r,
        num_warps=4 if block_r * d >= 2048 else 1,
    )
    return out
