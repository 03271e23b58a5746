"""The one place that picks a fast kernel or the plain-torch reference for each attention op.

CUDA tensors use the Triton kernels in `vllm/kernels/` when they import; everything else (CPU, or
VLLM_USE_REF_KERNELS=1) uses the references, which define the semantics."""

from __future__ import annotations

import os

import torch

from vllm.attention.kv_cache import KVCacheLayout, write_indexer_cache_ref, write_mla_cache_ref
from vllm.attention.ops.sparse_mla import sparse_mla_ref


def _fast(t: torch.Tensor) -> bool:
    return t.is_cuda and os.environ.get("VLLM_USE_REF_KERNELS", "0") != "1"


def write_mla_cache(cache, kv_c, k_pe, slot_mapping, layout: KVCacheLayout) -> None:
    write_mla_cache_ref(cache, kv_c, k_pe, slot_mapping, layout)


def write_indexer_cache(cache, k, slot_mapping, layout: KVCacheLayout) -> None:
    write_indexer_cache_ref(cache, k, slot_mapping, layout)


def sparse_mla(q, cache, slots, layout: KVCacheLayout, scale: float):
    return sparse_mla_ref(q, cache, slots, layout, scale)
