"""LSE merge of partial attentions in Triton (spec: :mod:`vllm.kernels.merge_attn`).

A shard with lse −inf contributes nothing (its output is not even read, so garbage there cannot
leak); when every shard is −inf the result is zeros and −inf, never NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.triton.utils import check_cuda_or_interpreter, next_pow2

__all__ = ["merge_attn_states"]


@triton.jit
def _merge_attn_states_kernel(
    outs_ptr,  # [N, R, DV] partial outputs (any float), strides (stride_on, stride_or, 1)
    lses_ptr,  # [N, R] fp32, strides (stride_ln, 1)
    out_ptr,  # [R, DV] merged output, contiguous
    lse_ptr,  # [R] fp32
    num_shards,
    num_rows,
    stride_on,
    stride_or,
    stride_ln,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    rmask = rows < num_rows
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    for i in range(num_shards):
        m = tl.maximum(m, tl.load(lses_ptr + i * stride_ln + rows, mask=rmask, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros((BLOCK_R,), tl.float32)
    for i in range(num_shards):
        li = tl.load(lses_ptr + i * stride_ln + rows, mask=rmask, other=float("-inf"))
        total += tl.exp(li - m_safe)
    lse = tl.where(total > 0.0, m_safe + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    lse_safe = tl.where(total > 0.0, lse, 0.0)
    cols = tl.arange(0, BLOCK_DV)
    acc = tl.zeros((BLOCK_R, BLOCK_DV), tl.float32)
    for i in range(num_shards):
        li = tl.load(lses_ptr + i * stride_ln + rows, mask=rmask, other=float("-inf"))
        w = tl.where(li == float("-inf"), 0.0, tl.exp(li - lse_safe))  # [BLOCK_R]
        o_ptrs = outs_ptr + i * stride_on + rows[:, None].to(tl.int64) * stride_or + cols[None, :]
        o = tl.load(o_ptrs, mask=(w > 0.0)[:, None] & (cols[None, :] < DV), other=0.0)
        acc += w[:, None] * o.to(tl.float32)
    omask = rmask[:, None] & (cols[None, :] < DV)
    o_dst = out_ptr + rows[:, None].to(tl.int64) * DV + cols[None, :]
    tl.store(o_dst, acc.to(out_ptr.dtype.element_ty), mask=omask)
    tl.store(lse_ptr + rows, lse, mask=rmask)


def merge_attn_states(
    outs: torch.Tensor, lses: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine N partial attentions over disjoint key sets.

    outs: [N, ..., d_v] (any float dtype); lses: [N, ...] fp32 natural-log LSE, −inf = empty shard.
    Returns out [..., d_v] in ``out_dtype`` and lse [...] fp32 — ``merge_attn_states_ref``.
    """
    if outs.shape[:-1] != lses.shape or outs.dim() < 2:
        raise ValueError(f"outs {tuple(outs.shape)} and lses {tuple(lses.shape)} do not match")
    check_cuda_or_interpreter(outs, lses)
    n, dv = outs.shape[0], outs.shape[-1]
    lead = outs.shape[1:-1]
    o3 = outs.reshape(n, -1, dv)
    if o3.stride(-1) != 1:
        o3 = o3.contiguous()
    l2 = lses.reshape(n, -1).float()
    if l2.stride(-1) != 1:
        l2 = l2.contiguous()
    rows = o3.shape[1]
    out = torch.empty(rows, dv, dtype=out_dtype, device=outs.device)
    lse = torch.empty(rows, dtype=torch.float32, device=outs.device)
    if rows:
        block_dv = next_pow2(dv)
        block_r = max(1, min(64, 4096 // block_dv))
        _merge_attn_states_kernel[(triton.cdiv(rows, block_r),)](
            o3, l2, out, lse, n, rows, o3.stride(0), o3.stride(1), l2.stride(0),
            DV=dv, BLOCK_DV=block_dv, BLOCK_R=block_r, num_warps=4,
        )  # fmt: skip
    return out.view(*lead, dv), lse.view(lead)
