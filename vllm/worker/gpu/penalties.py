"""Repetition, frequency and presence penalties, with upstream vLLM's definitions, on the device.

Per slot the three penalties, a mask of the prompt's tokens and a count of each output token so
far, both ``[max_num_reqs, vocab]`` on the device. A request's rows are rebuilt from the tokens it
arrives with (its prompt, or prompt + outputs when it resumes after a preemption) and each step
scatter-adds the tokens it samples, so the counts equal the outputs so far, whatever the
scheduling, with no host round trip. Requests without penalties never touch the big rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm.core.messages import SamplingOptions


@dataclass
class Penalties:
    """The step's rows of the penalty state (gathered through the batch's slots)."""

    repetition: torch.Tensor  # [B] fp32, 1 = off
    frequency: torch.Tensor  # [B] fp32, 0 = off
    presence: torch.Tensor  # [B] fp32, 0 = off
    prompt_mask: torch.Tensor  # [B, V] bool: the token is in the prompt
    output_counts: torch.Tensor  # [B, V] int32: occurrences among the outputs so far


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """logits [B, V] fp32 -> penalised logits [B, V].

    Repetition penalty over the tokens of the prompt and of the outputs: a positive logit is
    divided by it, a negative one multiplied. Then OpenAI's definition over the outputs:
    ``logits -= frequency * count + presence * (count > 0)``. A row with the neutral values
    (1, 0, 0) comes out bit-identical."""
    counts = p.output_counts
    seen = counts > 0
    rep = torch.where(p.prompt_mask | seen, p.repetition.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    return logits - p.frequency.unsqueeze(1) * counts - p.presence.unsqueeze(1) * seen


class PenaltiesState:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device):
        n, self.device = max_num_reqs, device
        self.on = np.zeros(n, dtype=bool)  # host: the slot's request uses a penalty
        self.repetition = torch.ones(n, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(n, dtype=torch.float32, device=device)
        self.presence = torch.zeros(n, dtype=torch.float32, device=device)
        self.prompt_mask = torch.zeros(n, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(n, vocab_size, dtype=torch.int32, device=device)

    def add(
        self, slot: int, sp: SamplingOptions, token_ids: np.ndarray, num_prompt: int, h2d=None
    ) -> None:
        """A request entered ``slot`` knowing ``token_ids`` (the first ``num_prompt`` its prompt).
        ``h2d``: the runner's pinned staging (a pageable copy would wait for the stream)."""
        on = sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty
        # neutral values for a request without penalties: a batch that mixes both stays exact.
        # fill_ launches a kernel; `t[slot] = x` would copy x from the host and wait for it.
        self.repetition[slot].fill_(sp.repetition_penalty)
        self.frequency[slot].fill_(sp.frequency_penalty)
        self.presence[slot].fill_(sp.presence_penalty)
        self.on[slot] = bool(on)
        if not on:
            return
        ids = h2d(token_ids) if h2d is not None else torch.from_numpy(token_ids).to(self.device)
        self.prompt_mask[slot].zero_()
        self.prompt_mask[slot].index_fill_(0, ids[:num_prompt], True)
        self.output_counts[slot].zero_()
        out = ids[num_prompt:]
        self.output_counts[slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def gather(self, slots: np.ndarray, dslots: torch.Tensor) -> Penalties | None:
        """The rows of ``slots`` (host) / ``dslots`` (device), or None if no row uses a penalty."""
        if not self.on[slots].any():
            return None
        return Penalties(
            repetition=self.repetition[dslots],
            frequency=self.frequency[dslots],
            presence=self.presence[dslots],
            prompt_mask=self.prompt_mask[dslots],
            output_counts=self.output_counts[dslots],
        )

    def count_sampled(self, dslots: torch.Tensor, sampled: torch.Tensor) -> None:
        """Add the step's sampled tokens [B] of the slots [B] (distinct) to the output counts."""
        self.output_counts.index_put_(
            (dslots, sampled), torch.ones_like(sampled, dtype=torch.int32), accumulate=True
        )
