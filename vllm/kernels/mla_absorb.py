"""MLA's per-head absorption products: out[t, h] = x[t, h] · w[h] (decode queries through W_UK,
attention outputs through W_UVᵀ), written into a strided destination.

Up to :data:`TRITON_MAX_TOKENS` tokens on CUDA: the Triton kernel
(``vllm/kernels/triton/head_bmm.py``; cuBLAS's batched GEMM reads the weights at ~30 % of the
copy bandwidth at decode sizes). Elsewhere, and for prefill-sized batches, the reference: one
``torch.bmm`` over the heads (cuBLAS takes the strided views without copies). Both accumulate in
fp32 and round once; they differ only in the summation order.
"""

from __future__ import annotations

import torch

from vllm.kernels import kernel_module

TRITON_MAX_TOKENS = 256


def head_bmm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x [T, H, K], w [H, K, N] (any strides), out [T, H, N] (a view to write into; unit last
    stride) -> out."""
    t, h, k = x.shape
    n = w.shape[2]
    ok = (
        0 < t <= TRITON_MAX_TOKENS
        and x.dtype == w.dtype == out.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and k % 64 == 0
        and n % 64 == 0
        and x.stride(-1) == 1
        and out.stride(-1) == 1
    )
    fast = kernel_module("triton.head_bmm", x, ok)
    if fast is not None:
        fast.head_bmm(x, w, out)
        return out
    return head_bmm_ref(x, w, out)


def head_bmm_ref(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    torch.bmm(x.to(w.dtype).transpose(0, 1), w, out=out.transpose(0, 1))
    return out
