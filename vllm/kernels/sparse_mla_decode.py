"""Sparse MLA decode over the paged MLA cache (fp8_ds_mla or bf16 ``auto``).

On Hopper, fp8_ds_mla calls with more than 32 heads run the CUDA C++ kernel
(:mod:`vllm.kernels.sparse_mla_cuda`) and the others the warp-specialised Gluon kernel
(:mod:`vllm.kernels.sparse_mla_ws`); elsewhere (and with ``kernel="triton"``) it is :func:`vllm.kernels.sparse_mla_fwd._sparse_mla_fwd_kernel`
reading cache rows by global slot; FP8 rows are dequantised in registers (e4m3 · per-128-value fp32 scale, bf16 rope)
and fed to bf16 tensor-core dots. Small batches split each token's top-k list across programs and
combine the slices with :func:`vllm.kernels.merge_attn.merge_attn_states`.
"""

from __future__ import annotations

import torch

from vllm.attention.kv_cache import KVCacheLayout
from vllm.attention.ops.sparse_mla import sparse_mla_cost, sparse_mla_ref
from vllm.kernels.sparse_mla_fwd import RowFormat, SparseMLAConfig, sparse_mla_fwd

__all__ = ["sparse_mla_decode", "sparse_mla_ref", "sparse_mla_decode_cost"]


def sparse_mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    layout: KVCacheLayout,
    sm_scale: float,
    out_dtype: torch.dtype = torch.float32,
    config: SparseMLAConfig | None = None,
    int_dequant: bool = False,
    kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention of decode queries over their selected cache rows.

    q: [T, H, kv_lora + rope] bf16 or fp32, the absorbed query (GLM-5.3: H ≤ 64, 512 + 64).
    cache: ``layout.mla_cache_shape(NB)`` — uint8 [NB, block_size, 656] fp8_ds_mla rows
    (512 e4m3 | 4 fp32 scales | 64 bf16 rope) or [NB, block_size, 576] bf16 for ``auto``.
    slots: [T, K] int global slots (block·block_size + offset); −1 = no row (padding).
    Returns out [T, H, kv_lora] ``out_dtype`` = softmax(sm_scale·q·kᵀ)·v with v the first kv_lora
    values of each row, and lse [T, H] fp32 natural log; a token with no valid slot gets −inf and
    zeros. Same function as :func:`sparse_mla_ref` (bf16 tensor-core rounding, see tests).
    """
    if cache.shape[-1] != (layout.mla_bytes_per_token if layout.is_fp8 else layout.mla_dim):
        raise ValueError(f"cache {tuple(cache.shape)} does not match {layout}")
    fmt = RowFormat(layout.kv_lora_rank, layout.rope_dim, layout.is_fp8)
    rows = cache.view(-1, cache.shape[-1])
    return sparse_mla_fwd(
        q, rows, fmt, slots, sm_scale, out_dtype, config, int_dequant, kernel=kernel
    )


def sparse_mla_decode_cost(
    num_tokens: int, num_heads: int = 64, topk: int = 2048, fp8: bool = True, out_bytes: int = 2
) -> tuple[int, int]:
    """(flops, bytes) at GLM-5.3 dims: 576-d QK, 512-d PV; 656-byte FP8 or 1152-byte bf16 rows."""
    row = 656 if fp8 else 1152
    return sparse_mla_cost(num_tokens, num_heads, topk, 576, 512, row, out_bytes=out_bytes)
