"""MLA cache reads in Triton: gather latent rows by slot and dequantise them in one kernel.

The spec is :func:`vllm.kernels.kv_cache.read_mla_cache_ref` (layouts in
``vllm/kv_cache_interface.py``, SPEC §3): fp8_ds_mla rows are R e4m3 values, R/128 fp32 scales
and the rope part in bf16; ``auto`` rows are R + rope values in the model dtype. A slot of −1 reads
a zero row. The reference takes ~10 eager ops with fp32 intermediates of the whole context (a
prefill chunk reads every context row of every layer); here each row is read once and written once
in the output dtype. Values are computed in fp32 and rounded once, as the reference does: exact
for fp32 output, the same rounding for bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.triton.utils import check_cuda_or_interpreter, next_pow2
from vllm.kv_cache_interface import MLA_TILE, KVCacheLayout

__all__ = ["read_mla_cache"]

# rows per program: enough bytes in flight per program for a memory-bound gather
BLOCK_R = 8


@triton.jit
def _bf16_bits_to_f32(bits):
    """bf16 bit patterns (int16) -> fp32, exact (no bf16 arithmetic: wrong in the interpreter)."""
    return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


# the row count changes with every call: not specialised on (one variant per layout and dtype)
@triton.jit(do_not_specialize=("n_rows",))
def _read_mla_fp8_kernel(
    cache_ptr,  # uint8 [num_slots, ROW_BYTES]
    slot_ptr,  # int [N], −1 = zero row
    out_ptr,  # [N, R + P] out dtype
    n_rows,
    R: tl.constexpr,  # kv_lora_rank, a multiple of TILE
    P: tl.constexpr,  # rope dim
    BLOCK_P: tl.constexpr,
    TILE: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    NT: tl.constexpr = R // TILE
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    inb = rows < n_rows
    slot = tl.load(slot_ptr + rows, mask=inb, other=-1).to(tl.int64)
    ok = slot >= 0
    base = cache_ptr + slot * ROW_BYTES
    cols = tl.arange(0, R)
    raw = tl.load(base[:, None] + cols[None, :], mask=ok[:, None], other=0)
    vals = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # [BLOCK_R, R]
    sc_ptr = (base + R).to(tl.pointer_type(tl.float32))
    sc = tl.load(sc_ptr[:, None] + tl.arange(0, NT)[None, :], mask=ok[:, None], other=0.0)
    nope = tl.reshape(tl.reshape(vals, (BLOCK_R, NT, TILE)) * sc[:, :, None], (BLOCK_R, R))
    orow = out_ptr + rows.to(tl.int64)[:, None] * (R + P)
    tl.store(orow + cols[None, :], nope.to(out_ptr.dtype.element_ty), mask=inb[:, None])
    pc = tl.arange(0, BLOCK_P)
    pm = pc[None, :] < P
    rope_ptr = (base + R + 4 * NT).to(tl.pointer_type(tl.int16))
    bits = tl.load(rope_ptr[:, None] + pc[None, :], mask=ok[:, None] & pm, other=0)
    rope = _bf16_bits_to_f32(bits)
    tl.store(orow + R + pc[None, :], rope.to(out_ptr.dtype.element_ty), mask=inb[:, None] & pm)


@triton.jit(do_not_specialize=("n_rows",))
def _read_mla_rows_kernel(
    cache_ptr,  # [num_slots, D] model dtype
    slot_ptr,  # int [N], −1 = zero row
    out_ptr,  # [N, D] out dtype
    n_rows,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    inb = rows < n_rows
    slot = tl.load(slot_ptr + rows, mask=inb, other=-1).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    cm = cols[None, :] < D
    x = tl.load(cache_ptr + slot[:, None] * D + cols[None, :], mask=(slot >= 0)[:, None] & cm)
    x = tl.where((slot >= 0)[:, None], x.to(tl.float32), 0.0)
    o = out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(o, x.to(out_ptr.dtype.element_ty), mask=inb[:, None] & cm)


def read_mla_cache(
    cache: torch.Tensor, slots: torch.Tensor, layout: KVCacheLayout, out_dtype=torch.float32
) -> torch.Tensor:
    """:func:`vllm.kernels.kv_cache.read_mla_cache` (the spec): slots [...] -> rows
    [..., kv_lora_rank + rope] of ``out_dtype``, zeros for slot −1."""
    check_cuda_or_interpreter(cache, slots)
    flat = cache.reshape(-1, cache.shape[-1])
    idx = slots.reshape(-1)
    n = idx.numel()
    d = layout.mla_dim
    out = torch.empty((n, d), dtype=out_dtype, device=cache.device)
    if n:
        grid = (triton.cdiv(n, BLOCK_R),)
        if layout.is_fp8:
            if cache.dtype != torch.uint8 or flat.shape[-1] != layout.mla_bytes_per_token:
                raise ValueError("fp8_ds_mla cache must be uint8 [..., mla_bytes_per_token]")
            _read_mla_fp8_kernel[grid](
                flat, idx, out, n,
                R=layout.kv_lora_rank, P=layout.rope_dim, BLOCK_P=next_pow2(layout.rope_dim),
                TILE=MLA_TILE, ROW_BYTES=layout.mla_bytes_per_token, BLOCK_R=BLOCK_R, num_warps=4,
            )  # fmt: skip
        else:
            if flat.shape[-1] != d:
                raise ValueError(f"cache rows of {flat.shape[-1]} values, the layout has {d}")
            _read_mla_rows_kernel[grid](
                flat, idx, out, n, D=d, BLOCK_D=next_pow2(d), BLOCK_R=BLOCK_R, num_warps=4
            )
    return out.view(*slots.shape, d)
