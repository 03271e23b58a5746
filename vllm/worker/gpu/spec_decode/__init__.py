"""Speculative decoding in the model runner (`--speculative-config`, SPEC §8).

A step's decode row of 1 + d tokens carries the last sampled token and d tokens drafted after it
last step (read on the device from ``RequestStates.next_tokens``). The runner samples a token at
every position of the row; :meth:`Drafter.verify` accepts the longest prefix of drafts matching
those samples (``rejection_sample.py``) and the row emits the accepted drafts plus one token.
Then :meth:`Drafter.propose` drafts the next step's tokens on the device. The host learns the
emitted tokens with the step's one device→host copy; the drafts never cross.

The scheduler schedules 1 + d tokens for a decode (d = num_speculative_tokens, fewer near the
request's end), and after the step moves ``num_computed_tokens`` back over the rejected drafts,
whose KV the next step overwrites.

``Drafter`` is the no-op default (no drafts: every decode row is one token); ``mtp.py`` drafts
with the checkpoint's MTP layer.
"""

from __future__ import annotations

from vllm.worker.gpu.spec_decode.drafter import DraftBatch, Drafter

__all__ = ["DraftBatch", "Drafter", "make_drafter"]


def make_drafter(runner) -> Drafter:
    """The step's drafter, chosen once from --speculative-config."""
    spec = runner.config.speculative_config
    if spec is None:
        return Drafter()
    from vllm.worker.gpu.spec_decode.mtp import MTPDrafter

    return MTPDrafter(runner, spec.num_speculative_tokens, spec.synthetic_acceptance_length)
