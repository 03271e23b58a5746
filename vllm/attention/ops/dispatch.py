"""The one place that picks a fast kernel or the plain-torch reference for each attention op.

CUDA tensors use the Triton kernels in `vllm/kernels/` when they import; everything else (CPU, or
VLLM_USE_REF_KERNELS=1, or a shape a kernel does not cover) uses the references, which define the
semantics. Signatures here are the contract both sides honour. Triton is imported lazily, only on
the fast path, so CPU-only machines without it import this module fine.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

from vllm.attention.kv_cache import (
    KVCacheLayout,
    read_indexer_cache_ref,
    write_indexer_cache_ref,
    write_mla_cache_ref,
)
from vllm.attention.ops import indexer as idx_ops
from vllm.attention.ops.sparse_mla import (
    merge_attn_states_ref,
    sparse_mla_attend_ref,
    sparse_mla_ref,
)

_CHUNK = 64
_MODULES: dict[str, ModuleType | None] = {}


def use_fast(t: torch.Tensor) -> bool:
    return t.is_cuda and os.environ.get("VLLM_USE_REF_KERNELS", "0") != "1"


def _kernel(name: str, t: torch.Tensor, supported: bool = True) -> ModuleType | None:
    """``vllm.kernels.<name>`` when ``t`` should take the fast path, else None."""
    if not (supported and use_fast(t)):
        return None
    if name not in _MODULES:
        try:
            _MODULES[name] = importlib.import_module(f"vllm.kernels.{name}")
        except ImportError:  # no Triton: references everywhere
            _MODULES[name] = None
    return _MODULES[name]


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def write_mla_cache(cache, kv_c, k_pe, slot_mapping, layout: KVCacheLayout) -> None:
    """kv_c [N, R], k_pe [N, rope] -> paged MLA cache rows at slot_mapping (−1 = skip)."""
    fast = _kernel("kv_write", cache, _pow2(layout.kv_lora_rank) or not layout.is_fp8)
    if fast is not None:
        return fast.write_mla_cache(cache, kv_c, k_pe, slot_mapping, layout)
    write_mla_cache_ref(cache, kv_c, k_pe, slot_mapping, layout)


def write_indexer_cache(cache, k, slot_mapping, layout: KVCacheLayout) -> None:
    """k [N, D] -> indexer cache (FP8 pages or model dtype) at slot_mapping (−1 = skip)."""
    fast = _kernel("kv_write", cache, _pow2(layout.index_head_dim) or not layout.is_fp8)
    if fast is not None:
        return fast.write_indexer_cache(cache, k, slot_mapping, layout)
    write_indexer_cache_ref(cache, k, slot_mapping, layout)


def sparse_mla_decode(q, cache, slots, layout: KVCacheLayout, scale: float):
    """q [T, H, R+rope]; slots [T, K] global cache slots (−1 none) -> out [T, H, R] fp32, lse [T, H]."""
    fast = _kernel("sparse_mla_decode", q, _pow2(layout.kv_lora_rank))
    if fast is not None:
        return fast.sparse_mla_decode(q, cache, slots, layout, scale, out_dtype=torch.float32)
    return sparse_mla_ref(q, cache, slots, layout, scale)


def sparse_mla_prefill(q, kv, indices, scale: float, d_v: int):
    """MQA prefill over a flat context: q [T, H, D]; kv [S, D] (one request's full context, any
    float dtype); indices [T, K] rows of kv (−1 none) -> out [T, H, d_v] fp32, lse [T, H]."""
    fast = _kernel("sparse_mla_prefill", q, _pow2(d_v))
    if fast is not None:
        return fast.sparse_mla_prefill(q, kv, indices, scale, d_v, out_dtype=torch.float32)
    t, h, _ = q.shape
    out = torch.zeros(t, h, d_v, device=q.device)
    lse = torch.full((t, h), float("-inf"), device=q.device)
    for s in range(0, t, _CHUNK):
        idx = indices[s : s + _CHUNK].long()
        rows = kv[idx.clamp_min(0)].float()
        out[s : s + _CHUNK], lse[s : s + _CHUNK] = sparse_mla_attend_ref(
            q[s : s + _CHUNK], rows, idx >= 0, scale, d_v
        )
    return out, lse


def indexer_logits(q, q_scale, w, k, k_scale):
    """Prefill scoring against one context: q [T, H, D], q_scale/w [T, H], k [S, D], k_scale [S]
    -> logits [T, S] fp32 (no mask; callers pass the causal limit to :func:`indexer_topk`).
    q and k may be ``torch.float8_e4m3fn`` (the fast path then uses FP8 tensor cores)."""
    fast = _kernel("indexer_logits", q, _pow2(q.shape[-1]))
    if fast is not None:
        return fast.indexer_logits(q, q_scale, w, k, k_scale)
    return idx_ops.indexer_logits_ref(q, q_scale, w, k, k_scale)


def indexer_logits_paged(
    q, q_scale, w, cache, layout: KVCacheLayout, block_table, token_req, ctx_lens, max_ctx: int
):
    """Decode scoring against paged keys in *local* position space: key j of request r lives at
    slot block_table[r, j // block_size]·block_size + j % block_size. q [T, H, D]; token_req [T];
    ctx_lens [T] -> logits [T, max_ctx] fp32, −inf at j >= ctx_lens[t]."""
    fast = _kernel("indexer_logits", q, _pow2(layout.index_head_dim))
    if fast is not None:
        return fast.indexer_logits_paged(
            q, q_scale, w, cache, layout, block_table, token_req, ctx_lens, max_ctx
        )
    return indexer_logits_paged_ref(
        q, q_scale, w, cache, layout, block_table, token_req, ctx_lens, max_ctx
    )


def indexer_logits_paged_ref(
    q, q_scale, w, cache, layout: KVCacheLayout, block_table, token_req, ctx_lens, max_ctx: int
):
    """The plain-torch reference of :func:`indexer_logits_paged`."""
    t = q.shape[0]
    out = torch.full((t, max_ctx), float("-inf"), device=q.device)
    bs = layout.block_size
    j = torch.arange(max_ctx, device=q.device)
    for s in range(0, t, _CHUNK):
        tr = token_req[s : s + _CHUNK].long()
        slots = block_table[tr][:, (j // bs)].long() * bs + j % bs  # [t, max_ctx]
        valid = j.unsqueeze(0) < ctx_lens[s : s + _CHUNK].unsqueeze(1)
        k, ks = read_indexer_cache_ref(cache, torch.where(valid, slots, -1), layout)
        dots = torch.einsum("thd,tsd->tsh", q[s : s + _CHUNK].float(), k).relu_()
        coef = (w[s : s + _CHUNK].float() * q_scale[s : s + _CHUNK].float()).unsqueeze(1)
        logit = (dots * coef).sum(-1) * ks
        out[s : s + _CHUNK] = logit.masked_fill(~valid, float("-inf"))
    return out


def indexer_topk(logits, limit, topk: int):
    """logits [T, S], limit [T] -> int32 [T, topk]: the top-k set (ties to the lower position),
    −1 padded at the end; the order within a row is unspecified (the reference's is by score)."""
    fast = _kernel("topk", logits)
    if fast is not None:
        return fast.indexer_topk(logits, limit, topk)
    return idx_ops.topk_ref(logits, limit, topk)


def merge_attn_states(outs, lses):
    """outs [N, T, H, d_v], lses [N, T, H] -> LSE-weighted merge (out [T, H, d_v], lse [T, H])."""
    fast = _kernel("merge_attn", outs)
    if fast is not None:
        return fast.merge_attn_states(outs, lses)
    return merge_attn_states_ref(outs, lses)


def hisparse_resolve(
    positions, req_slot, page_table, host_page_table, hot_slots, hot_pos, hot_lru, step,
    trash_slot: int, block_size: int,
):  # fmt: skip
    """Selected positions -> cache slots for HiSparse decode (see `vllm.hisparse.resolver`):
    one fused kernel on CUDA, the torch reference elsewhere; identical results and state updates.
    `step` is an int or a 1-element int64 device tensor."""
    from vllm.hisparse import resolver

    fast = _kernel("hisparse_resolve", positions)
    if fast is not None:
        return fast.resolve_fused(
            positions, req_slot, page_table, host_page_table, hot_slots, hot_pos, hot_lru, step,
            trash_slot, block_size,
        )  # fmt: skip
    if isinstance(step, torch.Tensor):
        step = int(step.reshape(-1)[0])
    return resolver.resolve(
        positions, req_slot, page_table, host_page_table, hot_slots, hot_pos, hot_lru, step,
        trash_slot, block_size,
    )  # fmt: skip
