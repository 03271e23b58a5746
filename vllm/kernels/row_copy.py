"""Masked row copy: dst[dest[i]] = src[src_idx[i]] for every i with mask[i] (HiSparse misses).

``src`` may be a device view of pinned host memory, so only the rows that are actually missing
cross PCIe (zero-copy reads), and the mask keeps shapes fixed (no host-side count, no sync): the
Triton kernel (``vllm/kernels/triton/row_copy.py``) on CUDA, the reference elsewhere.
"""

from __future__ import annotations

import torch

from vllm.kernels import kernel_module


def masked_row_copy(
    dst: torch.Tensor,
    src: torch.Tensor,
    dest: torch.Tensor,
    src_idx: torch.Tensor,
    mask: torch.Tensor,
) -> None:
    """dst [N_dst, row], src [N_src, row] (same dtype, row bytes divisible by 4),
    dest/src_idx/mask [M]: copy the masked rows in place."""
    fast = kernel_module("triton.row_copy", dst)
    if fast is not None:
        return fast.masked_row_copy(dst, src, dest, src_idx, mask)
    masked_row_copy_ref(dst, src, dest, src_idx, mask)


def masked_row_copy_ref(
    dst: torch.Tensor,
    src: torch.Tensor,
    dest: torch.Tensor,
    src_idx: torch.Tensor,
    mask: torch.Tensor,
) -> None:
    m = mask.reshape(-1)
    dst.view(-1, dst.shape[-1])[dest.reshape(-1)[m]] = src.view(-1, src.shape[-1])[
        src_idx.reshape(-1)[m]
    ]
