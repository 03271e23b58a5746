"""Per-step seams of the model runner, for features that keep per-request state beside the model
(Hybrid HiSparse now; MTP drafting and KV connectors plug in the same way).

The runner calls each method at its point of the step; every default does nothing, so the runner
never asks whether a feature is on. A feature is chosen once at start-up
(``ModelRunner._kv_features``) and implements the methods it needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm.attention.metadata import MLAMetadata
    from vllm.core.messages import CachedRequestData, NewRequestData
    from vllm.worker.gpu.input_batch import StepInputs


class StepHooks:
    # Whether the runner may launch the next step before reading this one's results
    # (``ModelRunner.can_pipeline``, --async-scheduling): true when every hook's per-step work
    # follows from the scheduler's messages and device state alone, its device work ordered on
    # the streams, nothing read back on the host before the step's own sync. The no-op hooks
    # do; a feature's hooks only when their class says so.
    pipelines: bool = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "pipelines" not in cls.__dict__:
            cls.pipelines = False

    def add_request(self, slot: int, req: NewRequestData) -> None:
        """A request entered persistent slot `slot` (after the runner recorded its blocks)."""

    def update_request(self, slot: int, req: CachedRequestData) -> None:
        """A running request's update for this step (after its new blocks were appended)."""

    def before_forward(self, inp: StepInputs) -> None:
        """The step's inputs are built; the model has not run."""

    def build_metadata(self, inp: StepInputs, meta: MLAMetadata) -> None:
        """Add the feature's part of the attention metadata (``meta.<feature>``)."""

    def graph_metadata(
        self, meta: MLAMetadata, slots: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """The feature's part of a captured decode step's metadata, from device tensors only
        (``slots`` [B] persistent slot per row, ``positions`` [B], −1 on padding rows)."""

    def after_forward(self, inp: StepInputs) -> None:
        """The model ran (work may still be queued on the device); sampling has not."""

    def after_step(self, inp: StepInputs, num_accepted: torch.Tensor | None) -> None:
        """Sampling, verification and drafting are queued (the target's and the drafter's KV
        writes with them); the device→host sync has not happened. ``num_accepted``
        [len(inp.sample_rows)] on the device: the drafts each sampling row accepted (None: no
        row verified drafts); the KV of a row's first ``seq_lens − num_drafts + accepted``
        positions is final, the rest (rejected drafts) is rewritten by a later step."""

    def device_stats(self) -> dict[str, torch.Tensor]:
        """Device counters to bring to the host with the step's one device→host copy."""
        return {}

    def host_stats(self, host: dict[str, torch.Tensor]) -> dict[str, float]:
        """The step's worker counters (``ModelRunnerOutput.stats``) from those copies."""
        return {}
