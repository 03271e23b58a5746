"""Walsh–Hadamard rotation of the indexer's queries and keys (scale D^-0.5, orthonormal).

It leaves full-precision dot products unchanged and spreads outliers before FP8 quantisation."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def _hadamard_matrix(d: int, device_str: str) -> torch.Tensor:
    assert d > 0 and d & (d - 1) == 0, "Hadamard size must be a power of two"
    # a normal tensor even when first built under inference mode: the cache outlives the call,
    # and a later caller with autograd on could not use an inference tensor in its graph
    with torch.inference_mode(False):
        h = torch.ones(1, 1, dtype=torch.float32)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return (h * d**-0.5).to(device_str)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> x · H_D / sqrt(D) in fp32, cast back to x.dtype (Sylvester order)."""
    h = _hadamard_matrix(x.shape[-1], str(x.device))
    return (x.float() @ h).to(x.dtype)
