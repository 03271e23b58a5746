"""KV cache formats: byte-exact layouts (SPEC §3), round trips, −1 slots, byte accounting."""

from __future__ import annotations

import struct

import pytest
import torch

from vllm.config.arch import GLM_5_3, ModelArch
from vllm.kernels.kv_cache import (
    pow2_scale,
    read_indexer_cache,
    read_mla_cache,
    write_indexer_cache_ref,
    write_mla_cache_ref,
)
from vllm.kv_cache_interface import FP8_DTYPE, KVCacheLayout, kv_bytes_per_token


@pytest.fixture
def glm():
    return ModelArch.from_dict(GLM_5_3)


def test_glm53_bytes_per_token(glm):
    assert glm.num_full_layers == 21
    assert glm.full_layers[:5] == (0, 1, 2, 6, 10) and glm.full_layers[-1] == 74
    assert kv_bytes_per_token(glm, "fp8_ds_mla") == 78 * 656 + 21 * 132 + 788 == 54728
    assert kv_bytes_per_token(glm, "fp8_ds_mla", num_mtp_layers=0) == 78 * 656 + 21 * 132
    assert kv_bytes_per_token(glm, "auto", torch.bfloat16) == 79 * 1152 + 22 * 256
    # 1,048,576 tokens: 53.4 GiB; under DCP8, 6.7 GiB per GPU
    assert round(kv_bytes_per_token(glm, "fp8_ds_mla") * 2**20 / 2**30, 1) == 53.4
    assert round(kv_bytes_per_token(glm, "fp8_ds_mla") * 2**20 / 8 / 2**30, 1) == 6.7


@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
def test_accounting_matches_allocation(glm, cache_dtype):
    lay = KVCacheLayout.from_arch(glm, cache_dtype, torch.bfloat16)
    nb = 3
    mla = lay.allocate_mla(nb, "cpu")
    idx = lay.allocate_indexer(nb, "cpu")
    per_block = (glm.num_hidden_layers + 1) * mla.nbytes // nb + (
        glm.num_full_layers + 1
    ) * idx.nbytes // nb
    assert per_block == kv_bytes_per_token(glm, cache_dtype) * lay.block_size


def test_fp8_ds_mla_byte_layout(glm):
    lay = KVCacheLayout.from_arch(glm, "fp8_ds_mla", torch.bfloat16)
    assert lay.mla_bytes_per_token == 656
    cache = lay.allocate_mla(2, "cpu")
    g = torch.Generator().manual_seed(0)
    kv_c = torch.randn(3, 512, generator=g) * torch.tensor([1.0, 10.0, 0.01]).unsqueeze(1)
    kv_c[2, 128:256] = 0.0  # an all-zero tile
    k_pe = torch.randn(3, 64, generator=g)
    slots = torch.tensor([5, 64 + 63, -1])
    write_mla_cache_ref(cache, kv_c, k_pe, slots, lay)
    assert (
        cache.view(-1, 656)[[i for i in range(128) if i not in (5, 127)]].eq(0).all()
    )  # −1 wrote nothing
    for i, slot in enumerate(slots[:2].tolist()):
        row = bytes(cache.view(-1, 656)[slot].tolist())
        scales = struct.unpack("<4f", row[512:528])
        for t in range(4):
            tile = kv_c[i, t * 128 : (t + 1) * 128]
            assert scales[t] == pytest.approx(max(tile.abs().max().item(), 1e-4) / 448, rel=1e-6)
            q = torch.frombuffer(bytearray(row[t * 128 : (t + 1) * 128]), dtype=torch.uint8).view(
                FP8_DTYPE
            )
            assert torch.equal(q, (tile / torch.tensor(scales[t])).to(FP8_DTYPE))
        rope = torch.frombuffer(bytearray(row[528:656]), dtype=torch.bfloat16)
        assert torch.equal(rope, k_pe[i].to(torch.bfloat16))
    back = read_mla_cache(cache, torch.tensor([[5, 127, -1]]), lay)[0]
    assert back.shape == (3, 576) and back[2].eq(0).all()
    assert torch.allclose(
        back[0, :512], kv_c[0], rtol=2**-3, atol=kv_c[0].abs().max() / 448 * 2**-6
    )
    assert torch.equal(back[0, 512:], k_pe[0].to(torch.bfloat16).float())


def test_zero_tile_reads_zero_not_nan(glm):
    lay = KVCacheLayout.from_arch(glm, "fp8_ds_mla", torch.bfloat16)
    cache = lay.allocate_mla(1, "cpu")
    write_mla_cache_ref(cache, torch.zeros(1, 512), torch.zeros(1, 64), torch.tensor([0]), lay)
    assert read_mla_cache(cache, torch.tensor([0]), lay).eq(0).all()


def test_indexer_fp8_page_layout(glm):
    lay = KVCacheLayout.from_arch(glm, "fp8_ds_mla", torch.bfloat16)
    assert lay.indexer_bytes_per_token == 132
    cache = lay.allocate_indexer(2, "cpu")
    assert cache.shape == (2, 64 * 132)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(2, 128, generator=g) * torch.tensor([[3.0], [0.001]])
    write_indexer_cache_ref(cache, k, torch.tensor([64 + 10, 3]), lay)
    page = bytes(cache[1].tolist())
    scale = struct.unpack("<f", page[64 * 128 + 10 * 4 : 64 * 128 + 11 * 4])[0]
    expect_scale = pow2_scale(k[0].abs().max()).item()
    assert scale == expect_scale and scale == 2.0 ** round(torch.log2(torch.tensor(scale)).item())
    vals = torch.frombuffer(bytearray(page[10 * 128 : 11 * 128]), dtype=torch.uint8).view(FP8_DTYPE)
    assert torch.equal(vals, (k[0] / scale).to(FP8_DTYPE))
    # tokens not written stay zero: values region and scales region
    assert cache[1, : 10 * 128].eq(0).all() and cache[1, 11 * 128 : 64 * 128].eq(0).all()
    v, s = read_indexer_cache(cache, torch.tensor([74, 3, -1]), lay)
    assert torch.allclose(v[0] * s[0], k[0], rtol=2**-3, atol=1e-6)
    assert s[2] == 0 and v[2].eq(0).all()
    # amax floor: a near-zero key gets scale 2^ceil(log2(1e-4/448))
    small = torch.full((1, 128), 1e-9)
    write_indexer_cache_ref(cache, small, torch.tensor([0]), lay)
    assert (
        read_indexer_cache(cache, torch.tensor([0]), lay)[1].item()
        == pow2_scale(torch.tensor(1e-4)).item()
    )


def test_auto_cache_roundtrip_exact(glm):
    lay = KVCacheLayout.from_arch(glm, "auto", torch.bfloat16)
    cache = lay.allocate_mla(1, "cpu")
    kv_c, k_pe = torch.randn(2, 512).bfloat16(), torch.randn(2, 64).bfloat16()
    write_mla_cache_ref(cache, kv_c, k_pe, torch.tensor([1, 2]), lay)
    back = read_mla_cache(cache, torch.tensor([2, 1]), lay)
    assert torch.equal(back, torch.cat([kv_c, k_pe], -1)[[1, 0]].float())
    icache = lay.allocate_indexer(1, "cpu")
    k = torch.randn(2, 128).bfloat16()
    write_indexer_cache_ref(icache, k, torch.tensor([7, -1]), lay)
    v, s = read_indexer_cache(icache, torch.tensor([7]), lay)
    assert torch.equal(v[0], k[0].float()) and s.item() == 1.0


def test_bad_cache_dtype_names_flag(glm):
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        KVCacheLayout.from_arch(glm, "int4", torch.bfloat16)
