"""KV cache writes: byte-exact against write_mla_cache_ref / write_indexer_cache_ref."""

from __future__ import annotations

import pytest
import torch

from vllm.kernels.kv_cache import write_indexer_cache_ref, write_mla_cache_ref
from vllm.kv_cache_interface import KVCacheLayout


def _layout(cache_dtype: str, r: int, rope: int, d_idx: int, block_size: int = 64):
    return KVCacheLayout(cache_dtype, torch.bfloat16, r, rope, d_idx, block_size)


def _inputs(n, num_slots, layout, device, dtype, g, n_skip=2):
    kv_c = (torch.randn(n, layout.kv_lora_rank, generator=g) * 3).to(dtype)
    kv_c[0, :128] = 0.0  # an all-zero tile exercises the amax floor
    k_pe = torch.randn(n, layout.rope_dim, generator=g).to(dtype)
    k_idx = (torch.randn(n, layout.index_head_dim, generator=g) * 5).to(dtype)
    slots = torch.randperm(num_slots, generator=g)[:n]
    slots[torch.randperm(n, generator=g)[:n_skip]] = -1
    return [x.to(device) for x in (kv_c, k_pe, k_idx, slots)]


def _check_writes(kv_write, layout, n, num_blocks, device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    kv_c, k_pe, k_idx, slots = _inputs(n, num_blocks * layout.block_size, layout, device, dtype, g)
    # poison: every byte the kernel should not touch must stay as it was
    mla = torch.randint(0, 255, layout.mla_cache_shape(num_blocks), generator=g)
    mla = mla.to(layout.storage_dtype).to(device)
    idx = torch.randint(0, 255, layout.indexer_cache_shape(num_blocks), generator=g)
    idx = idx.to(layout.storage_dtype).to(device)
    mla_ref, idx_ref = mla.clone(), idx.clone()
    write_mla_cache_ref(mla_ref, kv_c, k_pe, slots, layout)
    write_indexer_cache_ref(idx_ref, k_idx, slots, layout)
    kv_write.write_mla_cache(mla, kv_c, k_pe, slots, layout)
    kv_write.write_indexer_cache(idx, k_idx, slots, layout)
    assert torch.equal(mla.view(torch.uint8), mla_ref.view(torch.uint8))
    assert torch.equal(idx.view(torch.uint8), idx_ref.view(torch.uint8))


# ---- CPU: Triton interpreter, tiny shapes ----------------------------------------------------
@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_interpreter(interp, cache_dtype, dtype):
    layout = _layout(cache_dtype, 128, 16, 32, block_size=16)
    _check_writes(interp("kv_write"), layout, 20, 3, "cpu", dtype, seed=hash(cache_dtype) % 1000)


def test_kv_write_interpreter_all_skipped(interp):
    kv_write = interp("kv_write")
    layout = _layout("fp8_ds_mla", 128, 16, 32, block_size=16)
    cache = torch.randint(0, 255, layout.mla_cache_shape(2), dtype=torch.uint8)
    before = cache.clone()
    n = 5
    slots = torch.full((n,), -1)
    kv_write.write_mla_cache(cache, torch.randn(n, 128), torch.randn(n, 16), slots, layout)
    assert torch.equal(cache, before)


# ---- GPU ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 37, 4096])
def test_kv_write_gpu(cache_dtype, dtype, n):
    from vllm.kernels.triton import kv_write

    layout = _layout(cache_dtype, 512, 64, 128)  # GLM-5.3: 656-byte rows, 132-byte keys
    _check_writes(kv_write, layout, n, 96, "cuda", dtype, seed=n)


def _check_indexer_extremes(kv_write, device, dtype):
    """Indexer keys whose amax spans the whole scale range (the floor 1e-4 up to ~1e35) and whose
    values span 12 decades within a row (e4m3 subnormals and underflow to zero): byte-exact."""
    layout = _layout("fp8_ds_mla", 128, 16, 32, block_size=16)
    g = torch.Generator().manual_seed(7)
    row_scale = torch.tensor([1e-30, 1e-6, 1e-4, 3e-3, 1.0, 447.9, 448.0, 1e3, 1e20, 1e35])
    n = row_scale.numel()
    spread = 10.0 ** (-12 * torch.rand(n, 32, generator=g))
    k = (torch.randn(n, 32, generator=g) * spread * row_scale[:, None]).to(dtype)
    slots = torch.randperm(3 * 16, generator=g)[:n]
    cache = torch.randint(0, 255, layout.indexer_cache_shape(3), generator=g).to(torch.uint8)
    cache, k, slots = cache.to(device), k.to(device), slots.to(device)
    ref = cache.clone()
    write_indexer_cache_ref(ref, k, slots, layout)  # on the same device (see kv_write's doc)
    kv_write.write_indexer_cache(cache, k, slots, layout)
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_write_extreme_scales_interpreter(interp, dtype):
    _check_indexer_extremes(interp("kv_write"), "cpu", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_write_extreme_scales_gpu(dtype):
    from vllm.kernels.triton import kv_write

    _check_indexer_extremes(kv_write, "cuda", dtype)
