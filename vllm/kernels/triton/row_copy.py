"""Masked row copy in Triton (spec: :mod:`vllm.kernels.row_copy`).

Rows are moved as int32 words; `src` may be a device view of pinned host memory, so only the
rows that are actually missing cross PCIe (zero-copy reads), and the mask keeps shapes fixed (no
host-side count, no sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# the row count changes every call: not specialised on (one compiled variant per row width)
@triton.jit(do_not_specialize=("m_total",))
def _row_copy_kernel(
    dst_ptr,  # int32 [N_dst, W]
    src_ptr,  # int32 [N_src, W]
    dest_ptr,  # int64 [M]
    srci_ptr,  # int64 [M]
    mask_ptr,  # int8 [M]
    m_total,
    W: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """BLOCK_M entries per program: one 2-D masked load/store, so only the masked-in rows are
    read (from host memory: only they cross PCIe) and a mostly-hit batch costs few programs."""
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    inb = i < m_total
    on = (tl.load(mask_ptr + i, mask=inb, other=0) != 0) & inb
    if tl.sum(on.to(tl.int32)) > 0:
        d = tl.load(dest_ptr + i, mask=on, other=0)
        s = tl.load(srci_ptr + i, mask=on, other=0)
        cols = tl.arange(0, BLOCK_W)
        m = on[:, None] & (cols[None, :] < W)
        v = tl.load(src_ptr + s[:, None] * W + cols[None, :], mask=m)
        tl.store(dst_ptr + d[:, None] * W + cols[None, :], v, mask=m)


def masked_row_copy(
    dst: torch.Tensor,
    src: torch.Tensor,
    dest: torch.Tensor,
    src_idx: torch.Tensor,
    mask: torch.Tensor,
    block_m: int = 8,
) -> None:
    """dst [N_dst, row], src [N_src, row] (same dtype, row bytes divisible by 4), dest/src_idx/mask [M]."""
    row_bytes = dst.shape[-1] * dst.element_size()
    if row_bytes % 4:
        raise ValueError(f"row of {row_bytes} bytes is not a multiple of 4")
    w = row_bytes // 4
    d32 = dst.view(torch.uint8).view(-1, row_bytes).view(torch.int32)
    s32 = src.view(torch.uint8).view(-1, row_bytes).view(torch.int32)
    m = mask.reshape(-1).to(torch.int8)
    n = m.numel()
    if n == 0:
        return
    _row_copy_kernel[(triton.cdiv(n, block_m),)](
        d32,
        s32,
        dest.reshape(-1).long(),
        src_idx.reshape(-1).long(),
        m,
        n,
        W=w,
        BLOCK_W=triton.next_power_of_2(w),
        BLOCK_M=block_m,
        num_warps=4,
    )
