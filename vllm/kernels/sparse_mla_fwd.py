"""The sparse-MLA attention kernel shared by decode (paged cache) and MQA prefill (flat context).

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

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm.kernels.triton_utils import (
    check_cuda_or_interpreter,
    dot_dtype,
    interpreting,
    next_pow2,
    record,
)

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class SparseMLAConfig:
    block_h: int  # heads per program (the MMA's M); 64 fills a Hopper wgmma
    block_n: int  # KV rows gathered per step
    num_warps: int
    num_stages: int
    num_splits: int  # slices of the top-k list per token (1 = no merge pass)


@dataclass(frozen=True)
class RowFormat:
    """How one KV row is stored. FP8: ``kv_lora`` e4m3 bytes | kv_lora/128 fp32 scales | ``rope``
    bf16 (fp8_ds_mla). Otherwise ``kv_lora + rope`` values of the tensor's dtype."""

    kv_lora: int
    rope: int
    is_fp8: bool

    @property
    def row_bytes(self) -> int:
        return self.kv_lora + 4 * (self.kv_lora // 128) + 2 * self.rope


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
    INT_DEQUANT: tl.constexpr,  # FP8 -> fp32 by integer bit moves instead of cvt instructions
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
            if INT_DEQUANT:
                # e4m3 bits moved into an fp32 (sign; exponent+mantissa at bit 20) read as
                # value · 2^-120, subnormals included; the 2^120 rides on the tile scale
                b = raw.to(tl.int32)
                vals = (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True)
            else:
                vals = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            sc_ptr = (row + D_NOPE).to(tl.pointer_type(tl.float32))
            sc = tl.load(
                sc_ptr[:, None] + tl.arange(0, NT)[None, :], mask=valid[:, None], other=0.0
            )
            if INT_DEQUANT:
                sc = sc * 1.329227995784916e36  # 2^120
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


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(
    num_tokens: int, num_heads: int, topk: int, is_fp8: bool, device: torch.device
) -> SparseMLAConfig:
    """Tiles measured on one H200 (BENCHMARKS.md): 64 heads per program, split-K only when the
    batch leaves SMs idle."""
    block_h = min(64, max(16, next_pow2(num_heads)))
    block_n = 64
    num_warps = 8 if block_h == 64 else 4
    base = max(1, num_tokens * triton.cdiv(num_heads, block_h))
    splits = max(1, min(round(_num_sms(device) / base), topk // (4 * block_n)))
    return SparseMLAConfig(block_h, block_n, num_warps, 2, splits)


def sparse_mla_fwd(
    q: torch.Tensor,
    kv_rows: torch.Tensor,
    fmt: RowFormat,
    indices: torch.Tensor,
    sm_scale: float,
    out_dtype: torch.dtype = torch.float32,
    config: SparseMLAConfig | None = None,
    int_dequant: bool = False,
    kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, kv_lora + rope]; kv_rows: FP8 uint8 [num_rows, row_bytes] or float
    [num_rows, >= kv_lora + rope] (last dim contiguous); indices [T, K] int32 rows (−1 none).
    Returns out [T, H, kv_lora] ``out_dtype`` and lse [T, H] fp32 (natural log; −inf, zeros
    when a token has no valid row).

    ``kernel``: "triton" (this module's kernel), "ws" (the warp-specialised Gluon kernel of
    :mod:`vllm.kernels.sparse_mla_ws`, Hopper and GLM-5.3 dims only), "cuda" (the CUDA C++ FP8
    decode kernel of :mod:`vllm.kernels.sparse_mla_cuda`, fp8_ds_mla rows on Hopper) or None =
    the environment's ``VLLM_SPARSE_MLA_KERNEL``, else "cuda" for FP8 calls of more than 32 heads
    on sm_90 (``_use_cuda``), "ws" where it applies and "triton" elsewhere."""
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
    cfg = config or default_config(t, h, k, fmt.is_fp8, q.device)
    nhb = triton.cdiv(h, cfg.block_h)
    k_per_split = triton.cdiv(triton.cdiv(max(k, 1), cfg.num_splits), cfg.block_n) * cfg.block_n
    splits = max(1, triton.cdiv(k, k_per_split))
    fast = None
    if t and _use_cuda(kernel, q, kv_rows, fmt, int_dequant):
        from vllm.kernels.sparse_mla_cuda import sparse_mla_fp8_cuda

        fast = sparse_mla_fp8_cuda(q, kv_rows, indices, sm_scale, out_dtype)  # its own grid
    elif t and _use_ws(kernel, q, kv_rows, fmt, int_dequant):
        from vllm.kernels.sparse_mla_ws import sparse_mla_ws

        fast = sparse_mla_ws(
            q, kv_rows, fmt.is_fp8, fmt.row_bytes, indices, sm_scale, out_dtype, cfg.num_splits
        )
    if fast is not None:  # [splits, ...] partials of a fast kernel
        part_o, part_l = fast
        if part_o.shape[0] == 1:
            return part_o[0], part_l[0]
        from vllm.kernels.merge_attn import merge_attn_states

        return merge_attn_states(part_o, part_l, out_dtype=out_dtype)
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
        TILE=128, INT_DEQUANT=int_dequant, DOT_DTYPE=dot_dtype(q.device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    record("sparse_mla_fwd", k)
    if splits > 1:
        from vllm.kernels.merge_attn import merge_attn_states

        o, lse = merge_attn_states(part_o, part_l, out_dtype=out_dtype)
        return o, lse
    return out, lse


WS_DEFAULT = True  # faster on the H200 in all but one measured row (BENCHMARKS.md, fifth session)


# The CUDA C++ FP8 decode kernel takes FP8 decode calls with more than CUDA_DEFAULT_MIN_HEADS - 1
# heads on sm_90 by default: at 64 heads it matched or beat the Gluon kernel at every measured
# batch (BENCHMARKS.md, fourteenth and fifteenth sessions). It always computes 64 heads, so at 32
# or fewer (TP >= 2) the Gluon kernel's smaller head blocks stay the default.
CUDA_DEFAULT = True
CUDA_DEFAULT_MIN_HEADS = 33


def _kernel_choice(kernel: str | None) -> str | None:
    kernel = kernel or os.environ.get("VLLM_SPARSE_MLA_KERNEL") or None
    if kernel not in (None, "ws", "triton", "cuda"):
        raise ValueError(f"kernel must be 'ws', 'cuda' or 'triton', got {kernel!r}")
    return kernel


def _use_cuda(kernel, q, kv_rows, fmt: RowFormat, int_dequant: bool) -> bool:
    """Whether the CUDA C++ kernel (:mod:`vllm.kernels.sparse_mla_cuda`, fp8_ds_mla rows on
    sm_90) takes this call. ``kernel="cuda"`` where it cannot is a ValueError saying why;
    ``VLLM_SPARSE_MLA_KERNEL=cuda`` selects it where it applies (FP8 decode) and leaves the
    other calls (bf16 prefill, other GPUs) to the default kernels. With no choice made it takes
    FP8 calls of more than 32 heads (``CUDA_DEFAULT``). Where nvcc is missing or the build
    fails, the non-strict choices fall back to the Gluon kernel (the build error is logged
    once)."""
    strict = kernel == "cuda"
    kernel = _kernel_choice(kernel)
    if kernel not in (None, "cuda") or (kernel is None and not CUDA_DEFAULT):
        return False
    if kernel is None and q.shape[1] < CUDA_DEFAULT_MIN_HEADS:
        return False
    why = None
    if not q.is_cuda or interpreting():
        why = "needs a CUDA device (no interpreter)"
    elif not fmt.is_fp8 or (fmt.kv_lora, fmt.rope) != (512, 64) or q.shape[1] > 64:
        why = f"is built for fp8_ds_mla rows, kv_lora 512, rope 64, <= 64 heads (got {fmt})"
    elif int_dequant:
        why = "has no integer-dequant variant"
    elif kv_rows.data_ptr() % 16 or kv_rows.stride(0) != fmt.row_bytes:
        why = "needs contiguous 16-byte aligned rows (it bulk-copies whole rows)"
    else:
        from vllm.kernels.sparse_mla_cuda import build_error, is_available

        why = is_available(q.device) or build_error(q.device)
    if why is not None:
        if strict:
            raise ValueError(f"the CUDA sparse-MLA kernel {why}")
        return False
    return True


def _use_ws(kernel, q, kv_rows, fmt: RowFormat, int_dequant: bool) -> bool:
    """Whether the warp-specialised Gluon kernel takes this call (see ``sparse_mla_fwd``)."""
    kernel = _kernel_choice(kernel)
    if kernel == "triton":
        return False
    if kernel == "cuda":  # the environment's choice, for a call the CUDA kernel did not take
        kernel = None
    why = None
    if not q.is_cuda or interpreting():
        why = "needs a CUDA device (no interpreter)"
    elif (fmt.kv_lora, fmt.rope) != (512, 64) or q.shape[1] > 64:
        why = f"is built for kv_lora 512, rope 64, <= 64 heads (got {fmt}, {q.shape[1]} heads)"
    elif int_dequant:
        why = "has no integer-dequant variant"
    elif not fmt.is_fp8 and kv_rows.dtype != torch.bfloat16:
        why = f"reads bf16 or fp8_ds_mla rows, not {kv_rows.dtype}"
    elif kv_rows.data_ptr() % 16 or kv_rows.stride(0) * kv_rows.element_size() % 16:
        why = "needs 16-byte aligned rows (it copies them in 16-byte pieces)"
    else:
        from vllm.kernels.sparse_mla_ws import is_supported_device

        if not is_supported_device(q.device.index or 0):
            why = "needs an sm_90 (Hopper) GPU"
    if why is not None:
        if kernel == "ws":
            raise ValueError(f"the warp-specialised sparse-MLA kernel {why}")
        return False
    return kernel == "ws" or WS_DEFAULT


def sparse_mla_flops(num_tokens: int, num_heads: int, topk: int, d_qk: int, d_v: int) -> int:
    return 2 * num_tokens * num_heads * topk * (d_qk + d_v)


__all__ = ["sparse_mla_fwd", "SparseMLAConfig", "RowFormat", "default_config", "sparse_mla_flops"]
