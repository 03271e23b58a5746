"""Sparse MLA attention in the absorbed (MQA) form: every KV row serves all heads (SPEC §2).

Reference semantics (fp32): for token t, head h, selected rows r ∈ S_t (index != −1)
    s[t,h,r]  = sm_scale · q[t,h,:] · kv[r,:]                       (over all kv_lora + rope dims)
    lse[t,h]  = log Σ_r exp(s[t,h,r])                               (natural log; −inf if S_t = ∅)
    out[t,h]  = Σ_r exp(s[t,h,r] − lse[t,h]) · kv[r, :kv_lora_rank] (zeros if S_t = ∅)

Two entry points: :func:`sparse_mla_decode` over the paged cache (fp8_ds_mla or bf16 ``auto``
rows, addressed by global slot) and :func:`sparse_mla_prefill` over one request's flat context.
The implementation is chosen per call, here and nowhere else (:func:`_decode_impl`,
:func:`_prefill_impl`):

  * fp8_ds_mla rows on Hopper: the CUDA C++ kernel built into ``vllm._C``
    (``csrc/attention/``, wrapped by :mod:`vllm.kernels.sparse_mla_cuda`), at any head count
    up to 64. Measured on an H200 against FlashMLA's FP8 sparse decode, same inputs, CUDA-graph
    replays: 1.30 / 1.21 / 1.21 / 1.21 / 1.12× faster at 64 / 128 / 256 / 512 / 1024 queries.
  * bf16 rows on Hopper (prefill over the temporary full context; decode with ``auto`` KV): the
    warp-specialised Gluon kernel (:mod:`vllm.kernels.sparse_mla_ws`).
  * any other CUDA GPU, shapes those kernels are not built for (kv_lora != 512, rope != 64,
    more than 64 heads), or ``vllm._C`` not built: the Triton kernel
    (``vllm/kernels/triton/sparse_mla_fwd.py``).
  * CPU tensors, or ``VLLM_USE_REF_KERNELS=1``: the references below.
What was tried on the way to these kernels, and why it lost: ``docs/design/``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from vllm.kernels import is_pow2, kernel_module, use_kernels
from vllm.kernels.kv_cache import read_mla_cache_ref
from vllm.kv_cache_interface import KVCacheLayout
from vllm.utils import logger

_CHUNK = 64  # query tokens per chunk of the references: bounds the [chunk, topk, 576] fp32 rows


@dataclass(frozen=True)
class RowFormat:
    """How one KV row is stored. FP8: ``kv_lora`` e4m3 bytes | kv_lora/128 fp32 scales | ``rope``
    bf16 (fp8_ds_mla). Otherwise ``kv_lora + rope`` values of the tensor's dtype."""

    kv_lora: int
    rope: int
    is_fp8: bool

    @property
    def row_bytes(self) -> int:
        return self.kv_lora + 4 * (self.kv_lora // 128) + 2 * self.rope


# ---- the ops ---------------------------------------------------------------------------------
def sparse_mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    layout: KVCacheLayout,
    sm_scale: float,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA attention of decode queries over their selected cache rows.

    q: [T, H, kv_lora + rope] bf16 or fp32, the absorbed query (GLM-5.3: H ≤ 64, 512 + 64).
    cache: ``layout.mla_cache_shape(NB)`` — uint8 [NB, block_size, 656] fp8_ds_mla rows
    (512 e4m3 | 4 fp32 scales | 64 bf16 rope) or [NB, block_size, 576] bf16 for ``auto``.
    slots: [T, K] int global slots (block·block_size + offset); −1 = no row (padding).
    Returns out [T, H, kv_lora] ``out_dtype`` = softmax(sm_scale·q·kᵀ)·v with v the first kv_lora
    values of each row, and lse [T, H] fp32 natural log; a token with no valid slot gets −inf and
    zeros. Same function as :func:`sparse_mla_ref` up to the kernels' operand rounding (bf16 or
    f16 dots; see the tests for the tolerances).
    """
    if cache.shape[-1] != (layout.mla_bytes_per_token if layout.is_fp8 else layout.mla_dim):
        raise ValueError(f"cache {tuple(cache.shape)} does not match {layout}")
    fmt = RowFormat(layout.kv_lora_rank, layout.rope_dim, layout.is_fp8)
    rows = cache.view(-1, cache.shape[-1])
    impl = _decode_impl(q, rows, fmt)
    if impl == "ref":
        out, lse = sparse_mla_ref(q, cache, slots, layout, sm_scale)
        return out.to(out_dtype), lse
    return _run(impl, q, rows, fmt, slots, sm_scale, out_dtype)


def sparse_mla_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MQA sparse attention of prefill queries over rows of one flat context.

    q: [T, H, D] bf16/fp32 absorbed queries, D = d_v + rope (GLM-5.3: 576 = 512 + 64);
    kv: [S, D] rows [c_kv | k_pe] of one request's whole context (any float dtype; on CUDA read
    as bf16); indices: [T, K] int rows of kv, −1 = none (causal padding). d_v: the value width
    (kv_lora_rank, a power of two). Returns out [T, H, d_v] ``out_dtype`` and lse [T, H] fp32
    (natural log; −inf and zeros for a query with no valid index) — :func:`sparse_mla_prefill_ref`.
    """
    if kv.dim() != 2 or kv.shape[1] != q.shape[2] or d_v >= q.shape[2]:
        raise ValueError(f"kv {tuple(kv.shape)} must be [S, {q.shape[2]}] with d_v < D")
    fmt = RowFormat(d_v, q.shape[2] - d_v, is_fp8=False)
    if _triton_or_ref(q, fmt) == "ref":
        return _prefill_chunked_ref(q, kv, indices, sm_scale, d_v, out_dtype)
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    if kv.dtype == torch.float32:  # the dots take bf16 anyway; fp32 rows double the traffic
        kv = kv.to(torch.bfloat16)
    return _run(_prefill_impl(q, kv, fmt), q, kv, fmt, indices, sm_scale, out_dtype)


# ---- implementation choice ------------------------------------------------------------------
def _glm_dims(q: torch.Tensor, fmt: RowFormat) -> bool:
    """The shapes the Hopper kernels are built for: kv_lora 512, rope 64, at most 64 heads."""
    return (fmt.kv_lora, fmt.rope) == (512, 64) and q.shape[1] <= 64


def _triton_or_ref(q: torch.Tensor, fmt: RowFormat) -> str:
    """The portable choice: the Triton kernel on CUDA (where Triton is installed and kv_lora is a
    power of two), else the reference."""
    ok = kernel_module("triton.sparse_mla_fwd", q, is_pow2(fmt.kv_lora)) is not None
    return "triton" if ok else "ref"


def _decode_impl(q: torch.Tensor, rows: torch.Tensor, fmt: RowFormat) -> str:
    if not use_kernels(q):
        return "ref"
    if fmt.is_fp8:
        if _glm_dims(q, fmt) and rows.data_ptr() % 16 == 0 and rows.stride(0) == fmt.row_bytes:
            why = _cuda_unavailable(q.device)
            if why is None:
                return "cuda"
            _warn_once(f"FP8 sparse-MLA decode runs the Triton kernel: the CUDA kernel {why}")
        return _triton_or_ref(q, fmt)
    return _prefill_impl(q, rows, fmt)


def _prefill_impl(q: torch.Tensor, rows: torch.Tensor, fmt: RowFormat) -> str:
    """bf16 rows: the Gluon kernel where it applies (16-byte aligned rows, Hopper)."""
    aligned = rows.data_ptr() % 16 == 0 and rows.stride(0) * rows.element_size() % 16 == 0
    if rows.dtype == torch.bfloat16 and _glm_dims(q, fmt) and aligned and _hopper(q.device):
        return "ws"
    return _triton_or_ref(q, fmt)


def _run(impl: str, q, rows, fmt: RowFormat, indices, sm_scale: float, out_dtype: torch.dtype):
    t, h = q.shape[:2]
    if t == 0:
        out = q.new_zeros((0, h, fmt.kv_lora), dtype=out_dtype)
        return out, q.new_zeros((0, h), dtype=torch.float32)
    if impl == "cuda":
        from vllm.kernels.sparse_mla_cuda import sparse_mla_fp8_cuda

        part_o, part_l = sparse_mla_fp8_cuda(q, rows, indices, sm_scale, out_dtype)
    elif impl == "ws":
        from vllm.kernels.sparse_mla_ws import sparse_mla_ws

        q = q if q.stride(-1) == 1 else q.contiguous()
        if indices.dtype != torch.int32 or indices.stride(-1) != 1:
            indices = indices.to(torch.int32).contiguous()
        splits = num_splits(t, q.shape[1], indices.shape[1], q.device)
        part_o, part_l = sparse_mla_ws(q, rows, indices, sm_scale, out_dtype, splits)
    else:
        triton_impl = kernel_module("triton.sparse_mla_fwd", q)
        return triton_impl.sparse_mla_fwd(q, rows, fmt, indices, sm_scale, out_dtype)
    if part_o.shape[0] == 1:
        return part_o[0].to(out_dtype), part_l[0]
    from vllm.kernels.merge_attn import merge_attn_states

    return merge_attn_states(part_o, part_l, out_dtype=out_dtype)


@functools.lru_cache(maxsize=8)
def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


@functools.lru_cache(maxsize=8)
def _cuda_unavailable(device: torch.device) -> str | None:
    from vllm.kernels.sparse_mla_cuda import is_available

    return is_available(device)


@functools.lru_cache(maxsize=8)
def _warn_once(msg: str) -> None:
    logger.warning(msg)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(num_tokens: int, num_heads: int, topk: int, device: torch.device) -> int:
    """Slices of each token's top-k list (split-K, merged by LSE) for the Triton and Gluon
    kernels: one unless the batch leaves SMs idle, at least 4 blocks of 64 rows per slice."""
    block_h = min(64, max(16, 1 << max(0, num_heads - 1).bit_length()))
    base = max(1, num_tokens * -(-num_heads // block_h))
    return max(1, min(round(_num_sms(device) / base), topk // 256))


# ---- references ------------------------------------------------------------------------------
def sparse_mla_attend_ref(
    q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sm_scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D]; kv [T, K, D] fp32 rows (already gathered); valid [T, K] bool.

    Returns out [T, H, d_v] fp32 and lse [T, H] fp32.
    """
    scores = torch.einsum("thd,tkd->thk", q.float(), kv) * sm_scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [T, H]
    p = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min))
    p = torch.nan_to_num(p, nan=0.0)
    out = torch.einsum("thk,tkd->thd", p, kv[..., :d_v])
    return out, lse


def sparse_mla_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    layout: KVCacheLayout,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over a paged cache, fp32.

    q: [T, H, kv_lora_rank + rope] (absorbed query); cache: MLA cache of ``layout``;
    indices: [T, K] int global slots, −1 = none. Returns out [T, H, kv_lora_rank] fp32 and
    lse [T, H] fp32 (−inf and zeros for a token with no valid slot).
    """
    t, h, _ = q.shape
    out = q.new_zeros((t, h, layout.kv_lora_rank), dtype=torch.float32)
    lse = q.new_full((t, h), float("-inf"), dtype=torch.float32)
    for s in range(0, t, _CHUNK):
        idx = indices[s : s + _CHUNK]
        kv = read_mla_cache_ref(cache, idx, layout)  # the reference reads in plain torch
        o, lse_c = sparse_mla_attend_ref(
            q[s : s + _CHUNK], kv, idx >= 0, sm_scale, layout.kv_lora_rank
        )
        out[s : s + _CHUNK], lse[s : s + _CHUNK] = o, lse_c
    return out, lse


def sparse_mla_prefill_ref(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 reference of :func:`sparse_mla_prefill`: gather the rows, then attend."""
    idx = indices.long()
    rows = kv[idx.clamp_min(0)].float()
    return sparse_mla_attend_ref(q, rows, idx >= 0, sm_scale, d_v)


def _prefill_chunked_ref(q, kv, indices, sm_scale: float, d_v: int, out_dtype: torch.dtype):
    """:func:`sparse_mla_prefill_ref` in query chunks (bounded memory: the CPU serving path)."""
    t, h, _ = q.shape
    out = torch.zeros(t, h, d_v, device=q.device)
    lse = torch.full((t, h), float("-inf"), device=q.device)
    for s in range(0, t, _CHUNK):
        e = s + _CHUNK
        out[s:e], lse[s:e] = sparse_mla_prefill_ref(q[s:e], kv, indices[s:e], sm_scale, d_v)
    return out.to(out_dtype), lse


# ---- cost ------------------------------------------------------------------------------------
def sparse_mla_cost(
    num_tokens: int,
    num_heads: int,
    topk: int,
    d_qk: int,
    d_v: int,
    row_bytes: int,
    q_bytes: int = 2,
    out_bytes: int = 2,
) -> tuple[int, int]:
    """(flops, bytes) of sparse MLA: QK over d_qk and PV over d_v for every selected row and head;
    bytes = gathered rows + indices + q + out (+ lse)."""
    flops = 2 * num_tokens * num_heads * topk * (d_qk + d_v)
    nbytes = num_tokens * topk * (row_bytes + 4) + num_tokens * num_heads * (
        d_qk * q_bytes + d_v * out_bytes + 4
    )
    return flops, nbytes


def sparse_mla_decode_cost(
    num_tokens: int, num_heads: int = 64, topk: int = 2048, fp8: bool = True, out_bytes: int = 2
) -> tuple[int, int]:
    """(flops, bytes) at GLM-5.3 dims: 576-d QK, 512-d PV; 656-byte FP8 or 1152-byte bf16 rows."""
    row = 656 if fp8 else 1152
    return sparse_mla_cost(num_tokens, num_heads, topk, 576, 512, row, out_bytes=out_bytes)


def sparse_mla_prefill_cost(
    num_tokens: int, num_heads: int = 64, topk: int = 2048, out_bytes: int = 2
) -> tuple[int, int]:
    """(flops, bytes) at GLM-5.3 dims with bf16 rows (1152 B). Bytes count every gathered row:
    in prefill most re-reads hit L2, so the FLOP term is the one that binds."""
    return sparse_mla_cost(num_tokens, num_heads, topk, 576, 512, 1152, out_bytes=out_bytes)
