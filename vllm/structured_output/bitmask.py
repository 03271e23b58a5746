"""Token bitmasks: bit j of word w in a row allows token 32·w + j (xgrammar's layout, int32)."""

from __future__ import annotations

import torch


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (masked in place, returned), bitmask [B, ceil(V/32)] int32 on the same
    device; disallowed tokens get −inf. Elementwise torch ops only: no host sync, capturable.
    A row of −1 words allows everything."""
    b, v = logits.shape
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = (bitmask.unsqueeze(-1) >> shifts).bitwise_and_(1).view(b, -1)[:, :v]
    return logits.masked_fill_(allowed == 0, float("-inf"))


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The definition, one token at a time (for tests)."""
    out = logits.clone()
    words = bitmask.tolist()
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if not (words[r][t // 32] >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out
