"""Where a step's query tokens and KV live across ranks (PCP × DCP), seen from the runner.

PCP (SPEC §4): each prefill request's scheduled tokens are cut into 2N chunks of ceil(n/2N) tokens
and PCP rank r takes chunks r and 2N−1−r (the "V" pattern: one cheap early chunk and one expensive
late chunk each). Decode rows are *not* replicated: the j-th decode request of the step goes to
rank j mod N, so every rank does 1/N of the decode MLP/MoE work too. Every rank pads its token
list to the same length; padding rows write nothing (slot −1). New latent KV and indexer keys are
all-gathered inside each attention layer before the cache write (`kv_access.gather_new_rows`),
and after the last layer the hidden states are all-gathered and put back in batch order, so
sampling runs identically on every rank.

The planner is deterministic in the scheduler output, so every rank knows every other rank's
share without communicating. It returns this rank's share of the step (:class:`RankStep`); the
model runner builds the metadata and runs the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.attention.metadata import CPMetadata
from vllm.config import ParallelConfig
from vllm.distributed.parallel_state import ParallelContext

if TYPE_CHECKING:
    from vllm.worker.gpu.input_batch import StepInputs


def v_chunks(n: int, pcp: int) -> list[tuple[int, int]]:
    """Token ranges [lo, hi) of the 2·pcp chunks of a prompt of n tokens (tail chunks may be empty)."""
    c = -(-n // (2 * pcp))
    return [(min(k * c, n), min((k + 1) * c, n)) for k in range(2 * pcp)]


@dataclass
class PCPShard:
    """One step's token split: per PCP rank, indices into the step's (global) token array."""

    per_rank: list[np.ndarray]  # [N] arrays of global token indices, grouped by request
    per_rank_counts: np.ndarray  # [N, B] tokens of request b on rank r
    pad: int  # tokens per rank after padding
    gathered: np.ndarray  # [N·pad] global token index of each gathered row, −1 = padding
    restore: np.ndarray  # [T] row of the gathered array holding global token t


def shard_tokens(qsl: np.ndarray, is_prefill: np.ndarray, pcp: int) -> PCPShard:
    b = len(qsl) - 1
    parts: list[list[np.ndarray]] = [[] for _ in range(pcp)]
    counts = np.zeros((pcp, b), dtype=np.int64)
    j = 0
    for r in range(b):
        lo, n = int(qsl[r]), int(qsl[r + 1] - qsl[r])
        if is_prefill[r]:
            ch = v_chunks(n, pcp)
            for k in range(pcp):
                (a0, a1), (b0, b1) = ch[k], ch[2 * pcp - 1 - k]
                idx = np.concatenate([np.arange(lo + a0, lo + a1), np.arange(lo + b0, lo + b1)])
                parts[k].append(idx)
                counts[k, r] = len(idx)
        else:
            k = j % pcp
            j += 1
            parts[k].append(np.arange(lo, lo + n))
            counts[k, r] = n
    per_rank = [np.concatenate(p) if p else np.zeros(0, dtype=np.int64) for p in parts]
    pad = max(1, max(len(p) for p in per_rank))
    gathered = np.full(pcp * pad, -1, dtype=np.int64)
    for k, p in enumerate(per_rank):
        gathered[k * pad : k * pad + len(p)] = p
    restore = np.empty(int(qsl[-1]), dtype=np.int64)
    valid = gathered >= 0
    restore[gathered[valid]] = np.nonzero(valid)[0]
    return PCPShard(per_rank, counts, pad, gathered, restore)


@dataclass
class RankStep:
    """This rank's share of a step: the tokens it computes, and the new KV rows it writes."""

    input_ids: torch.Tensor  # [T_rank]
    positions: torch.Tensor  # [T_rank] int64
    token_req: torch.Tensor  # [T_rank] batch row of each token
    query_start_loc_cpu: list[int]  # [B+1] this rank's tokens of each request
    positions_cpu: np.ndarray | None  # [T_rank] host copy of positions (None: device only)
    # the new KV rows written this step, as (batch row, position); position −1: padding. Under
    # PCP every rank's tokens, in gather order; else this rank's own
    kv_token_req: torch.Tensor
    kv_positions: torch.Tensor
    cp: CPMetadata | None = None
    restore: torch.Tensor | None = None  # [T] row of the PCP-gathered hidden states per token
    pad: int = 0  # tokens per PCP rank after padding
    token_index: torch.Tensor | None = None  # [T_rank] this rank's tokens in the step (None: all)


class SingleRankPlanner:
    """No context parallelism: this rank computes every token and holds every KV row."""

    def __init__(self, pc: ParallelContext):
        self.pc = pc

    def shard(self, inp: StepInputs) -> RankStep:
        return RankStep(
            input_ids=inp.input_ids,
            positions=inp.positions,
            token_req=inp.token_req,
            query_start_loc_cpu=inp.query_start_loc.tolist(),
            positions_cpu=inp.positions_np,
            kv_token_req=inp.token_req,
            kv_positions=inp.positions,
        )

    def shard_decode(self, input_ids: torch.Tensor, positions: torch.Tensor) -> RankStep:
        """A step of one decode token per request (drafting), positions on the device only
        (−1: a padding row, which writes nothing)."""
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        return RankStep(
            input_ids=input_ids,
            positions=positions,
            token_req=rows,
            query_start_loc_cpu=list(range(input_ids.shape[0] + 1)),
            positions_cpu=None,
            kv_token_req=rows,
            kv_positions=positions,
        )

    def gather_hidden(self, hidden: torch.Tensor, step: RankStep) -> torch.Tensor:
        """[T_rank, hidden] -> [T, hidden] in the batch's token order, on every rank."""
        return hidden

    def dummy_step(self, device: torch.device) -> RankStep | None:
        """A step of one padding token and no requests, where the step's collectives must run
        to match the other ranks (DP replicas sharing EP); None: nothing to keep in step with."""
        return None

    def broadcast_sampled(self, sampled: torch.Tensor) -> torch.Tensor:
        return sampled


class CPPlanner(SingleRankPlanner):
    """PCP token sharding and/or DCP KV sharding (and TP/EP, which need no token plan)."""

    def __init__(self, par: ParallelConfig, pc: ParallelContext):
        super().__init__(pc)
        self.n = par.prefill_context_parallel_size
        self.rank = pc.pcp.rank_in_group
        self.dcp_size = par.decode_context_parallel_size
        self.interleave = par.cp_kv_cache_interleave_size

    def cp_metadata(self, pcp_pad: int, decode_pad: int) -> CPMetadata:
        return CPMetadata(
            self.dcp_size, self.pc.dcp.rank_in_group, self.interleave, pcp_pad, decode_pad
        )

    def shard(self, inp: StepInputs) -> RankStep:
        if self.n == 1:
            step = super().shard(inp)
            step.cp = self.cp_metadata(1, max(1, int(inp.num_scheduled[~inp.is_prefill].sum())))
            return step
        return self._shard(inp.query_start_loc, inp.is_prefill, inp, inp.positions_np)

    def shard_decode(self, input_ids: torch.Tensor, positions: torch.Tensor) -> RankStep:
        b = input_ids.shape[0]
        if self.n == 1:
            step = super().shard_decode(input_ids, positions)
            step.cp = self.cp_metadata(1, max(1, b))
            return step
        rows = torch.arange(b, device=input_ids.device)
        tokens = _Tokens(input_ids, positions, rows)
        return self._shard(np.arange(b + 1), np.zeros(b, dtype=bool), tokens, None)

    def _shard(self, qsl, is_prefill, tokens, positions_np) -> RankStep:
        """PCP: this rank's tokens of a step (``tokens``: input_ids, positions, token_req)."""
        inp = tokens
        dev = inp.positions.device
        sh = shard_tokens(qsl, is_prefill, self.n)
        mine = torch.from_numpy(sh.per_rank[self.rank]).to(dev)
        g = torch.from_numpy(sh.gathered).to(dev)
        gv = g.clamp_min(0)
        decode_counts = sh.per_rank_counts[:, ~is_prefill].sum(axis=1)
        return RankStep(
            input_ids=inp.input_ids[mine],
            positions=inp.positions[mine],
            token_req=inp.token_req[mine],
            query_start_loc_cpu=[0] + np.cumsum(sh.per_rank_counts[self.rank]).tolist(),
            positions_cpu=None if positions_np is None else positions_np[sh.per_rank[self.rank]],
            kv_token_req=inp.token_req[gv],
            kv_positions=torch.where(g >= 0, inp.positions[gv], -1),
            cp=self.cp_metadata(sh.pad, max(1, int(decode_counts.max()))),
            restore=torch.from_numpy(sh.restore).to(dev),
            pad=sh.pad,
            token_index=mine,
        )

    def gather_hidden(self, hidden: torch.Tensor, step: RankStep) -> torch.Tensor:
        if step.restore is None:
            return hidden
        padded = hidden.new_zeros((step.pad, hidden.shape[1]))
        padded[: hidden.shape[0]] = hidden
        full = self.pc.pcp.all_gather(padded)  # [N·pad, hidden]
        return full[step.restore]

    def dummy_step(self, device: torch.device) -> RankStep:
        """One padding token and no requests: the step's collectives (PCP gathers, TP reduces,
        EP all-to-alls) run and match the other ranks; nothing is written."""
        z = torch.zeros(1, dtype=torch.int64, device=device)
        return RankStep(
            input_ids=z,
            positions=z,
            token_req=z,
            query_start_loc_cpu=[0],
            positions_cpu=np.zeros(1, dtype=np.int64),
            kv_token_req=torch.zeros(self.n, dtype=torch.int64, device=device),
            kv_positions=torch.full((self.n,), -1, dtype=torch.int64, device=device),
            cp=self.cp_metadata(1, 1),
            restore=torch.zeros(1, dtype=torch.int64, device=device) if self.n > 1 else None,
            pad=1,
        )

    def broadcast_sampled(self, sampled: torch.Tensor) -> torch.Tensor:
        """Every rank of a replica continues from its first rank's tokens (no drift possible)."""
        rep = self.pc.replica
        if rep is None or rep.world_size == 1:
            return sampled
        return rep.broadcast(sampled.contiguous(), src=0)


@dataclass
class _Tokens:
    """The token arrays a PCP shard selects from (a drafting step's, which has no StepInputs)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    token_req: torch.Tensor


def make_cp_planner(par: ParallelConfig, pc: ParallelContext) -> SingleRankPlanner:
    if par.world_size_across_dp == 1:
        return SingleRankPlanner(pc)
    return CPPlanner(par, pc)
