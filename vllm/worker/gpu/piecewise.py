"""Piecewise CUDA graphs: the forwards that no full decode graph covers (prompt chunks, the chunk
half of a mixed step, decode batches past the largest full size), with the attention layers run
eagerly between captured pieces (``"cudagraph_mode": "FULL_AND_PIECEWISE"`` or ``"PIECEWISE"``,
:mod:`vllm.config.compilation`).

The model's forward is already cut at its attention layers (``GlmMoeDsaModel.piece`` /
``attend``): piece 0 embeds the tokens and projects layer 0's attention inputs, piece i finishes
layer i − 1 (o_proj, residual, MLP or MoE, TP all-reduces) and projects layer i's, the last piece
finishes the last layer and applies the final norm. Those pieces read no metadata and no KV
cache, so they replay for any batch of the same token count; attention (KV writes, indexer top-k,
sparse or dense attention: what depends on each request's context) runs eagerly, as in an eager
step, on the step's real tokens only.

A forward of T tokens runs at the smallest captured size S >= T. Its tokens and positions are
copied into static buffers (rows T..S-1: token 0, position 0). Each piece copies its outputs (the
hidden states, the next layer's attention inputs) into static buffers shared by every piece and
every size, and the attention writes its output into another; so a graph's memory pool holds only
a piece's temporaries, reused by the next piece and the next size (captured largest first), and
the static buffers hold one layer's tensors at the largest size. Padding rows compute garbage that
stays in their rows (every op in a piece is row-wise: norms, linears, routing and experts) and is
never read. Under EP every rank would have to replay the same size (the MoE dispatch's shapes),
which needs agreement per step: not done, so the runner turns these graphs off under EP.

On CPU (tests) the same pieces run uncaptured on the same buffers, so the copies, the padding and
the eager attention between pieces are tested there too.
"""

from __future__ import annotations

import time

import torch

from vllm.distributed.ep import ep_forward
from vllm.model_executor.models.glm_moe_dsa import AttentionInputs, IndexerInputs
from vllm.utils import logger

_FIELDS = ("q_nope", "q_pe", "kv_c", "k_pe")
_IDX_FIELDS = ("q", "w", "k")


class PiecewiseGraphs:
    def __init__(self, runner, sizes: tuple[int, ...]):
        self.runner, self.model = runner, runner.model
        self.sizes = tuple(sorted(sizes))
        self.num_layers = len(self.model.model.layers)
        n, dev = self.sizes[-1], runner.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.capture = dev.type == "cuda"
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = None
        # static buffers: hidden states, one layer's attention inputs and its output
        self.hidden = self.out = None
        self.bufs: dict[str, torch.Tensor] = {}
        self._alloc(n)

    def _alloc(self, n: int) -> None:
        """Buffers for n tokens, shaped as layer 0's piece outputs over two tokens (and, for the
        indexer's, as the first full indexer layer's projections)."""
        m = self.model.model
        ids, pos = self.input_ids[:2], self.positions[:2]
        with torch.inference_mode():
            x, a = m.piece(0, ids, pos)
            idx = next(
                (layer.pre_attention(x, pos).idx for layer in m.layers if layer.self_attn.indexer),
                None,
            )

        def like(v: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
            return torch.zeros((n, *(shape or v.shape[1:])), dtype=v.dtype, device=v.device)

        attn = m.layers[0].self_attn.attn
        self.hidden = like(x)
        self.out = like(a.q_nope, (attn.num_heads, attn.v_dim))
        for f in _FIELDS:
            self.bufs[f] = like(getattr(a, f))
        if idx is not None:
            for f in _IDX_FIELDS:
                self.bufs["idx_" + f] = like(getattr(idx, f))

    # ---- which forwards ------------------------------------------------------------------------
    def size_for(self, num_tokens: int) -> int | None:
        """The smallest captured size holding ``num_tokens`` tokens (None: none does)."""
        for s in self.sizes:
            if s >= num_tokens:
                return s
        return None

    # ---- the pieces ----------------------------------------------------------------------------
    def _piece(self, i: int, size: int) -> None:
        """Piece ``i`` over the static buffers' first ``size`` rows (captured, or run on CPU)."""
        pos = self.positions[:size]
        x = self.input_ids[:size] if i == 0 else self.hidden[:size]
        with ep_forward(size, graph=True):
            x, a = self.model.model.piece(i, x, pos, self.out[:size] if i else None)
        self.hidden[:size].copy_(x)
        if a is None:
            return
        for f in _FIELDS:
            self.bufs[f][:size].copy_(getattr(a, f))
        if a.idx is not None:
            for f in _IDX_FIELDS:
                self.bufs["idx_" + f][:size].copy_(getattr(a.idx, f))

    def _inputs(self, i: int, t: int) -> AttentionInputs:
        """Layer i's attention inputs for the step's ``t`` real tokens, from the buffers."""
        b = self.bufs
        idx = None
        if self.model.model.layers[i].self_attn.indexer is not None:
            idx = IndexerInputs(q=b["idx_q"][:t], w=b["idx_w"][:t], k=b["idx_k"][:t])
        return AttentionInputs(*(b[f][:t] for f in _FIELDS), idx)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size's pieces, largest first (the smaller ones reuse its pool)."""
        if not self.capture:
            return
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info()[0]
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            for i in range(self.num_layers + 1):  # warm-up: compiles the pieces' kernels
                self._piece(i, size)
            torch.cuda.synchronize()
            graphs = []
            for i in range(self.num_layers + 1):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    self._piece(i, size)
                graphs.append(g)
            self.graphs[size] = graphs
        torch.cuda.synchronize()
        logger.info(
            "captured piecewise CUDA graphs for %d token counts (%d..%d, %d pieces each) in "
            "%.1f s, using %.2f GiB",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            self.num_layers + 1,
            time.perf_counter() - t0,
            (free0 - torch.cuda.mem_get_info()[0]) / 2**30,
        )

    # ---- one forward ---------------------------------------------------------------------------
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The model over ``input_ids`` / ``positions`` [T] (T <= the largest size) with the
        step's attention metadata -> final hidden states [T, hidden] (a view of a static buffer,
        valid until the next forward)."""
        t = input_ids.shape[0]
        size = self.size_for(t)
        assert size is not None, f"{t} tokens: larger than every piecewise size"
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        if size > t:
            self.input_ids[t:size].zero_()
            self.positions[t:size].zero_()
        graphs = self.graphs.get(size)
        topk = None
        for i in range(self.num_layers + 1):
            if graphs is not None:
                graphs[i].replay()
            else:
                self._piece(i, size)
            if i < self.num_layers:
                _, topk = self.model.model.attend(
                    i, self._inputs(i, t), topk, meta, out=self.out[:t]
                )
        return self.hidden[:t]
