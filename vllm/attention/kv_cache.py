"""Paged KV cache formats for sparse MLA (SPEC §3) and their plain-torch write/read references.

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
zeros. Fast kernels must reproduce these references byte for byte (writes) or value for value (reads).
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


# ---- quantisation ------------------------------------------------------------------------------
def quantize_mla_fp8_ref(kv_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, R] float -> (e4m3 [N, R], fp32 scales [N, R/128]); scale = max(amax, 1e-4)/448."""
    n, r = kv_c.shape
    tiles = kv_c.float().view(n, r // MLA_TILE, MLA_TILE)
    amax = tiles.abs().amax(dim=-1).clamp_min(MLA_AMAX_FLOOR)
    scale = amax / FP8_MAX
    q = (tiles / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(n, r), scale


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= amax/448 (amax floored at 1e-4)."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(INDEXER_AMAX_FLOOR) / FP8_MAX)))


def quantize_indexer_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 with power-of-two scale over the last dim: [..., D] -> (e4m3 [..., D], fp32 [...])."""
    xf = x.float()
    scale = pow2_scale(xf.abs().amax(dim=-1))
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


# ---- MLA cache write / read ------------------------------------------------------------------
def write_mla_cache_ref(
    cache: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: KVCacheLayout,
) -> None:
    """Scatter new latent rows into the paged MLA cache.

    cache: ``layout.mla_cache_shape(num_blocks)``; kv_c: [N, kv_lora_rank]; k_pe: [N, rope_dim]
    (RoPE already applied); slot_mapping: [N] int, −1 = skip.
    """
    valid = slot_mapping >= 0
    if not bool(valid.any()):
        return
    slots = slot_mapping[valid].long()
    kv_c, k_pe = kv_c[valid], k_pe[valid]
    flat = cache.view(-1, cache.shape[-1])
    if not layout.is_fp8:
        flat[slots] = torch.cat([kv_c, k_pe], dim=-1).to(cache.dtype)
        return
    q, scale = quantize_mla_fp8_ref(kv_c)
    row = torch.cat(
        [
            q.view(torch.uint8),
            scale.contiguous().view(torch.uint8),
            k_pe.to(torch.bfloat16).contiguous().view(torch.uint8),
        ],
        dim=-1,
    )
    flat[slots] = row


def read_mla_cache_ref(
    cache: torch.Tensor, slots: torch.Tensor, layout: KVCacheLayout, out_dtype=torch.float32
) -> torch.Tensor:
    """Gather and dequantise latent rows by global slot: slots [...] -> [..., kv_lora_rank + rope].

    Rows for slot −1 are zeros.
    """
    flat = cache.view(-1, cache.shape[-1])
    valid = slots >= 0
    rows = flat[slots.clamp_min(0).long()]  # [..., row]
    if layout.is_fp8:
        r = layout.kv_lora_rank
        n_tiles = r // MLA_TILE
        vals = rows[..., :r].contiguous().view(FP8_DTYPE).float()
        scales = rows[..., r : r + 4 * n_tiles].contiguous().view(torch.float32)
        vals = (vals.unflatten(-1, (n_tiles, MLA_TILE)) * scales.unsqueeze(-1)).flatten(-2)
        rope = rows[..., r + 4 * n_tiles :].contiguous().view(torch.bfloat16).float()
        out = torch.cat([vals, rope], dim=-1)
    else:
        out = rows.float()
    return out.masked_fill(~valid.unsqueeze(-1), 0.0).to(out_dtype)


# ---- indexer key cache write / read -----------------------------------------------------------
def _indexer_fp8_offsets(
    slots: torch.Tensor, layout: KVCacheLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte offsets (within one flattened cache) of a slot's first value byte and its scale."""
    bs, d = layout.block_size, layout.index_head_dim
    page = bs * (d + 4)
    block, off = slots // bs, slots % bs
    return block * page + off * d, block * page + bs * d + off * 4


def write_indexer_cache_ref(
    cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor, layout: KVCacheLayout
) -> None:
    """Scatter new indexer keys [N, index_head_dim] (RoPE + Hadamard applied) by slot, −1 = skip."""
    valid = slot_mapping >= 0
    if not bool(valid.any()):
        return
    slots, k = slot_mapping[valid].long(), k[valid]
    if not layout.is_fp8:
        cache.view(-1, layout.index_head_dim)[slots] = k.to(cache.dtype)
        return
    q, scale = quantize_indexer_fp8_ref(k)
    flat = cache.view(-1)
    v_off, s_off = _indexer_fp8_offsets(slots, layout)
    d = layout.index_head_dim
    flat[v_off.unsqueeze(-1) + torch.arange(d, device=cache.device)] = q.view(torch.uint8)
    flat[s_off.unsqueeze(-1) + torch.arange(4, device=cache.device)] = (
        scale.contiguous().view(torch.uint8).view(-1, 4)
    )


def read_indexer_cache_ref(
    cache: torch.Tensor, slots: torch.Tensor, layout: KVCacheLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather indexer keys by slot: slots [...] -> (values fp32 [..., D], scales fp32 [...]).

    For the FP8 cache ``values`` are the e4m3 values as fp32 and ``scales`` their power-of-two
    scales (the logit is k_scale · Σ_h w·q_scale·ReLU(q·k)); for the full-precision cache
    ``scales`` is all ones. Rows for slot −1 are zeros with scale 0.
    """
    valid = slots >= 0
    s = slots.clamp_min(0).long()
    d = layout.index_head_dim
    if not layout.is_fp8:
        vals = cache.view(-1, d)[s].float()
        scales = valid.float()
    else:
        flat = cache.view(-1)
        v_off, s_off = _indexer_fp8_offsets(s, layout)
        vals = flat[v_off.unsqueeze(-1) + torch.arange(d, device=cache.device)]
        vals = vals.view(FP8_DTYPE).float()
        sc = flat[s_off.unsqueeze(-1) + torch.arange(4, device=cache.device)]
        scales = sc.contiguous().view(torch.float32).squeeze(-1) * valid
    return vals.masked_fill(~valid.unsqueeze(-1), 0.0), scales


def num_blocks_for(num_bytes: int, bytes_per_token: int, block_size: int = BLOCK_SIZE) -> int:
    return max(0, num_bytes // (bytes_per_token * block_size))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
