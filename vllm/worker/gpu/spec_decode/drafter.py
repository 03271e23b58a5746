"""The drafter seam of the model runner: the no-op default and what drafting gets of a step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm.worker.gpu.spec_decode.rejection_sample import verify_drafts

if TYPE_CHECKING:
    from vllm.attention.metadata import MLAMetadata
    from vllm.distributed.pcp_manager import RankStep
    from vllm.worker.gpu.input_batch import StepInputs


class Drafter:
    """No speculative decoding: nothing is drafted, every decode row verifies nothing."""

    num_spec_tokens = 0

    def verify(
        self,
        sampled: torch.Tensor,
        first_row: torch.Tensor,
        num_drafts: torch.Tensor,
        drafts: torch.Tensor,
        max_drafts: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [B, 1 + max_drafts], num_accepted [B]): see ``verify_drafts``."""
        return verify_drafts(sampled, first_row, num_drafts, drafts, max_drafts)

    def propose(self, batch: DraftBatch) -> None:
        """After every eagerly run step: draft the next step's tokens of ``batch.rows`` into
        ``next_tokens[:, 1:]`` (and keep the drafter's own KV complete, also when no row
        sampled)."""

    def dummy(self, step: RankStep, meta: MLAMetadata) -> None:
        """An idle DP replica's step: the drafting passes' collectives, matching the others'."""


class DraftBatch:
    """What drafting needs of a step that sampled (built by the runner after verification)."""

    def __init__(
        self,
        inp: StepInputs,
        rows,
        step: RankStep,
        meta: MLAMetadata,
        hidden: torch.Tensor,
        sampled: torch.Tensor,
        sampled_tok,
        first_row,
        num_accepted: torch.Tensor | None,
    ):
        self.inp, self.rows, self.step, self.meta = inp, rows, step, meta
        self.hidden = hidden  # [T, hidden] the target's final hidden states, batch order
        self.sampled = sampled  # [N] every sampled token of the step (None: no row sampled)
        self.sampled_tok = sampled_tok  # [N] host: step token index of each sampled row
        self.first_row = first_row  # [len(rows)] host: each row's first sampled row
        self.num_accepted = num_accepted  # [len(rows)] device (None: no row verified drafts)
