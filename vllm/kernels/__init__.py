"""The ops of the sparse-MLA path: one module per op, each holding its public function (the
docstring is the spec), the one place that picks the implementation for a call, the plain-torch
reference (``<op>_ref``) that defines the semantics, and the cost model (``<op>_cost``):

  * ``kv_cache``          quantise + scatter new rows into the fp8_ds_mla / indexer caches; reads;
                          the cache slots of (request, position) pairs
  * ``sparse_mla``        sparse-MLA attention, MQA form (decode over the paged cache, prefill
                          over a flat context)
  * ``merge_attn``        LSE merge of partial attentions (DCP combine, split-K combine)
  * ``indexer``           lightning-indexer scores, top-k selection, the DCP top-k merge
  * ``hisparse_resolve``  HiSparse: selected positions -> cache slots, hot-buffer LRU
  * ``row_copy``          masked row copies (HiSparse misses from pinned host memory)
  * ``fp8_gemm``          block-scaled FP8 linear (w8a8: per-token-group activation quantisation,
                          e4m3 weights with 128 x 128 scales)
  * ``moe``               routed SwiGLU experts (bf16, or e4m3 with block scales), sigmoid top-k
                          routing
  * ``sampling``          top-k / top-p masks without a vocabulary sort, fused Gumbel-max sampling
  * ``norm_rope``         RMSNorm, rotary embedding (one pass each; the rotation in place)

Implementations: Triton kernels in ``vllm/kernels/triton/`` (any CUDA GPU, and the Triton CPU
interpreter in tests), the Gluon warp-specialised kernel for Hopper (``sparse_mla_ws``), and the
CUDA C++ FP8 decode kernel for Hopper built ahead of time into ``vllm._C`` (``csrc/``, wrapped by
``sparse_mla_cuda``). CUDA tensors take the kernels; CPU tensors, and every tensor when
``VLLM_USE_REF_KERNELS=1`` (a debugging switch: the whole model on the references), take the
references. Importing this package or an op module does not import Triton: an op imports its
implementation on its first CUDA call. Nothing here imports from the floors above (attention,
model, engine); shapes and byte layouts come from ``vllm.kv_cache_interface``.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

_MODULES: dict[str, ModuleType | None] = {}


def use_kernels(t: torch.Tensor) -> bool:
    """Whether an op on ``t`` runs a compiled kernel (CUDA tensors) or its reference."""
    return t.is_cuda and os.environ.get("VLLM_USE_REF_KERNELS", "0") != "1"


def kernel_module(name: str, t: torch.Tensor, supported: bool = True) -> ModuleType | None:
    """``vllm.kernels.<name>`` (imported once) when ``t`` takes the kernel path and the call is
    ``supported`` by it; None otherwise, and where Triton is not installed."""
    if not (supported and use_kernels(t)):
        return None
    if name not in _MODULES:
        try:
            _MODULES[name] = importlib.import_module(f"vllm.kernels.{name}")
        except ImportError:  # no Triton: the references everywhere
            _MODULES[name] = None
    return _MODULES[name]


def is_pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0
