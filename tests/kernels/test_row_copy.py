"""Masked row copy (HiSparse misses) against its reference, including a host-pool source."""

from __future__ import annotations

import pytest
import torch

from vllm.kernels.row_copy import masked_row_copy_ref


def _case():
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 255, (50, 656), dtype=torch.uint8, generator=g)
    dst = torch.zeros(20, 656, dtype=torch.uint8)
    dest = torch.randperm(19, generator=g)  # distinct destinations
    sidx = torch.randint(0, 50, (dest.numel(),), generator=g)
    mask = torch.rand(dest.numel(), generator=g) < 0.5
    return src, dst, dest, sidx, mask


def test_reference_copies_only_masked_rows():
    src, dst, dest, sidx, mask = _case()
    masked_row_copy_ref(dst, src, dest, sidx, mask)
    for d, s, m in zip(dest.tolist(), sidx.tolist(), mask.tolist(), strict=True):
        assert torch.equal(dst[d], src[s]) if m else dst[d].eq(0).all()


@pytest.mark.gpu
def test_kernel_matches_reference_with_pinned_host_source():
    from vllm.hisparse.worker import device_view
    from vllm.kernels.triton.row_copy import masked_row_copy

    src, dst, dest, sidx, mask = _case()
    ref = dst.clone()
    masked_row_copy_ref(ref, src, dest, sidx, mask)
    pinned = src.pin_memory()
    out = dst.cuda()
    masked_row_copy(
        out, device_view(pinned, torch.device("cuda")), dest.cuda(), sidx.cuda(), mask.cuda()
    )
    assert torch.equal(out.cpu(), ref)
    bf = torch.randn(40, 576, dtype=torch.bfloat16)
    out2 = torch.zeros(20, 576, dtype=torch.bfloat16, device="cuda")
    ref2 = out2.cpu().clone()
    masked_row_copy_ref(ref2, bf, dest, sidx % 40, mask)
    masked_row_copy(out2, bf.cuda(), dest.cuda(), (sidx % 40).cuda(), mask.cuda())
    assert torch.equal(out2.cpu(), ref2)


@pytest.mark.parametrize("block_m", [1, 8, 16])
def test_kernel_interpreter(interp, block_m):
    """The kernel itself (CPU interpreter), entries not a multiple of the block, int64 indices."""
    mod = interp("row_copy")
    src, dst, dest, sidx, mask = _case()
    ref = dst.clone()
    masked_row_copy_ref(ref, src, dest, sidx, mask)
    mod.masked_row_copy(dst, src, dest, sidx, mask, block_m=block_m)
    assert torch.equal(dst, ref)
