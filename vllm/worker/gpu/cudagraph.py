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
"""

from __future__ import annotations

import time

import numpy as np
import torch

from vllm.attention.metadata import MLAMetadata
from vllm.distributed.ep import ep_forward
from vllm.utils import logger


class DecodeGraphs:
    def __init__(self, runner, sizes: tuple[int, ...], max_ctx: int):
        self.runner, self.sizes, self.max_ctx = runner, tuple(sorted(sizes)), max_ctx
        dev = runner.device
        n = self.sizes[-1]
        # rows: persistent slot, position, context length after the step (padding: 0, -1, 0)
        self.inputs = torch.zeros(3, n, dtype=torch.int64, device=dev)
        self.inputs[1].fill_(-1)
        self.arange = torch.arange(n, dtype=torch.int64, device=dev)
        self.capture = dev.type == "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    # ---- which steps replay ----------------------------------------------------------------
    def decode_batch(self, inp) -> int | None:
        """This step's requests if it can replay (decode only, one token each, within the
        largest size); None: it must run eagerly."""
        b = len(inp.req_ids)
        if b == 0 or b > self.sizes[-1] or inp.num_tokens != b or inp.is_prefill.any():
            return None
        return b if len(inp.sample_rows) == b else None

    def size_for(self, num_reqs: int) -> int | None:
        """The smallest captured size holding ``num_reqs`` rows (None: none does)."""
        for s in self.sizes:
            if s >= num_reqs:
                return s
        return None

    # ---- the captured forward ----------------------------------------------------------------
    def _forward(self, size: int) -> torch.Tensor:
        """Inputs [:, :size] -> logits [size, vocab] fp32: the whole decode step but sampling."""
        r = self.runner
        idx, pos, seq = self.inputs[0, :size], self.inputs[1, :size], self.inputs[2, :size]
        rows = self.arange[:size]
        meta = MLAMetadata(
            layout=r.layout,
            index_topk=r.arch.index_topk,
            positions=pos,
            token_req=rows,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens=seq,
            seq_lens_cpu=[self.max_ctx] * size,  # bounds only: the kernels read `seq`
            block_table=r.states.block_table[idx],
            is_prefill_cpu=[False] * size,
            use_dense_cpu=[False] * size,
            slot_mapping=torch.empty(0, dtype=torch.long, device=pos.device),
            positions_cpu=None,
            decode_tokens=rows,
            max_decode_ctx=self.max_ctx,
        )
        meta.slot_mapping = meta.slots_for(rows, pos)
        r.hooks.graph_metadata(meta, idx, pos)
        # every EP rank replays the same size (agreed per step): the MoE dispatch shapes follow it
        with ep_forward(size):
            hidden = r.model(r.states.last_sampled[idx], pos, meta)
        return r.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, largest first (the smaller ones reuse its memory pool)."""
        if not self.capture:
            return
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info()[0]
        self.pool = torch.cuda.graph_pool_handle()
        for i, size in enumerate(reversed(self.sizes)):
            self._forward(size)  # warm-up: compiles kernels, initialises cuBLAS for the shapes
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                logits = self._forward(size)
            self.graphs[size] = (g, logits)
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
        """Replay (or, on CPU, run) the step of ``inp`` at ``size``: logits [B, vocab] fp32.
        ``inp`` None: an idle DP replica's step, every row padding (its collectives match the
        other EP ranks'; nothing is written)."""
        b = len(inp.req_ids) if inp is not None else 0
        h = np.empty((3, size), dtype=np.int64)
        if b:
            h[0, :b], h[1, :b], h[2, :b] = inp.idx_np, inp.positions_np, inp.seq_lens
        h[0, b:], h[1, b:], h[2, b:] = 0, -1, 0
        self.inputs[:, :size].copy_(self.runner.staging.to_device(h))
        if size in self.graphs:
            g, logits = self.graphs[size]
            g.replay()
        else:
            logits = self._forward(size)
        return logits[:b]
