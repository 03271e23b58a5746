"""Writes and reads of the paged KV caches (byte layouts: ``vllm/kv_cache_interface.py``, SPEC §3).

``write_mla_cache`` / ``write_indexer_cache`` quantise new rows and scatter them by slot mapping:
the Triton kernels (``vllm/kernels/triton/kv_write.py``) on CUDA, byte-exact with
``write_mla_cache_ref`` / ``write_indexer_cache_ref``, which run elsewhere. The reads gather and
dequantise rows by slot (the prefill paths build a request's temporary full context with them):
``read_mla_cache`` in one Triton kernel on CUDA (``vllm/kernels/triton/kv_read.py``, exact with
``read_mla_cache_ref``), ``read_indexer_cache`` in torch. Slot −1 means "no row": writes skip it,
reads return zeros. ``cache_slots`` maps (request, position) pairs to this rank's slots through
the block table (the DCP split included): one Triton kernel on CUDA
(``vllm/kernels/triton/kv_slots.py``), exact with ``cache_slots_ref``.
"""

from __future__ import annotations

import torch

from vllm.kernels import is_pow2, kernel_module
from vllm.kv_cache_interface import (
    FP8_DTYPE,
    FP8_MAX,
    INDEXER_AMAX_FLOOR,
    MLA_AMAX_FLOOR,
    MLA_TILE,
    KVCacheLayout,
)


def write_mla_cache(
    cache: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: KVCacheLayout,
) -> None:
    """Scatter new latent rows into the paged MLA cache, in place.

    cache: ``layout.mla_cache_shape(num_blocks)`` — uint8 [NB, block_size, 656] for fp8_ds_mla
    (bytes 0..R-1 e4m3 values, then R/128 fp32 scales = max(amax, 1e-4)/448 per 128-value tile,
    then ``rope`` bf16 values) or [NB, block_size, R + rope] in the model dtype for ``auto``.
    kv_c: [N, R] float; k_pe: [N, rope] float (RoPE applied); slot_mapping: [N] int, global slot =
    block * block_size + offset, −1 = skip the row.
    """
    fast = kernel_module(
        "triton.kv_write", cache, is_pow2(layout.kv_lora_rank) or not layout.is_fp8
    )
    if fast is not None:
        return fast.write_mla_cache(cache, kv_c, k_pe, slot_mapping, layout)
    write_mla_cache_ref(cache, kv_c, k_pe, slot_mapping, layout)


def write_indexer_cache(
    cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor, layout: KVCacheLayout
) -> None:
    """Scatter new indexer keys into the indexer cache, in place.

    k: [N, D] float (RoPE + Hadamard applied); slot_mapping: [N] int, −1 = skip. FP8 layout:
    uint8 [NB, block_size·(D+4)], per page all block_size×D e4m3 values first, then block_size
    fp32 scales, each the smallest power of two >= max(amax, 1e-4)/448. Otherwise
    [NB, block_size, D] in the model dtype.
    """
    fast = kernel_module(
        "triton.kv_write", cache, is_pow2(layout.index_head_dim) or not layout.is_fp8
    )
    if fast is not None:
        return fast.write_indexer_cache(cache, k, slot_mapping, layout)
    write_indexer_cache_ref(cache, k, slot_mapping, layout)


def kv_write_cost(
    num_rows: int, in_bytes_per_row: int, cache_bytes_per_row: int
) -> tuple[int, int]:
    """(flops, bytes) of a cache write: no matrix work; each new row read once, its slot read
    (8 B) and its cache row written once."""
    return 0, num_rows * (in_bytes_per_row + 8 + cache_bytes_per_row)


# ---- quantisation ------------------------------------------------------------------------------
def quantize_mla_fp8(kv_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


def quantize_indexer_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    q, scale = quantize_mla_fp8(kv_c)
    row = torch.cat(
        [
            q.view(torch.uint8),
            scale.contiguous().view(torch.uint8),
            k_pe.to(torch.bfloat16).contiguous().view(torch.uint8),
        ],
        dim=-1,
    )
    flat[slots] = row


def read_mla_cache(
    cache: torch.Tensor, slots: torch.Tensor, layout: KVCacheLayout, out_dtype=torch.float32
) -> torch.Tensor:
    """Gather and dequantise latent rows by global slot: slots [...] -> [..., kv_lora_rank + rope]
    of ``out_dtype``. Rows for slot −1 are zeros. One Triton kernel on CUDA
    (``vllm/kernels/triton/kv_read.py``), the reference elsewhere."""
    fast = kernel_module(
        "triton.kv_read",
        cache,
        cache.is_contiguous() and (is_pow2(layout.kv_lora_rank) or not layout.is_fp8),
    )
    if fast is not None:
        return fast.read_mla_cache(cache, slots, layout, out_dtype)
    return read_mla_cache_ref(cache, slots, layout, out_dtype)


def read_mla_cache_ref(
    cache: torch.Tensor, slots: torch.Tensor, layout: KVCacheLayout, out_dtype=torch.float32
) -> torch.Tensor:
    """:func:`read_mla_cache` in plain torch (the spec)."""
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
    q, scale = quantize_indexer_fp8(k)
    flat = cache.view(-1)
    v_off, s_off = _indexer_fp8_offsets(slots, layout)
    d = layout.index_head_dim
    flat[v_off.unsqueeze(-1) + torch.arange(d, device=cache.device)] = q.view(torch.uint8)
    flat[s_off.unsqueeze(-1) + torch.arange(4, device=cache.device)] = (
        scale.contiguous().view(torch.uint8).view(-1, 4)
    )


def read_indexer_cache(
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


def cache_slots(
    block_table: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    block_size: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
    out_dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """Local cache slot of each (request row, position) pair: req [N] int request rows (rows of
    ``block_table`` [B, W] int32, virtual block ids under DCP, −1 = none), pos [N] or [N, K] int
    positions (each row of pos belongs to its req). Token p lives on DCP rank (p // interleave) %
    dcp_size, at local offset (off // (interleave · dcp_size)) · interleave + off % interleave of
    virtual block p // (block_size · dcp_size), off = p % (block_size · dcp_size). Returns slots
    (block · block_size + local offset) of pos's shape in ``out_dtype``, −1 where pos < 0, where
    another DCP rank owns the token, or where its block is −1 or past the table's width.

    One Triton kernel on CUDA (``vllm/kernels/triton/kv_slots.py``), exact with
    :func:`cache_slots_ref`."""
    ok = (
        req.dim() == 1
        and pos.dim() in (1, 2)
        and pos.shape[0] == req.shape[0]
        and pos.stride(-1) == 1
        and out_dtype in (torch.int32, torch.int64)
    )
    fast = kernel_module("triton.kv_slots", pos, ok)
    if fast is not None:
        return fast.cache_slots(
            block_table, req, pos, block_size, dcp_size, dcp_rank, interleave, out_dtype
        )
    return cache_slots_ref(
        block_table, req, pos, block_size, dcp_size, dcp_rank, interleave, out_dtype
    )


def cache_slots_ref(
    block_table: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    block_size: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
    out_dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    bs, n, i = block_size, dcp_size, interleave
    if req.dim() == 1 and pos.dim() == 2:
        req = req.unsqueeze(1)
    req = req.long().expand_as(pos)
    p = pos.long().clamp_min(0)
    col = p // (bs * n)
    inside = col < block_table.shape[1]
    vblock = block_table[req, col.clamp_max(block_table.shape[1] - 1)].long()
    off = p % (bs * n)
    local = (off // (i * n)) * i + off % i
    slot = vblock * bs + local
    owned = (pos >= 0) & inside & ((p // i) % n == dcp_rank) & (vblock >= 0)
    return torch.where(owned, slot, -1).to(out_dtype)
