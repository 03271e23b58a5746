"""Verification of drafted tokens, on the device.

The drafter proposes each token greedily, so its proposal distribution q is one-hot on the draft
d. Rejection sampling with such a q accepts d with probability p(d) and, on rejection, samples the
residual ``(p − q)+ / Σ(p − q)+``, which is p restricted to tokens ≠ d. Both follow from one draw
x ~ p at the position: accept when x = d (probability p(d)); otherwise x is distributed as p given
x ≠ d, exactly the residual. So verification samples the target's token at every position of a
request's 1 + k rows with the ordinary sampler (its temperature, top-k/top-p, min-p and the
counter-based noise of (seed, position)) and accepts the longest prefix of drafts equal to those
samples; the sample after the accepted prefix is the correction (or, all accepted, the bonus).
Greedy rows are the special case "accept while the draft is the argmax".

Because the noise depends only on the request's seed and the token's position, the tokens emitted
this way are the tokens decoding without drafts would emit, seeded or greedy: speculation changes
the speed, not the output.
"""

from __future__ import annotations

import torch


def verify_drafts(
    sampled: torch.Tensor,
    first_row: torch.Tensor,
    num_drafts: torch.Tensor,
    drafts: torch.Tensor,
    max_drafts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafted tokens against the target's samples.

    sampled [N] int64: the target's token at every sampled position of the step; request b's
    are ``sampled[first_row[b] : first_row[b] + 1 + num_drafts[b]]`` (first_row [B] int64).
    drafts [B, ≥ max_drafts] int64: the tokens drafted last step (column j verified by the
    sample at row j). Returns (tokens [B, 1 + max_drafts] — request b's samples, valid up to
    column num_drafts[b] —, num_accepted [B] int64): b emits ``tokens[b, : num_accepted[b] + 1]``.
    """
    n = sampled.shape[0]
    j = torch.arange(1 + max_drafts, device=sampled.device)
    tokens = sampled[(first_row.unsqueeze(1) + j).clamp_max(n - 1)]
    if max_drafts == 0:
        return tokens, torch.zeros_like(first_row)
    live = j[:max_drafts].unsqueeze(0) < num_drafts.unsqueeze(1)
    match = (tokens[:, :max_drafts] == drafts[:, :max_drafts]) & live
    return tokens, match.long().cumprod(dim=1).sum(dim=1)


def synthetic_accepted(
    num_drafts: torch.Tensor, mean_length: float, generator: torch.Generator | None
) -> torch.Tensor:
    """A benchmark's stand-in for verification: accepted counts [B] whose mean (capped by each
    row's drafts) is ``mean_length − 1``, so a step emits ``mean_length`` tokens on average. The
    count is ⌊mean_length − 1 + u⌋ with u uniform in [0, 1), drawn on the device."""
    u = torch.rand(
        num_drafts.shape, generator=generator, device=num_drafts.device, dtype=torch.float64
    )
    return torch.minimum((mean_length - 1.0 + u).floor().long(), num_drafts)
