"""Where a step's query tokens and KV live across ranks (PCP × DCP), seen from the runner.

PCP (SPEC §4): each prefill request's scheduled tokens are cut into 2N chunks of ceil(n/2N) tokens
and PCP rank r takes chunks r and 2N−1−r (the "V" pattern: one cheap early chunk and one expensive
late chunk each). Decode rows are *not* replicated: the j-th decode request of the step goes to
rank j mod N, so every rank does 1/N of the decode MLP/MoE work too. Every rank pads its token
list to the same length; padding rows write nothing (slot −1). New latent KV and indexer keys are
all-gathered inside each attention layer before the cache write (`CPAttention.gather_new_rows`),
and after the last layer the hidden states are all-gathered and put back in batch order, so
sampling runs identically on every rank.

The planner is deterministic in the scheduler output, so every rank knows every other rank's
share without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm.attention.kv_cache import KVCacheLayout
from vllm.config import VllmConfig
from vllm.distributed.parallel_state import ParallelContext


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


def set_slot_mappings(meta, token_req, positions) -> None:
    """Where this step's new rows go: MLA rows by the block table, indexer keys by the indexer
    table when it differs (HiSparse keeps indexer pages in their own pool)."""
    meta.slot_mapping = meta.slots_for(token_req, positions)
    if meta.idx_block_table is not None:
        bs = meta.layout.block_size
        p = positions.long()
        meta.idx_slot_mapping = meta.idx_block_table[token_req.long(), p // bs].long() * bs + p % bs


class SingleRankPlanner:
    """No context parallelism: this rank computes every token and holds every KV row."""

    def __init__(self, pc: ParallelContext):
        self.pc = pc

    def forward(self, runner, inp) -> torch.Tensor:
        meta = runner.metadata(inp, inp.positions, inp.token_req, inp.query_start_loc.tolist())
        meta.positions_cpu = inp.positions_np
        set_slot_mappings(meta, inp.token_req, inp.positions)
        return runner.model(inp.input_ids, inp.positions, meta)

    def broadcast_sampled(self, sampled: torch.Tensor) -> torch.Tensor:
        return sampled

    def dummy_forward(self, runner) -> None:
        """Nothing to keep in step with."""


class CPPlanner(SingleRankPlanner):
    """PCP token sharding and/or DCP KV sharding (and TP/EP, which need no token plan)."""

    def __init__(self, config: VllmConfig, pc: ParallelContext, layout: KVCacheLayout):
        super().__init__(pc)
        from vllm.distributed.cp_attention import CPAttention

        par = config.parallel_config
        self.n = par.prefill_context_parallel_size
        self.rank = pc.pcp.rank_in_group
        self.dcp_size = par.decode_context_parallel_size
        self.interleave = par.cp_kv_cache_interleave_size
        self.attn = CPAttention(pc, par.dcp_comm_backend, self.interleave)

    def forward(self, runner, inp) -> torch.Tensor:
        dev = inp.positions.device
        if self.n == 1:
            sh = None
            mine = None
            pos, tr, ids = inp.positions, inp.token_req, inp.input_ids
            qsl = inp.query_start_loc.tolist()
        else:
            sh = shard_tokens(inp.query_start_loc, inp.is_prefill, self.n)
            mine = torch.from_numpy(sh.per_rank[self.rank]).to(dev)
            pos, tr, ids = inp.positions[mine], inp.token_req[mine], inp.input_ids[mine]
            qsl = [0] + np.cumsum(sh.per_rank_counts[self.rank]).tolist()
        meta = runner.metadata(inp, pos, tr, qsl)
        meta.positions_cpu = (
            inp.positions_np if sh is None else inp.positions_np[sh.per_rank[self.rank]]
        )
        meta.cp = meta.cp or self.attn
        meta.dcp_size, meta.dcp_rank, meta.cp_interleave = (
            self.dcp_size,
            self.pc.dcp.rank_in_group,
            self.interleave,
        )
        decode_counts = self._decode_counts(inp, sh)
        meta.extras["decode_pad"] = max(1, int(decode_counts.max()))
        if sh is None:
            set_slot_mappings(meta, inp.token_req, inp.positions)
        else:
            g = torch.from_numpy(sh.gathered).to(dev)
            gv = g.clamp_min(0)
            meta.slot_mapping = torch.where(
                g >= 0, meta.slots_for(inp.token_req[gv], inp.positions[gv]), -1
            )
            meta.extras["pcp_pad"] = sh.pad
        hidden = runner.model(ids, pos, meta)
        if sh is None:
            return hidden
        padded = hidden.new_zeros((sh.pad, hidden.shape[1]))
        padded[: hidden.shape[0]] = hidden
        full = self.pc.pcp.all_gather(padded)  # [N·pad, hidden]
        return full[torch.from_numpy(sh.restore).to(dev)]

    def _decode_counts(self, inp, sh: PCPShard | None) -> np.ndarray:
        """Decode tokens held by each PCP rank (DCP pads its gathers to the largest)."""
        dec = ~inp.is_prefill
        if sh is None:
            return np.array([int(inp.num_scheduled[dec].sum())])
        return sh.per_rank_counts[:, dec].sum(axis=1)

    def broadcast_sampled(self, sampled: torch.Tensor) -> torch.Tensor:
        """Every rank of a replica continues from its first rank's tokens (no drift possible)."""
        rep = self.pc.replica
        if rep is None or rep.world_size == 1:
            return sampled
        return rep.broadcast(sampled.contiguous(), src=0)

    def dummy_forward(self, runner) -> None:
        """One padding token and no requests: the step's collectives (PCP gathers, TP reduces,
        EP all-to-alls) run and match the other ranks; nothing is written."""
        dev = runner.device
        pos = torch.zeros(1, dtype=torch.int64, device=dev)
        meta = runner.empty_metadata(pos)
        meta.cp = self.attn
        meta.dcp_size, meta.dcp_rank, meta.cp_interleave = (
            self.dcp_size,
            self.pc.dcp.rank_in_group,
            self.interleave,
        )
        meta.extras["decode_pad"] = 1
        meta.extras["pcp_pad"] = 1
        meta.slot_mapping = torch.full((self.n,), -1, dtype=torch.int64, device=dev)
        hidden = runner.model(torch.zeros(1, dtype=torch.int64, device=dev), pos, meta)
        if self.n > 1:
            self.pc.pcp.all_gather(hidden)


def make_cp_planner(config: VllmConfig, pc: ParallelContext, layout: KVCacheLayout):
    par = config.parallel_config
    if par.world_size_across_dp == 1:
        return SingleRankPlanner(pc)
    return CPPlanner(config, pc, layout)
