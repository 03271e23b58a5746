"""Drafting with the checkpoint's MTP layer (DeepSeek/GLM multi-token prediction).

The MTP layer at position t takes the embedding of token t+1 and a hidden state of position t and
predicts token t+2. After the target step:

1. **First pass**, over every token of every step — prefill chunks that sample nothing too, or
   the MTP layer's KV would miss their positions — with the target step's own metadata (same
   positions, same slots, same PCP/DCP split): token t's input is token t+1 — known on the host
   inside a prompt, else the target's sample at t (for a decode row of 1 + d tokens, the samples
   of its d + 1 positions) — and the target's final hidden state at t. It writes the MTP layer's
   KV for every position of the step; the rows after a request's accepted prefix are stale and
   the next step, which starts there, overwrites them.
2. Each request's first draft comes from the pass's output at its last accepted position
   (device-side gather by the accepted count: no host round trip).
3. **Draft steps** 2..k: one token per request at the next position, its input the previous
   draft and its hidden state the previous pass's output (upstream's chaining). Positions live on
   the device only; the attention metadata carries host bounds (the longest possible context) as
   a CUDA graph's does. A position past the request's allocated blocks is a padding row (writes
   nothing): its draft would not be verified anyway (the scheduler caps drafts by the request's
   room). Features beside the KV cache add their metadata as for a captured step
   (``StepHooks.graph_metadata``: HiSparse keeps the MTP layer's KV as any layer's).

Drafts are greedy (the argmax of the MTP logits): the verification's one-draw rejection sampling
relies on the one-hot proposal. Every rank of a replica stores the first rank's drafts, so the
accepted counts, hence the KV positions, cannot diverge between ranks.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm.attention.metadata import MLAMetadata, decode_token_rows
from vllm.distributed.ep import ep_forward, max_tokens_across_ep
from vllm.utils import logger
from vllm.worker.gpu.spec_decode.drafter import DraftBatch, Drafter
from vllm.worker.gpu.spec_decode.rejection_sample import synthetic_accepted, verify_drafts


class MTPDrafter(Drafter):
    def __init__(self, runner, num_spec_tokens: int, synthetic_length: float | None):
        self.r = runner
        self.num_spec_tokens = num_spec_tokens
        self.synthetic_length = synthetic_length
        self.generator = None
        if synthetic_length is not None:
            self.generator = torch.Generator(device=runner.device)
            self.generator.manual_seed(0)
            logger.warning(
                "speculative decoding in SYNTHETIC acceptance mode: every step accepts %.2f "
                "tokens on average whatever the drafts; outputs are not the model's (benchmarks "
                "only)",
                synthetic_length,
            )

    # ---- verification ------------------------------------------------------------------------
    def verify(self, sampled, first_row, num_drafts, drafts, max_drafts):
        tokens, accepted = verify_drafts(sampled, first_row, num_drafts, drafts, max_drafts)
        if self.synthetic_length is not None and max_drafts:
            accepted = synthetic_accepted(num_drafts, self.synthetic_length, self.generator)
        return tokens, accepted

    # ---- drafting ------------------------------------------------------------------------------
    def propose(self, batch: DraftBatch) -> None:
        r, inp = self.r, batch.inp
        st = r.states
        ids = self._first_pass_inputs(batch)
        step = batch.step
        mine = step.token_index
        hidden = batch.hidden if mine is None else batch.hidden[mine]
        h = self._pass(ids if mine is None else ids[mine], hidden, step, batch.meta, 0)
        h = r.planner.gather_hidden(h, step)  # [T, hidden], batch order

        # rows that draft: the step's sampling rows of requests that verify drafts
        keep = st.spec_ok[inp.idx_np[batch.rows]]
        rows, first = batch.rows[keep], batch.first_row[keep]
        if len(rows) == 0:
            for depth in range(1, self.num_spec_tokens):
                self._idle_pass(depth)
            return
        h2d = r.staging.to_device
        sel_np = batch.sampled_tok[first]  # step token of each row's first sampled position
        sel = h2d(sel_np)
        if batch.num_accepted is not None:  # else no row verified drafts: none accepted
            sel = sel + batch.num_accepted[h2d(np.nonzero(keep)[0])]
        h = h[sel]
        pos = inp.positions[sel]
        slots_np = inp.idx_np[rows]
        slots = h2d(slots_np)
        draft = self._argmax(r.model.mtp_logits(h, 0))
        drafts = [draft]
        # a position past the request's blocks is padding (its draft is never verified)
        cap = h2d(st.num_blocks[slots_np] * r.scheduler_block_size)
        bound = int(inp.seq_lens[rows].max())
        for depth in range(1, self.num_spec_tokens):
            p = pos + depth
            p = torch.where(p < cap, p, -1)
            h = self._draft_step(draft, h, p, slots, bound + depth, depth)
            draft = self._argmax(r.model.mtp_logits(h, depth))
            drafts.append(draft)
        d = r.planner.broadcast_sampled(torch.stack(drafts, dim=1))
        st.draft_tokens[slots] = d

    def _first_pass_inputs(self, batch: DraftBatch) -> torch.Tensor:
        """[T] token t+1 of every step token t: host-known inside prompts, else the target's
        sample at t."""
        inp, st = batch.inp, self.r.states
        t = inp.num_tokens
        nxt = np.full(t, -1, dtype=np.int64)
        known = st.num_known[inp.idx_np]
        for b in np.nonzero(inp.start < known)[0]:  # prefill chunks: the next prompt tokens
            lo, n = int(inp.start[b]), int(inp.num_scheduled[b])
            hi = min(lo + n + 1, int(known[b]))
            if hi > lo + 1:
                q = int(inp.query_start_loc[b])
                nxt[q : q + hi - lo - 1] = st.token_ids[inp.idx_np[b]][lo + 1 : hi]
        row_of = np.full(t, -1, dtype=np.int64)
        row_of[batch.sampled_tok] = np.arange(len(batch.sampled_tok))
        need = nxt < 0
        # every step token's successor is known or was sampled this step: a chunk that does not
        # end its prompt ends before a known token
        assert (row_of[need] >= 0).all(), (
            f"a step token has neither a known nor a sampled next: {np.nonzero(row_of[need] < 0)} "
            f"{inp.start} {inp.num_scheduled} {known} {inp.sample_rows} {batch.sampled_tok}"
        )
        code = np.where(need, -1 - row_of, nxt)
        code_d = self.r.staging.to_device(code)
        if batch.sampled is None:  # no row sampled: every next token is a known prompt token
            return code_d
        return torch.where(code_d >= 0, code_d, batch.sampled[(-1 - code_d).clamp_min(0)])

    def _pass(self, ids, prev_hidden, step, meta, depth: int) -> torch.Tensor:
        """The MTP layer over this rank's tokens: through its piecewise graphs when a size holds
        them, else eagerly (EP dispatch shapes agreed first, as the target's)."""
        r = self.r
        t = ids.shape[0]
        if r.mtp_piecewise and t:
            pw = r.mtp_piecewise[depth % len(r.mtp_piecewise)]  # mtp_forward's layer choice
            if pw.covers(t):
                r._piecewise_used = True
                return pw.run({"ids": ids, "prev": prev_hidden}, step.positions, meta)
        with ep_forward(max_tokens_across_ep(r.pc, t)):
            return r.model.mtp_forward(ids, prev_hidden, step.positions, meta, depth)

    def _draft_step(self, ids, prev_hidden, positions, slots, bound: int, depth: int):
        """One token per drafting request at device-side ``positions`` -> hidden [B, hidden]."""
        r = self.r
        b = ids.shape[0]
        step = r.planner.shard_decode(ids, positions)
        meta = MLAMetadata(
            layout=r.layout,
            index_topk=r.arch.index_topk,
            positions=step.positions,
            token_req=step.token_req,
            query_start_loc_cpu=step.query_start_loc_cpu,
            seq_lens=positions + 1,  # 0 on padding rows
            seq_lens_cpu=[bound] * b,  # bounds only: the kernels read the positions
            block_table=r.states.block_table[slots],
            is_prefill_cpu=[False] * b,
            use_dense_cpu=[False] * b,
            slot_mapping=torch.empty(0, dtype=torch.long, device=positions.device),
            positions_cpu=None,
            decode_tokens=decode_token_rows(
                step.query_start_loc_cpu, [False] * b, r.device, r.staging.to_device
            ),
            max_decode_ctx=bound,
            cp=step.cp,
        )
        meta.slot_mapping = meta.slots_for(step.kv_token_req, step.kv_positions)
        # a KV feature's part (HiSparse: indexer-key slots, the resolver's tables) from device
        # tensors, as a captured step builds it: the positions are not on the host
        r.hooks.graph_metadata(meta, slots, meta.positions)
        mine = step.token_index
        prev = prev_hidden if mine is None else prev_hidden[mine]
        h = self._pass(step.input_ids, prev, step, meta, depth)
        return r.planner.gather_hidden(h, step)

    def _idle_pass(self, depth: int) -> None:
        """A draft step with no drafting request here: other ranks may draft (EP across DP
        replicas), so its collectives run on one padding token where there are any."""
        step = self.r.planner.dummy_step(self.r.device)
        if step is not None:
            self._dummy_pass(step, depth)

    def dummy(self, step, meta) -> None:
        self._dummy_pass(step, 0, meta)
        for depth in range(1, self.num_spec_tokens):
            self._idle_pass(depth)

    def _dummy_pass(self, step, depth: int, meta: MLAMetadata | None = None) -> None:
        r = self.r
        if meta is None:
            meta = r.dummy_metadata(step)
        hidden = torch.zeros(
            step.input_ids.shape[0], r.arch.hidden_size, dtype=r.model.dtype, device=r.device
        )
        r.planner.gather_hidden(self._pass(step.input_ids, hidden, step, meta, depth), step)

    @staticmethod
    def _argmax(logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)
