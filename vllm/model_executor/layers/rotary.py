"""Rotary position embedding for the 64-d rope slice of MLA keys/queries and indexer heads."""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor, dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, dim/2] fp32 (one angle per rotated pair)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim)
    )
    freqs = positions.float().unsqueeze(-1) * inv_freq
    return freqs.cos(), freqs.sin()


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """Rotate x [T, ..., dim] in place of its layout.

    interleave=True rotates pairs (x0,x1), (x2,x3), … (DeepSeek/GLM checkpoints); otherwise the
    halves (x[:d/2], x[d/2:]) (NeoX). cos/sin [T, dim/2] broadcast over middle dims.
    """
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    else:
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return out.to(x.dtype)
