"""Sparse-MLA attention in Triton (spec: :mod:`vllm.kernels.sparse_mla`), for decode (paged cache)
and MQA prefill (flat context) on any CUDA GPU, and in the CPU interpreter in tests.

One program owns one query token, a block of its heads and a slice of its top-k list. It gathers
BLOCK_N selected KV rows at a time, dequantises them once (fp8_ds_mla) and uses each row for every
head of the block (the MQA point of the absorbed form, SPEC §2): S = Q·Kᵀ over kv_lora + rope dims,
an online base-2 softmax, O += P·V over the kv_lora dims. With more than one slice per token
(split-K, for small decode batches) partial outputs and LSEs go through ``merge_attn``.

Naive memory traffic (what the torch reference moves): it materialises the gathered rows as fp32
[T, K, 576] (2304 B per row instead of 656) and the [T, H, K] scores; this kernel reads each
selected row once per program and writes only out and lse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm.kernels.merge_attn import merge_attn_states
from vllm.kernels.sparse_mla import RowFormat, num_splits
from vllm.kernels.triton.utils import check_cuda_or_interpreter, dot_dtype, next_pow2, record

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class SparseMLAConfig:
    block_h: int  # heads per program (the MMA's M); 64 fills a Hopper wgmma
    block_n: int  # KV rows gathered per step
    num_warps: int
    num_stages: int
    num_splits: int  # slices of the top-k list per token (1 = no merge pass)


@triton.jit
def _sparse_mla_fwd_kernel(
    q_ptr,  # [T, H, D_NOPE + D_ROPE] bf16/fp32, strides (stride_qt, stride_qh, 1)
    kv_ptr,  # FP8: uint8 [num_rows, ROW_BYTES]; else [num_rows, row_stride] bf16/fp32
    idx_ptr,  # [T, K] int32 row ids, −1 = none, strides (stride_it, 1)
    out_ptr,  # [splits, T, H, D_NOPE], strides (stride_os, stride_ot, stride_oh, 1)
    lse_ptr,  # [splits, T, H] fp32, strides (stride_ls, stride_lt, 1)
    scale_log2,  # sm_scale · log2(e)
    num_heads,
    topk,
    k_per_split,  # a multiple of BLOCK_N
    stride_qt,
    stride_qh,
    stride_it,
    row_stride,  # elements between rows (non-FP8)
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    NUM_HEAD_BLOCKS: tl.constexpr,
    D_NOPE: tl.constexpr,  # kv_lora_rank = d_v, a power of two
    D_ROPE: tl.constexpr,
    BLOCK_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    TILE: tl.constexpr,  # values per fp32 scale in an FP8 row
    DOT_DTYPE: tl.constexpr,
):
    NT: tl.constexpr = D_NOPE // TILE
    pid = tl.program_id(0)
    t = (pid // NUM_HEAD_BLOCKS).to(tl.int64)
    heads = (pid % NUM_HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    split = tl.program_id(1)
    hmask = heads < num_heads
    dn = tl.arange(0, D_NOPE)
    dr = tl.arange(0, BLOCK_ROPE)
    rmask = dr < D_ROPE

    q_rows = q_ptr + t * stride_qt + heads[:, None] * stride_qh  # [BLOCK_H, 1]
    q_nope = tl.load(q_rows + dn[None, :], mask=hmask[:, None], other=0.0)
    q_nope = q_nope.to(DOT_DTYPE)  # [BLOCK_H, D_NOPE]
    q_rope = tl.load(q_rows + D_NOPE + dr[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    q_rope = q_rope.to(DOT_DTYPE)  # [BLOCK_H, BLOCK_ROPE]

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D_NOPE), tl.float32)
    k_lo = split * k_per_split
    for k0 in range(0, k_per_split, BLOCK_N):
        kk = k_lo + k0 + tl.arange(0, BLOCK_N)
        rid = tl.load(idx_ptr + t * stride_it + kk, mask=kk < topk, other=-1)  # [BLOCK_N]
        valid = rid >= 0
        if IS_FP8:
            row = kv_ptr + rid.to(tl.int64) * ROW_BYTES  # [BLOCK_N] row starts (bytes)
            raw = tl.load(row[:, None] + dn[None, :], mask=valid[:, None], other=0)
            vals = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            sc_ptr = (row + D_NOPE).to(tl.pointer_type(tl.float32))
            sc = tl.load(
                sc_ptr[:, None] + tl.arange(0, NT)[None, :], mask=valid[:, None], other=0.0
            )
            kv3 = tl.reshape(vals, (BLOCK_N, NT, TILE)) * sc[:, :, None]
            kv_nope = tl.reshape(kv3, (BLOCK_N, D_NOPE)).to(DOT_DTYPE)  # [BLOCK_N, D_NOPE]
            rope_ptr = (row + D_NOPE + 4 * NT).to(tl.pointer_type(tl.bfloat16))
            rm = valid[:, None] & rmask[None, :]
            kv_rope = tl.load(rope_ptr[:, None] + dr[None, :], mask=rm, other=0.0)
        else:
            row = kv_ptr + rid.to(tl.int64) * row_stride
            kv_nope = tl.load(row[:, None] + dn[None, :], mask=valid[:, None], other=0.0)
            kv_nope = kv_nope.to(DOT_DTYPE)
            rm = valid[:, None] & rmask[None, :]
            kv_rope = tl.load(row[:, None] + D_NOPE + dr[None, :], mask=rm, other=0.0)
        kv_rope = kv_rope.to(DOT_DTYPE)  # [BLOCK_N, BLOCK_ROPE]

        s = tl.dot(q_nope, tl.trans(kv_nope))
        s = tl.dot(q_rope, tl.trans(kv_rope), s)  # [BLOCK_H, BLOCK_N] fp32
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-invalid so far: no NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(DOT_DTYPE), kv_nope, acc * alpha[:, None])
        m_i = m_new

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(
        has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf")
    )
    o_ptrs = out_ptr + split * stride_os + t * stride_ot + heads[:, None] * stride_oh + dn[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    tl.store(lse_ptr + split * stride_ls + t * stride_lt + heads, lse, mask=hmask)


def default_config(
    num_tokens: int, num_heads: int, topk: int, device: torch.device
) -> SparseMLAConfig:
    """Tiles measured on one H200: 64 heads per program, split-K only when the batch leaves SMs
    idle (:func:`vllm.kernels.sparse_mla.num_splits`)."""
    block_h = min(64, max(16, next_pow2(num_heads)))
    num_warps = 8 if block_h == 64 else 4
    return SparseMLAConfig(
        block_h, 64, num_warps, 2, num_splits(num_tokens, num_heads, topk, device)
    )


def sparse_mla_fwd(
    q: torch.Tensor,
    kv_rows: torch.Tensor,
    fmt: RowFormat,
    indices: torch.Tensor,
    sm_scale: float,
    out_dtype: torch.dtype = torch.float32,
    config: SparseMLAConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, kv_lora + rope]; kv_rows: FP8 uint8 [num_rows, row_bytes] or float
    [num_rows, >= kv_lora + rope] (last dim contiguous); indices [T, K] int32 rows (−1 none).
    Returns out [T, H, kv_lora] ``out_dtype`` and lse [T, H] fp32 (natural log; −inf, zeros
    when a token has no valid row)."""
    t, h, d = q.shape
    if d != fmt.kv_lora + fmt.rope or indices.dim() != 2 or indices.shape[0] != t:
        raise ValueError(f"q {tuple(q.shape)} / indices {tuple(indices.shape)} / {fmt} mismatch")
    if fmt.kv_lora != next_pow2(fmt.kv_lora) or (fmt.is_fp8 and fmt.kv_lora % 128):
        raise ValueError(f"kv_lora_rank must be a power of two (x128 for FP8), got {fmt.kv_lora}")
    if fmt.is_fp8 and (kv_rows.dtype != torch.uint8 or kv_rows.shape[-1] != fmt.row_bytes):
        raise ValueError("an FP8 cache must be uint8 rows of fp8_ds_mla bytes")
    check_cuda_or_interpreter(q, kv_rows, indices)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if indices.dtype != torch.int32 or indices.stride(-1) != 1:
        indices = indices.to(torch.int32).contiguous()
    k = indices.shape[1]
    cfg = config or default_config(t, h, k, q.device)
    nhb = triton.cdiv(h, cfg.block_h)
    k_per_split = triton.cdiv(triton.cdiv(max(k, 1), cfg.num_splits), cfg.block_n) * cfg.block_n
    splits = max(1, triton.cdiv(k, k_per_split))
    out = torch.empty(t, h, fmt.kv_lora, dtype=out_dtype, device=q.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=q.device)
    if t == 0:
        return out, lse
    if splits > 1:
        part_o = torch.empty(splits, t, h, fmt.kv_lora, dtype=torch.float32, device=q.device)
        part_l = torch.empty(splits, t, h, dtype=torch.float32, device=q.device)
    else:
        part_o, part_l = out.unsqueeze(0), lse.unsqueeze(0)
    k = _sparse_mla_fwd_kernel[(t * nhb, splits)](
        q, kv_rows, indices, part_o, part_l, sm_scale * LOG2E, h, k, k_per_split,
        q.stride(0), q.stride(1), indices.stride(0), kv_rows.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l.stride(0), part_l.stride(1),
        NUM_HEAD_BLOCKS=nhb, D_NOPE=fmt.kv_lora, D_ROPE=fmt.rope, BLOCK_ROPE=max(16, next_pow2(fmt.rope)),
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, IS_FP8=fmt.is_fp8, ROW_BYTES=fmt.row_bytes,
        TILE=128, DOT_DTYPE=dot_dtype(q.device), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    record("sparse_mla_fwd", k)
    if splits > 1:
        return merge_attn_states(part_o, part_l, out_dtype=out_dtype)
    return out, lse


__all__ = ["sparse_mla_fwd", "SparseMLAConfig", "default_config"]
