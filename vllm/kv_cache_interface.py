"""Paged KV cache formats for sparse MLA (SPEC §3): byte layouts and sizes.

Two caches per layer:
  * the MLA latent cache, one row per token, shared by every head:
      - ``fp8_ds_mla``: 656 bytes for GLM-5.3 = kv_lora_rank e4m3 values | kv_lora_rank/128 fp32
        scales (amax/448 of each 128-value tile, not rounded) | qk_rope_head_dim bf16 rope values;
      - ``auto``: kv_lora_rank + qk_rope_head_dim values in the model dtype (576 bf16 = 1152 B);
  * the indexer key cache (only layers whose indexer is "full"):
      - FP8 (when the MLA cache is FP8): per page of ``block_size`` tokens, all
        ``block_size × index_head_dim`` e4m3 values first, then ``block_size`` fp32 scales;
        the scale is a power of two (amax floored at 1e-4, amax/448 rounded up to 2^k);
      - otherwise ``index_head_dim`` values in the model dtype.

A *slot* is ``block_id * block_size + offset``; slot −1 means "no row": writes skip it, reads return
zeros. The ground floor of the package: the writes and reads of these bytes are in
``vllm/kernels/kv_cache.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.config.arch import ModelArch

BLOCK_SIZE = 64
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
MLA_TILE = 128  # values per fp32 scale in fp8_ds_mla
INDEXER_AMAX_FLOOR = 1e-4
# fp8_ds_mla has no specified floor; we floor the tile amax the same way so an all-zero tile
# stores scale 1e-4/448 instead of 0 and reads back as exact zeros rather than NaN.
MLA_AMAX_FLOOR = 1e-4

CACHE_DTYPES = ("auto", "fp8_ds_mla")
CACHE_DTYPE_ALIASES = {"fp8": "fp8_ds_mla", "fp8_e4m3": "fp8_ds_mla"}


def normalize_cache_dtype(name: str) -> str:
    name = CACHE_DTYPE_ALIASES.get(name, name)
    if name not in CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype must be one of {CACHE_DTYPES} (or fp8, an alias of fp8_ds_mla), "
            f"got {name!r}"
        )
    return name


@dataclass(frozen=True)
class KVCacheLayout:
    """Byte layout of the two per-layer caches for one model and cache dtype."""

    cache_dtype: str  # "auto" | "fp8_ds_mla"
    model_dtype: torch.dtype
    kv_lora_rank: int
    rope_dim: int
    index_head_dim: int
    block_size: int = BLOCK_SIZE

    @classmethod
    def from_arch(
        cls,
        arch: ModelArch,
        cache_dtype: str,
        model_dtype: torch.dtype,
        block_size: int = BLOCK_SIZE,
    ) -> KVCacheLayout:
        cache_dtype = normalize_cache_dtype(cache_dtype)
        if cache_dtype == "fp8_ds_mla" and arch.kv_lora_rank % MLA_TILE:
            raise ValueError(
                f"--kv-cache-dtype fp8_ds_mla needs kv_lora_rank divisible by {MLA_TILE}, "
                f"got {arch.kv_lora_rank}"
            )
        return cls(
            cache_dtype,
            model_dtype,
            arch.kv_lora_rank,
            arch.qk_rope_head_dim,
            arch.index_head_dim,
            block_size,
        )

    @property
    def is_fp8(self) -> bool:
        return self.cache_dtype == "fp8_ds_mla"

    @property
    def mla_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def mla_bytes_per_token(self) -> int:
        if self.is_fp8:
            return self.kv_lora_rank + 4 * (self.kv_lora_rank // MLA_TILE) + 2 * self.rope_dim
        return self.mla_dim * _itemsize(self.model_dtype)

    @property
    def indexer_bytes_per_token(self) -> int:
        if self.is_fp8:
            return self.index_head_dim + 4
        return self.index_head_dim * _itemsize(self.model_dtype)

    # ---- allocation ----------------------------------------------------------------------
    def mla_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.is_fp8:
            return (num_blocks, self.block_size, self.mla_bytes_per_token)
        return (num_blocks, self.block_size, self.mla_dim)

    def indexer_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.is_fp8:
            return (num_blocks, self.block_size * self.indexer_bytes_per_token)
        return (num_blocks, self.block_size, self.index_head_dim)

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.is_fp8 else self.model_dtype

    def allocate_mla(self, num_blocks: int, device, pin_memory: bool = False) -> torch.Tensor:
        return torch.zeros(
            self.mla_cache_shape(num_blocks),
            dtype=self.storage_dtype,
            device=device,
            pin_memory=pin_memory,
        )

    def allocate_indexer(self, num_blocks: int, device) -> torch.Tensor:
        return torch.zeros(
            self.indexer_cache_shape(num_blocks), dtype=self.storage_dtype, device=device
        )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(
    arch: ModelArch,
    cache_dtype: str,
    model_dtype: torch.dtype = torch.bfloat16,
    num_mtp_layers: int | None = None,
) -> int:
    """KV bytes one token occupies across the whole model: every MLA layer, the indexer keys of
    the "full" layers, and each MTP layer (MLA + indexer). ``num_mtp_layers`` defaults to the
    checkpoint's ``num_nextn_predict_layers``. GLM-5.3 with fp8_ds_mla: 78·656 + 21·132 + 788 =
    54,728 bytes. The scheduler, the planner and HiSparse all use this one function."""
    layout = KVCacheLayout.from_arch(arch, cache_dtype, model_dtype)
    n_mtp = arch.num_nextn_predict_layers if num_mtp_layers is None else num_mtp_layers
    mla, idx = layout.mla_bytes_per_token, layout.indexer_bytes_per_token
    return arch.num_hidden_layers * mla + arch.num_full_layers * idx + n_mtp * (mla + idx)


def num_blocks_for(num_bytes: int, bytes_per_token: int, block_size: int = BLOCK_SIZE) -> int:
    return max(0, num_bytes // (bytes_per_token * block_size))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
