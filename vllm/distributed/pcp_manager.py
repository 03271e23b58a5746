"""Where a step's query tokens and KV live across ranks (PCP × DCP), seen from the runner.

`make_cp_planner` returns the planner for this rank's layout. The runner calls
`planner.forward(runner, inputs)` and gets the final hidden states of *every* token of the step, in
the batch's order, on every rank; sampling then runs identically everywhere.
"""

from __future__ import annotations

import torch

from vllm.attention.kv_cache import KVCacheLayout
from vllm.config import VllmConfig
from vllm.distributed.parallel_state import ParallelContext


class SingleRankPlanner:
    """No context parallelism: this rank computes every token and holds every KV row."""

    def __init__(self, pc: ParallelContext):
        self.pc = pc

    def forward(self, runner, inp) -> torch.Tensor:
        meta = runner.metadata(inp, inp.positions, inp.token_req, inp.query_start_loc.tolist())
        meta.slot_mapping = meta.slots_for(inp.token_req, inp.positions)
        return runner.model(inp.input_ids, inp.positions, meta)

    def broadcast_sampled(self, sampled: torch.Tensor) -> torch.Tensor:
        """Every rank of a replica continues from the driver's tokens (guards against any drift)."""
        return sampled

    def dummy_forward(self, runner) -> None:
        """Nothing to keep in step with."""


def make_cp_planner(config: VllmConfig, pc: ParallelContext, layout: KVCacheLayout):
    return SingleRankPlanner(pc)
