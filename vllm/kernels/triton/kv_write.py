"""KV cache writes in Triton: quantise new latent rows / indexer keys and scatter them by slot mapping.

The spec is :mod:`vllm.kernels.kv_cache`; byte-exact with ``write_mla_cache_ref`` and
``write_indexer_cache_ref`` there (the layouts are in ``vllm/kv_cache_interface.py``, SPEC §3)
run on the same device. The references divide a tensor by
the Python scalar 448; torch on CUDA computes that as a multiply by the fp32 reciprocal (one ulp
away from a true division for some inputs), on CPU as a true division: the kernels do the same
(``RECIP_DIV``) so the bytes match on either. Memory-bound: each new row read once, written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.triton.utils import (
    bf16_bits,
    check_cuda_or_interpreter,
    e4m3_bits,
    interpreting,
    next_pow2,
)
from vllm.kv_cache_interface import INDEXER_AMAX_FLOOR, MLA_AMAX_FLOOR, MLA_TILE, KVCacheLayout

__all__ = ["write_mla_cache", "write_indexer_cache"]

if not interpreting():
    from triton.language.extra import libdevice
else:  # the interpreter has no libdevice; tl.log2 is numpy's there
    libdevice = None


INV_448 = float(torch.tensor(1.0, dtype=torch.float32) / 448.0)  # fl32(1/448), as torch uses

# (rows per program, warps) of the FP8 writers: the best of `benchmarks/kernels/bench_kv_write.py
# --sweep` on an H200 (the sweep overrides them in its own process to time the alternatives)
TUNE = {"mla_fp8": (8, 4), "indexer": (8, 2)}


@triton.jit
def _div_448(x, RECIP_DIV: tl.constexpr):
    if RECIP_DIV:
        return x * 0.0022321429569274187  # INV_448: fl32(1/448) exactly
    else:
        return tl.math.div_rn(x, tl.full(x.shape, 448.0, tl.float32))


@triton.jit
def _write_mla_fp8_kernel(
    kv_c_ptr,  # [N, R] float, row stride stride_c
    k_pe_ptr,  # [N, P] float, row stride stride_pe
    slot_ptr,  # [N] int, −1 = skip
    cache_ptr,  # uint8 [num_slots, ROW_BYTES]
    n_rows,
    stride_c,
    stride_pe,
    R: tl.constexpr,  # kv_lora_rank, a multiple of TILE
    P: tl.constexpr,  # rope dim
    BLOCK_P: tl.constexpr,
    TILE: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SOFT_FP8: tl.constexpr,
    RECIP_DIV: tl.constexpr,  # amax/448 as amax * fl32(1/448), as torch does on CUDA
):
    NT: tl.constexpr = R // TILE
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    slot = tl.load(slot_ptr + rows, mask=rows < n_rows, other=-1).to(tl.int64)
    ok = slot >= 0
    base = cache_ptr + slot * ROW_BYTES  # [BLOCK_R] row starts
    cols = tl.arange(0, R)
    x = tl.load(
        kv_c_ptr + rows[:, None].to(tl.int64) * stride_c + cols[None, :], mask=ok[:, None]
    ).to(tl.float32)
    x3 = tl.reshape(x, (BLOCK_R, NT, TILE))  # [BLOCK_R, NT, TILE]
    amax = tl.maximum(tl.max(tl.abs(x3), axis=2), AMAX_FLOOR)  # [BLOCK_R, NT]
    scale = _div_448(amax, RECIP_DIV)
    y = tl.math.div_rn(x3, scale[:, :, None])
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    vals = tl.reshape(e4m3_bits(y, SOFT_FP8), (BLOCK_R, R))
    tl.store(base[:, None] + cols[None, :], vals, mask=ok[:, None])
    scale_ptr = (base + R).to(tl.pointer_type(tl.float32))
    tl.store(scale_ptr[:, None] + tl.arange(0, NT)[None, :], scale, mask=ok[:, None])
    pc = tl.arange(0, BLOCK_P)
    pm = ok[:, None] & (pc[None, :] < P)
    pe = tl.load(k_pe_ptr + rows[:, None].to(tl.int64) * stride_pe + pc[None, :], mask=pm)
    rope_ptr = (base + R + 4 * NT).to(tl.pointer_type(tl.int16))
    tl.store(rope_ptr[:, None] + pc[None, :], bf16_bits(pe.to(tl.float32)), mask=pm)


@triton.jit
def _scatter_rows_kernel(
    src_ptr,  # [N, D], row stride stride_src
    slot_ptr,  # [N] int, −1 = skip
    dst_ptr,  # [num_slots, stride_dst] same dtype as src
    n_rows,
    stride_src,
    stride_dst,
    col_offset,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slot_ptr + rows, mask=rows < n_rows, other=-1).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    m = (slot >= 0)[:, None] & (cols[None, :] < D)
    x = tl.load(src_ptr + rows[:, None].to(tl.int64) * stride_src + cols[None, :], mask=m)
    tl.store(dst_ptr + slot[:, None] * stride_dst + col_offset + cols[None, :], x, mask=m)


@triton.jit
def _write_indexer_fp8_kernel(
    k_ptr,  # [N, D] float, row stride stride_k
    slot_ptr,  # [N] int, −1 = skip
    cache_ptr,  # uint8 [num_blocks, PAGE_TOKENS * (D + 4)]
    n_rows,
    stride_k,
    D: tl.constexpr,
    PAGE_TOKENS: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SOFT_FP8: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    RECIP_DIV: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slot_ptr + rows, mask=rows < n_rows, other=-1).to(tl.int64)
    ok = slot >= 0
    cols = tl.arange(0, D)
    x = tl.load(k_ptr + rows[:, None].to(tl.int64) * stride_k + cols[None, :], mask=ok[:, None])
    x = x.to(tl.float32)  # [BLOCK_R, D]
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR)
    v = _div_448(amax, RECIP_DIV)
    # the reference's exp2(ceil(log2(v))): log2 as torch computes it (CUDA log2f) so that values a
    # hair above a power of two round the same way; the power of two is then built exactly
    if USE_LIBDEVICE:
        e = tl.ceil(libdevice.log2(v))
    else:
        e = tl.ceil(tl.log2(v))
    ei = e.to(tl.int32)  # in [-22, 120]: amax >= 1e-4 and finite
    scale = ((ei + 127) << 23).to(tl.float32, bitcast=True)  # [BLOCK_R]
    # x / 2^e is x · 2^−e exactly (2^−e is a normal float for e in that range, and both round the
    # same real number once): a multiply instead of an IEEE division per value
    inv = ((127 - ei) << 23).to(tl.float32, bitcast=True)
    y = tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0)
    page = slot // PAGE_TOKENS
    off = slot % PAGE_TOKENS
    page_base = cache_ptr + page * (PAGE_TOKENS * (D + 4))
    tl.store(
        (page_base + off * D)[:, None] + cols[None, :], e4m3_bits(y, SOFT_FP8), mask=ok[:, None]
    )
    scale_ptr = (page_base + PAGE_TOKENS * D + off * 4).to(tl.pointer_type(tl.float32))
    tl.store(scale_ptr, scale, mask=ok)


def _rows_grid(n: int, block_r: int):
    return (triton.cdiv(n, block_r),)


def write_mla_cache(
    cache: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: KVCacheLayout,
) -> None:
    """:func:`vllm.kernels.kv_cache.write_mla_cache` (the spec), byte-exact with
    ``write_mla_cache_ref``."""
    n = kv_c.shape[0]
    if kv_c.shape != (n, layout.kv_lora_rank) or k_pe.shape != (n, layout.rope_dim):
        raise ValueError(f"kv_c {tuple(kv_c.shape)} / k_pe {tuple(k_pe.shape)} do not fit {layout}")
    if slot_mapping.shape != (n,):
        raise ValueError("slot_mapping must be [N]")
    check_cuda_or_interpreter(cache, kv_c, k_pe, slot_mapping)
    if n == 0:
        return
    kv_c = kv_c if kv_c.stride(-1) == 1 else kv_c.contiguous()
    k_pe = k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous()
    flat = cache.view(-1, cache.shape[-1])
    if layout.is_fp8:
        if cache.dtype != torch.uint8 or cache.shape[-1] != layout.mla_bytes_per_token:
            raise ValueError("fp8_ds_mla cache must be uint8 [..., mla_bytes_per_token]")
        block_r, warps = TUNE["mla_fp8"]
        _write_mla_fp8_kernel[_rows_grid(n, block_r)](
            kv_c, k_pe, slot_mapping, flat, n, kv_c.stride(0), k_pe.stride(0),
            R=layout.kv_lora_rank, P=layout.rope_dim, BLOCK_P=next_pow2(layout.rope_dim),
            TILE=MLA_TILE, ROW_BYTES=layout.mla_bytes_per_token, AMAX_FLOOR=MLA_AMAX_FLOOR,
            BLOCK_R=block_r, SOFT_FP8=interpreting(), RECIP_DIV=cache.is_cuda, num_warps=warps,
        )  # fmt: skip
        return
    if kv_c.dtype != cache.dtype:
        kv_c = kv_c.to(cache.dtype)
    if k_pe.dtype != cache.dtype:
        k_pe = k_pe.to(cache.dtype)
    for src, col in ((kv_c, 0), (k_pe, layout.kv_lora_rank)):
        d = src.shape[1]
        block_r = max(1, 4096 // next_pow2(d))
        _scatter_rows_kernel[_rows_grid(n, block_r)](
            src, slot_mapping, flat, n, src.stride(0), flat.stride(0), col,
            D=d, BLOCK_D=next_pow2(d), BLOCK_R=block_r, num_warps=4,
        )  # fmt: skip


def write_indexer_cache(
    cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor, layout: KVCacheLayout
) -> None:
    """:func:`vllm.kernels.kv_cache.write_indexer_cache` (the spec), byte-exact with
    ``write_indexer_cache_ref``."""
    n, d = k.shape
    if d != layout.index_head_dim or slot_mapping.shape != (n,):
        raise ValueError(f"k {tuple(k.shape)} / slot_mapping do not fit {layout}")
    check_cuda_or_interpreter(cache, k, slot_mapping)
    if n == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    if layout.is_fp8:
        if d != next_pow2(d):
            raise ValueError(f"index_head_dim must be a power of two, got {d}")
        block_r, warps = TUNE["indexer"]
        _write_indexer_fp8_kernel[_rows_grid(n, block_r)](
            k, slot_mapping, cache, n, k.stride(0),
            D=d, PAGE_TOKENS=layout.block_size, AMAX_FLOOR=INDEXER_AMAX_FLOOR, BLOCK_R=block_r,
            SOFT_FP8=interpreting(), USE_LIBDEVICE=not interpreting(), RECIP_DIV=cache.is_cuda,
            num_warps=warps,
        )  # fmt: skip
        return
    if k.dtype != cache.dtype:
        k = k.to(cache.dtype)
    flat = cache.view(-1, d)
    block_r = max(1, 4096 // next_pow2(d))
    _scatter_rows_kernel[_rows_grid(n, block_r)](
        k, slot_mapping, flat, n, k.stride(0), d, 0,
        D=d, BLOCK_D=next_pow2(d), BLOCK_R=block_r, num_warps=4,
    )  # fmt: skip
