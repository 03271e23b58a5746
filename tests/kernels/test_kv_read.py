"""MLA cache reads (gather + dequantise by slot): the Triton kernel against read_mla_cache_ref on
caches written by the cache writer (fp8_ds_mla) or filled at random (``auto``), slots in any
order and shape, −1 slots reading zero rows."""

from __future__ import annotations

import pytest
import torch

from vllm.kernels.kv_cache import read_mla_cache_ref, write_mla_cache_ref
from vllm.kv_cache_interface import KVCacheLayout


def _layout(cache_dtype: str, r: int = 256, rope: int = 64):
    return KVCacheLayout(cache_dtype, torch.bfloat16, r, rope, 32, 16)


def _cache(layout: KVCacheLayout, num_blocks: int, g: torch.Generator) -> torch.Tensor:
    n = num_blocks * layout.block_size
    kv_c = torch.randn(n, layout.kv_lora_rank, generator=g) * 3
    kv_c[5, :128] = 0.0  # a tile at the amax floor
    k_pe = torch.randn(n, layout.rope_dim, generator=g)
    cache = layout.allocate_mla(num_blocks, "cpu")
    write_mla_cache_ref(cache, kv_c, k_pe, torch.arange(n), layout)
    return cache


def _slots(shape, num_slots: int, g: torch.Generator) -> torch.Tensor:
    s = torch.randint(0, num_slots, shape, generator=g)
    s.view(-1)[torch.randperm(s.numel(), generator=g)[:3]] = -1
    return s


def test_reference_reads_back_what_was_written():
    """The reference's fp8 rows are the written values within e4m3 rounding (half an ulp of the
    top binade, 16 in units of the tile's scale amax / 448), rope exact in bf16, zeros for −1."""
    g = torch.Generator().manual_seed(0)
    layout = _layout("fp8_ds_mla")
    n = 4 * layout.block_size
    kv_c = torch.randn(n, layout.kv_lora_rank, generator=g) * 3
    k_pe = torch.randn(n, layout.rope_dim, generator=g)
    cache = layout.allocate_mla(4, "cpu")
    write_mla_cache_ref(cache, kv_c, k_pe, torch.arange(n), layout)
    slots = torch.tensor([3, -1, 17, 63])
    got = read_mla_cache_ref(cache, slots, layout)
    ok = slots >= 0
    want = torch.cat([kv_c, k_pe.bfloat16().float()], -1)[slots.clamp_min(0)]
    tile_amax = kv_c[slots[ok]].view(-1, 2, 128).abs().amax(-1).repeat_interleave(128, -1)
    err = (got[ok, :256] - want[ok, :256]).abs()
    assert (err <= tile_amax / 448 * 16 * (1 + 1e-6)).all()
    assert err.max() > 0  # really quantised
    assert torch.equal(got[ok, 256:], want[ok, 256:])
    assert got[1].eq(0).all()


@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
@pytest.mark.parametrize("shape", [(37,), (1, 13), (2, 3, 5)])
def test_kernel_interpreter(interp, cache_dtype, shape):
    """The kernel (CPU interpreter), fp32 output: bit-exact with the reference."""
    mod = interp("kv_read")
    g = torch.Generator().manual_seed(1)
    layout = _layout(cache_dtype)
    cache = _cache(layout, 4, g)
    slots = _slots(shape, 4 * layout.block_size, g)
    got = mod.read_mla_cache(cache, slots, layout, torch.float32)
    assert got.shape == (*shape, layout.mla_dim)
    assert torch.equal(got, read_mla_cache_ref(cache, slots, layout, torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_kernel_cuda_matches_reference(cache_dtype, out_dtype):
    """GLM-5.3's row (512 + 64), every slot of a 64K context in random order, through the public
    op (the Triton path on CUDA): bit-exact with the reference run on the same device."""
    from vllm.kernels.kv_cache import read_mla_cache

    g = torch.Generator().manual_seed(2)
    layout = KVCacheLayout(cache_dtype, torch.bfloat16, 512, 64, 128, 64)
    cache = _cache(layout, 1024, g).cuda()
    slots = _slots((1, 1024 * 64), 1024 * 64, g).cuda()
    got = read_mla_cache(cache, slots, layout, out_dtype)
    assert torch.equal(got, read_mla_cache_ref(cache, slots, layout, out_dtype))
