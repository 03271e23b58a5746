"""Sparse MLA prefill in the MQA (absorbed) form over a flat context.

On Hopper the warp-specialised Gluon kernel (:mod:`vllm.kernels.sparse_mla_ws`) runs; elsewhere
(and with ``kernel="triton"``) it is :func:`vllm.kernels.sparse_mla_fwd._sparse_mla_fwd_kernel` reading rows of a flat
[S, kv_lora + rope] tensor (one request's whole context, e.g. the temporary full copy that the
PCP×DCP path gathers); no split-K, the query count fills the GPU.
"""

from __future__ import annotations

import torch

from vllm.attention.ops.sparse_mla import sparse_mla_attend_ref, sparse_mla_cost
from vllm.kernels.sparse_mla_fwd import RowFormat, SparseMLAConfig, sparse_mla_fwd

__all__ = [
    "sparse_mla_prefill",
    "sparse_mla_prefill_ref",
    "sparse_mla_attend_ref",
    "sparse_mla_prefill_cost",
]


def sparse_mla_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    out_dtype: torch.dtype = torch.float32,
    config: SparseMLAConfig | None = None,
    kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MQA sparse attention of prefill queries over rows of one flat context.

    q: [T, H, D] bf16/fp32 absorbed queries, D = d_v + rope (GLM-5.3: 576 = 512 + 64);
    kv: [S, D] bf16/fp32 rows [c_kv | k_pe] (last dim contiguous); indices: [T, K] int rows of kv,
    −1 = none (causal padding). d_v: the value width (kv_lora_rank, a power of two).
    Returns out [T, H, d_v] ``out_dtype`` and lse [T, H] fp32 (natural log; −inf and zeros for a
    query with no valid index) — :func:`sparse_mla_prefill_ref`.
    """
    if kv.dim() != 2 or kv.shape[1] != q.shape[2] or d_v >= q.shape[2]:
        raise ValueError(f"kv {tuple(kv.shape)} must be [S, {q.shape[2]}] with d_v < D")
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    if kv.dtype == torch.float32 and kv.is_cuda:
        # the dots take bf16 anyway; fp32 rows would double the pipelined shared memory
        kv = kv.to(torch.bfloat16)
    fmt = RowFormat(d_v, q.shape[2] - d_v, is_fp8=False)
    return sparse_mla_fwd(q, kv, fmt, indices, sm_scale, out_dtype, config, kernel=kernel)


def sparse_mla_prefill_ref(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 reference: gather the rows, then :func:`sparse_mla_attend_ref`."""
    idx = indices.long()
    rows = kv[idx.clamp_min(0)].float()
    return sparse_mla_attend_ref(q, rows, idx >= 0, sm_scale, d_v)


def sparse_mla_prefill_cost(
    num_tokens: int, num_heads: int = 64, topk: int = 2048, out_bytes: int = 2
) -> tuple[int, int]:
    """(flops, bytes) at GLM-5.3 dims with bf16 rows (1152 B). Bytes count every gathered row:
    in prefill most re-reads hit L2, so the FLOP term is the one that binds."""
    return sparse_mla_cost(num_tokens, num_heads, topk, 576, 512, 1152, out_bytes=out_bytes)
