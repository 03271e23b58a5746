"""Full CUDA graphs of decode-only steps (`--compilation-config`, :mod:`vllm.config.compilation`).

A decode-only step of B requests (one query token each) replays the graph captured for the
smallest size Bp >= B. Everything from the inputs to the logits is inside the graph: the input
tokens (read from the device's ``last_sampled``), the block-table gather, the slot mapping, every
layer (KV writes, indexer, top-k, sparse attention, MoE) and the LM head. What crosses into it is
one [3, Bp] int64 array per step — each row's persistent slot, position and context length —
copied from pinned memory into a static buffer in one transfer. Rows B..Bp-1 are padding:
position -1 and context 0, so they write no KV (slot -1), select no rows and their logits are
dropped; they are rewritten every step, so a replay never reads a previous step's rows.

Shapes that depend on the batch's longest context are fixed at capture to ``max_ctx``, the most
tokens one request can hold on this rank (the smaller of --max-model-len and the KV cache); the
kernels bound their work by each row's own context length, read on the device.

Sampling runs after the replay, eagerly, on the first B rows of the logits. On CPU (tests) the same
static-buffer forward runs without capture, so the padding and buffer logic is tested there too.

With speculative decoding (`spec_decode/`) a row holds q = 1 + k tokens: the last sampled token
and the k drafts after it (fewer near a request's end: the rest of the row is padding, position
−1), and each size has a second graph, the drafting: the MTP layer's first pass over the step's
tokens (inputs: the samples, copied in after the eager verification, and the target's hidden
states, an output of the first graph), then its k − 1 chained steps, writing the next drafts into
``next_tokens``. Padding rows write their drafts into a scratch row of it.

Under DCP every rank of the group captures the same sizes and replays the same size each step
(the batch is the same on every rank): the queries' all-gather, the per-shard attention, the
LSE-corrected reduce-scatter or the all-to-all, and the indexer candidates' all-gather are inside
the graph, with ``size·q`` rows per rank (padding rows hold position −1: no rank owns their KV,
their LSE is −inf). Under PCP the rows go round-robin over the PCP ranks, as an eager decode
step's do: each rank computes its share (index tensors made once per size before capture), the
new KV rows are all-gathered inside each attention layer and the hidden states after the model,
and the logits come from every token's (the drafting's passes likewise, with 1-token rows for
the chained ones).

Under DP + EP the graphs hold the MoE layers' collectives, so every EP rank runs the same ones:
each step the ranks agree on one size (the runner's ``_graph_size``) and each replays the verify
graph, then the drafting graph, at that size — a rank with fewer requests pads, an idle replica
replays both with every row padding (``inp`` None) — or every rank runs the step eagerly, the
drafter's passes included. Inside, every MoE pass (the verify forward and the first drafting pass
over size·q tokens, the chained drafting passes over size) takes EP's fixed-capacity dispatch
with that token count as its bound; ``ep_forward(..., graph=True)`` asserts it, on CPU too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from vllm.attention.metadata import CPMetadata, MLAMetadata
from vllm.distributed.ep import ep_forward
from vllm.distributed.pcp_manager import shard_tokens
from vllm.utils import logger


class DecodeGraphs:
    def __init__(self, runner, sizes: tuple[int, ...], max_ctx: int, num_spec_tokens: int = 0):
        self.runner, self.sizes, self.max_ctx = runner, tuple(sorted(sizes)), max_ctx
        self.k = num_spec_tokens
        self.q = q = 1 + num_spec_tokens  # tokens per row
        dev = runner.device
        n = self.sizes[-1]
        # rows: persistent slot, first position, drafts verified, tokens the request's blocks
        # hold (padding: the scratch slot, -1, 0, 0)
        self.scratch = runner.states.max_num_reqs  # next_tokens' spare row
        # size b's graph reads the first 4·b values as [4, b] (one contiguous copy a step)
        self.flat_inputs = torch.zeros(4 * n, dtype=torch.int64, device=dev)
        self._padding = np.array([[self.scratch], [-1], [0], [0]], dtype=np.int64)
        for size in self.sizes:
            self._pad_inputs(size)
        self.arange = torch.arange(n * q, dtype=torch.int64, device=dev)
        self.sampled = torch.zeros(n * q, dtype=torch.int64, device=dev)  # drafting's inputs
        self.accepted = torch.zeros(n, dtype=torch.int64, device=dev)
        self.capture = dev.type == "cuda"
        # size -> (graph, logits, final hidden, logits' argmax)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, ...]] = {}
        self.draft_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # uncaptured (CPU): the last step's
        self.argmax: torch.Tensor | None = None  # the last run's logits' argmax, row by row
        self.pool = None
        self._shards: dict[tuple[int, int], _Shard] = {}  # PCP: (size, q) -> this rank's share

    # ---- which steps replay ----------------------------------------------------------------
    def decode_batch(self, inp) -> int | None:
        """This step's requests if it can replay (decode only: the last sampled token and at
        most k drafts each, within the largest size); None: it must run eagerly."""
        b = len(inp.req_ids)
        if b == 0 or b > self.sizes[-1] or inp.is_prefill.any() or len(inp.sample_rows) != b:
            return None
        return b if int(inp.num_scheduled.max()) <= self.q else None

    def size_for(self, num_reqs: int) -> int | None:
        """The smallest captured size holding ``num_reqs`` rows (None: none does)."""
        for s in self.sizes:
            if s >= num_reqs:
                return s
        return None

    # ---- the captured forward ----------------------------------------------------------------
    def inputs(self, size: int) -> torch.Tensor:
        """Size ``size``'s inputs [4, size]: per row its persistent slot, first position, drafts
        verified, and the tokens its blocks hold (padding rows: the scratch slot, -1, 0, 0)."""
        return self.flat_inputs[: 4 * size].view(4, size)

    def _pad_inputs(self, size: int) -> None:
        """Every row of size ``size``'s inputs padding (before its warm-up and capture)."""
        v = self.inputs(size)
        v[0].fill_(self.scratch)
        v[1].fill_(-1)
        v[2:].zero_()

    def _tokens(self, size: int):
        """The step's tokens from the inputs: (slot [size], per-token row [T], offset in the row
        [T], position [T], context length after the step [size]); T = size·q."""
        q, t = self.q, size * self.q
        idx, first, nd = self.inputs(size)[:3]
        tok = self.arange[:t]
        row, j = tok // q, tok % q
        live = (first[row] >= 0) & (j <= nd[row])
        pos = torch.where(live, first[row] + j, -1)
        seq = torch.where(first >= 0, first + nd + 1, 0)
        return idx, row, j, pos, seq

    def _metadata(self, size, idx, row, pos, seq, shard: _Shard | None = None) -> MLAMetadata:
        """Metadata of the step's tokens ``row``/``pos`` [size·q] (global order); under PCP
        (``shard``) of this rank's share of them, with every rank's new KV rows in gather
        order."""
        r, t = self.runner, row.shape[0]
        if shard is None:
            qsl = [b * (t // size) for b in range(size + 1)]
            tok_row, tok_pos, kv_row, kv_pos, cp = row, pos, row, pos, self._cp(t)
        else:
            qsl, mine = shard.qsl, shard.mine
            tok_row, tok_pos = row[mine], pos[mine]
            kv_row, kv_pos = row[shard.gv], torch.where(shard.g >= 0, pos[shard.gv], -1)
            cp = r.planner.cp_metadata(shard.pad, shard.pad)
        meta = MLAMetadata(
            layout=r.layout,
            index_topk=r.arch.index_topk,
            positions=tok_pos,
            token_req=tok_row,
            query_start_loc_cpu=qsl,
            seq_lens=seq,
            seq_lens_cpu=[self.max_ctx] * size,  # bounds only: the kernels read `seq`
            block_table=r.states.block_table[idx],
            is_prefill_cpu=[False] * size,
            use_dense_cpu=[False] * size,
            slot_mapping=torch.empty(0, dtype=torch.long, device=pos.device),
            positions_cpu=None,
            decode_tokens=self.arange[: tok_row.shape[0]],
            max_decode_ctx=self.max_ctx,
            cp=cp,
        )
        meta.slot_mapping = meta.slots_for(kv_row, kv_pos)
        return meta

    def _shard(self, size: int, q: int) -> _Shard | None:
        """Under PCP, this rank's share of a step of ``size`` rows of ``q`` tokens: rows go to
        the ranks round-robin, as an eager decode step's do (:func:`shard_tokens`). Its index
        tensors are made at the first call for the shape, the warm-up before capture."""
        r = self.runner
        if r.config.parallel_config.prefill_context_parallel_size == 1:
            return None
        key = (size, q)
        if key not in self._shards:
            planner, dev = r.planner, r.device
            sh = shard_tokens(np.arange(size + 1) * q, np.zeros(size, dtype=bool), planner.n)
            g = torch.from_numpy(sh.gathered).to(dev)
            counts = sh.per_rank_counts[planner.rank]
            self._shards[key] = _Shard(
                mine=torch.from_numpy(sh.per_rank[planner.rank]).to(dev),
                g=g,
                gv=g.clamp_min(0),
                restore=torch.from_numpy(sh.restore).to(dev),
                pad=sh.pad,
                qsl=[0] + np.cumsum(counts).tolist(),
            )
        return self._shards[key]

    def _gather(self, hidden: torch.Tensor, shard: _Shard | None) -> torch.Tensor:
        """This rank's hidden states -> every token's, in the step's order (PCP all-gather)."""
        if shard is None:
            return hidden
        padded = hidden.new_zeros((shard.pad, hidden.shape[1]))
        padded[: hidden.shape[0]] = hidden
        return self.runner.pc.pcp.all_gather(padded)[shard.restore]

    def _pass(self, shard: _Shard | None, bound: int, fn, *tensors):
        """``fn`` over this rank's share of the [T] / [T, ...] ``tensors`` (all of them without
        PCP), MoE dispatch bounded by ``bound`` tokens (the padded share under PCP), then every
        token's output."""
        if shard is not None:
            tensors = tuple(x[shard.mine] for x in tensors)
            bound = shard.pad
        with ep_forward(bound, graph=True):
            out = fn(*tensors)
        return self._gather(out, shard)

    def _cp(self, tokens: int) -> CPMetadata | None:
        """DCP's part of the metadata (None without DCP): each rank computes every token of the
        step, so the DCP gathers carry ``tokens`` rows per rank, padding included."""
        if self.runner.config.parallel_config.decode_context_parallel_size == 1:
            return None
        return self.runner.planner.cp_metadata(1, tokens)

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs [:, :size] -> (logits [size·q, vocab] fp32, final hidden [size·q, hidden],
        the logits' argmax [size·q]): the whole decode step but sampling. The argmax is a
        greedy batch's tokens when nothing edits its logits (no eager reduction launched after
        the replay: ~30-80 µs of host time a step); without drafts it is also written as each
        row's last sampled token, which the sampling overwrites when it picks others."""
        r = self.runner
        idx, row, j, pos, seq = self._tokens(size)
        shard = self._shard(size, self.q)
        meta = self._metadata(size, idx, row, pos, seq, shard)
        r.hooks.graph_metadata(meta, idx, pos)
        # every EP rank replays the same size (agreed per step): the MoE dispatch shapes follow it
        ids = r.states.next_tokens[idx[row], j]
        hidden = self._pass(shard, size * self.q, lambda i, p: r.model(i, p, meta), ids, pos)
        logits = r.model.compute_logits(hidden)
        tokens = logits.argmax(dim=-1)
        if self.q == 1:  # a greedy row's next input, unless the eager sampling writes another
            r.states.last_sampled[idx] = tokens
        return logits, hidden, tokens

    def _draft_forward(self, size: int, hidden: torch.Tensor) -> None:
        """The drafting of a step (``spec_decode/mtp.py``) from the static samples and accepted
        counts: the next drafts into next_tokens[slot, 1:]."""
        r, q = self.runner, self.q
        idx, row, j, pos, seq = self._tokens(size)
        shard = self._shard(size, q)
        meta = self._metadata(size, idx, row, pos, seq, shard)
        r.hooks.graph_metadata(meta, idx, pos)
        ids = self.sampled[: size * q]
        # the bounds are fixed by the agreed size, as the verify forward's: no host read
        mtp = r.model.mtp_forward
        h = self._pass(shard, size * q, lambda i, hh, p: mtp(i, hh, p, meta, 0), ids, hidden, pos)
        sel = self.arange[:size] * q + self.accepted[:size]
        h, p0 = h[sel], pos[sel]
        draft = r.model.mtp_logits(h, 0).argmax(dim=-1)
        drafts = [draft]
        cap = self.inputs(size)[3]
        rows = self.arange[:size]
        shard1 = self._shard(size, 1)
        for depth in range(1, self.k):
            p = torch.where((p0 >= 0) & (p0 + depth < cap), p0 + depth, -1)
            dmeta = self._metadata(size, idx, rows, p, (p + 1).clamp_min(0), shard1)
            r.hooks.graph_metadata(dmeta, idx, p)
            h = self._pass(
                shard1, size, lambda i, hh, pp, m=dmeta, d=depth: mtp(i, hh, pp, m, d), draft, h, p
            )
            draft = r.model.mtp_logits(h, depth).argmax(dim=-1)
            drafts.append(draft)
        r.states.draft_tokens[idx] = torch.stack(drafts, dim=1)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, largest first (the smaller ones reuse its memory pool)."""
        if not self.capture:
            return
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info()[0]
        self.pool = torch.cuda.graph_pool_handle()
        for i, size in enumerate(reversed(self.sizes)):
            t1 = time.perf_counter()
            self._pad_inputs(size)  # the larger sizes' steps used these values
            self._forward(size)  # warm-up: compiles kernels, initialises cuBLAS for the shapes
            torch.cuda.synchronize()
            if i == 0:
                logger.info(
                    "decode graphs: first warm-up step (batch %d) in %.1f s",
                    size,
                    time.perf_counter() - t1,
                )
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                logits, hidden, tokens = self._forward(size)
            self.graphs[size] = (g, logits, hidden, tokens)
            if self.k:
                self._draft_forward(size, hidden)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    self._draft_forward(size, hidden)
                self.draft_graphs[size] = g
            if i % 8 == 0 or size == self.sizes[0]:
                logger.info("captured CUDA graph %d/%d (batch %d)", i + 1, len(self.sizes), size)
        torch.cuda.synchronize()
        used = free0 - torch.cuda.mem_get_info()[0]
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %d..%d, max context %d) in %.1f s, "
            "using %.2f GiB",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            self.max_ctx,
            time.perf_counter() - t0,
            used / 2**30,
        )

    # ---- one step ------------------------------------------------------------------------------
    def run(self, inp, size: int) -> torch.Tensor:
        """Replay (or, on CPU, run) the step of ``inp`` at ``size``: logits [N, vocab] fp32 of
        the step's sampled positions (row b's 1 + d positions, rows in order). ``inp`` None: an
        idle DP replica's step, every row padding (its collectives match the other EP ranks';
        nothing is written)."""
        r = self.runner
        b = len(inp.req_ids) if inp is not None else 0
        h = np.empty((4, size), dtype=np.int64)
        h[:, b:] = self._padding  # the scratch slot, -1, 0, 0
        if b:
            h[0, :b], h[1, :b], h[2, :b] = inp.idx_np, inp.start, inp.num_drafts
            np.multiply(r.states.num_blocks[inp.idx_np], r.scheduler_block_size, out=h[3, :b])
        r.staging.copy_into(self.flat_inputs[: 4 * size], h)
        if b and inp.idx_mapping_d is None:  # the step's slots, already on the device
            inp.idx_mapping_d = self.flat_inputs[:b]
        if size in self.graphs:
            g, logits, hidden, tokens = self.graphs[size]
            g.replay()
        else:
            logits, hidden, tokens = self._forward(size)
            self.hidden[size] = hidden
        nd = inp.num_drafts if b else np.zeros(0, dtype=np.int64)
        if self.q == 1 or (nd == self.k).all():  # the rows are already in order
            n = b * self.q
            self.argmax = tokens[:n]
            return logits[:n]
        keep = r.staging.to_device(np.repeat(np.arange(b) * self.q, 1 + nd) + _ranks(1 + nd))
        self.argmax = tokens[keep]
        return logits[keep]

    def draft(self, inp, size: int, sampled, accepted) -> None:
        """After the eager sampling and verification of a replayed step: replay its drafting.
        sampled [N]: the step's samples (rows' positions in order), accepted [B] (None: 0)."""
        if not self.k:
            return
        r = self.runner
        b = len(inp.req_ids) if inp is not None else 0
        self.accepted.zero_()
        self.sampled.zero_()
        if b:
            nd = inp.num_drafts
            where = np.repeat(np.arange(b) * self.q, 1 + nd) + _ranks(1 + nd)
            self.sampled[r.staging.to_device(where)] = sampled
            if accepted is not None:
                self.accepted[:b] = accepted
        if size in self.draft_graphs:
            self.draft_graphs[size].replay()
        else:
            hidden = self.graphs[size][2] if size in self.graphs else self.hidden[size]
            self._draft_forward(size, hidden)


@dataclass
class _Shard:
    """This PCP rank's share of a captured step's tokens (:meth:`DecodeGraphs._shard`)."""

    mine: torch.Tensor  # this rank's tokens, indices into the step's
    g: torch.Tensor  # [N·pad] step token of each gathered row, −1: padding
    gv: torch.Tensor  # g clamped to 0 (a valid index)
    restore: torch.Tensor  # [T] gathered row of each step token
    pad: int  # tokens per rank after padding
    qsl: list[int]  # this rank's tokens of each row, cumulated


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0 .. c-1 for each count c, concatenated."""
    ends = np.cumsum(counts)
    return np.arange(int(ends[-1]) if len(ends) else 0) - np.repeat(ends - counts, counts)
