"""Rotary position embedding for the 64-d rope slice of MLA keys/queries and indexer heads:
the angles here, the rotation in :mod:`vllm.kernels.norm_rope` (one pass, optionally in place)."""

from __future__ import annotations

import torch

from vllm.kernels.norm_rope import apply_rope

__all__ = ["apply_rope", "rope_cos_sin"]


def rope_cos_sin(
    positions: torch.Tensor, dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, dim/2] fp32 (one angle per rotated pair)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim)
    )
    freqs = positions.float().unsqueeze(-1) * inv_freq
    return freqs.cos(), freqs.sin()
