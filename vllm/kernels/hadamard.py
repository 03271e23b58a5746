"""Walsh–Hadamard rotation of the indexer's queries and keys (scale D^-0.5, orthonormal).

It leaves full-precision dot products unchanged and spreads outliers before FP8 quantisation.

16-bit inputs take one tensor-core GEMM with the ±1 matrix (exact in bf16 and fp16): products
exact, fp32 accumulation, D^-0.5 applied in the GEMM's fp32 epilogue (``alpha``), one rounding to
the input dtype. The reference (:func:`hadamard_transform_ref`, what fp32 inputs run) widens x to
fp32 and multiplies by the scaled matrix: an fp32 GEMM plus two conversion passes, 0.74 ms of an
8K-token prefill step on an H100. Both are the exact rotation rounded once to the output dtype,
give or take the fp32 sum's rounding (the reference also rounds each scaled entry of H: where the
exact value is 0 it returns ~1e-8, the GEMM form 0)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=16)
def _sign_matrix(d: int, device_str: str, dtype: torch.dtype) -> torch.Tensor:
    """The Sylvester-order ±1 matrix of size d (unscaled)."""
    assert d > 0 and d & (d - 1) == 0, "Hadamard size must be a power of two"
    # a normal tensor even when first built under inference mode: the cache outlives the call,
    # and a later caller with autograd on could not use an inference tensor in its graph
    with torch.inference_mode(False):
        h = torch.ones(1, 1, dtype=torch.float32)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h.to(device=device_str, dtype=dtype)


def hadamard_transform_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> x · H_D / sqrt(D) in fp32, cast back to x.dtype (Sylvester order)."""
    d = x.shape[-1]
    return (x.float() @ (_sign_matrix(d, str(x.device), torch.float32) * d**-0.5)).to(x.dtype)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """:func:`hadamard_transform_ref`; 16-bit inputs as one GEMM in their dtype (module doc)."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return hadamard_transform_ref(x)
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    h = _sign_matrix(d, str(x.device), x.dtype)
    # beta = 0: the input term is ignored (x2 only gives the output's shape)
    return torch.addmm(x2, x2, h, beta=0, alpha=d**-0.5).view(x.shape)
