"""Cache slots of (request row, position) pairs in one Triton kernel (spec:
:func:`vllm.kernels.kv_cache.cache_slots`).

The torch formula is a chain of about a dozen elementwise kernels over int64 copies of the
positions (clamp, two divisions, two remainders, the block-table gather, products, the ownership
mask, the select) and then a conversion to the attention kernels' int32: at decode, for every
layer, over T × 2,048 selected positions. Here each position is read once and its slot written
once, in the requested integer type.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.triton.utils import check_cuda_or_interpreter

__all__ = ["cache_slots"]

BLOCK = 1024


# sizes change with the batch: not specialised on them (one compiled variant per dtype pair)
@triton.jit(do_not_specialize=("n", "k", "pos_stride", "table_stride", "table_width"))
def _cache_slots_kernel(
    table_ptr,  # int32 [B, table_width]
    req_ptr,  # int [N]: request row of each row of pos
    pos_ptr,  # int [N, k] (row stride pos_stride, unit column stride)
    out_ptr,  # int32/int64 [N, k] contiguous
    n,
    k,
    pos_stride,
    table_stride,
    table_width,
    block_size: tl.constexpr,
    dcp_size: tl.constexpr,
    dcp_rank: tl.constexpr,
    interleave: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = i < n * k
    row = i // k
    p = tl.load(pos_ptr + row * pos_stride + i % k, mask=inb, other=-1).to(tl.int64)
    r = tl.load(req_ptr + row, mask=inb, other=0).to(tl.int64)
    pc = tl.maximum(p, 0)
    span = block_size * dcp_size
    col = pc // span
    ok = inb & (p >= 0) & (col < table_width)
    vblock = tl.load(table_ptr + r * table_stride + col, mask=ok, other=-1).to(tl.int64)
    off = pc % span
    local = (off // (interleave * dcp_size)) * interleave + off % interleave
    owned = ok & ((pc // interleave) % dcp_size == dcp_rank) & (vblock >= 0)
    slot = tl.where(owned, vblock * block_size + local, -1)
    tl.store(out_ptr + i, slot.to(out_ptr.dtype.element_ty), mask=inb)


def cache_slots(
    block_table: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    block_size: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """req [N], pos [N] or [N, K] (unit stride along K) -> slots of pos's shape, ``out_dtype``."""
    check_cuda_or_interpreter(block_table, req, pos)
    p2 = pos.view(-1, 1) if pos.dim() == 1 else pos
    n, k = p2.shape
    out = torch.empty(pos.shape, dtype=out_dtype, device=pos.device)
    if n * k == 0:
        return out
    table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    _cache_slots_kernel[(triton.cdiv(n * k, BLOCK),)](
        table,
        req,
        p2,
        out,
        n,
        k,
        p2.stride(0),
        table.stride(0),
        table.shape[1],
        block_size=block_size,
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
        interleave=interleave,
        BLOCK=BLOCK,
    )
    return out
