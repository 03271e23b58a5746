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

With MTP the drafter's passes (the MTP layer over the step's tokens, then one token a row per
chained draft) take graphs of their own (:class:`MTPStack`: two pieces around the MTP block's
attention), captured in the target's pool after it.

On CPU (tests) the same pieces run uncaptured on the same buffers, so the copies, the padding and
the eager attention between pieces are tested there too.
"""

from __future__ import annotations

import time

import torch

from vllm.attention.layer import joined
from vllm.distributed.ep import ep_forward
from vllm.model_executor.models.glm_moe_dsa import AttentionInputs, IndexerInputs
from vllm.utils import logger

_FIELDS = ("q_nope", "q_pe", "kv_c", "k_pe")
_IDX_FIELDS = ("q", "w", "k")


def static_bytes(arch, dtype: torch.dtype, n: int, tp_size: int = 1) -> int:
    """Bytes of one stack's static buffers at ``n`` tokens: inputs and hidden states, the
    rotary angles (fp32 cos and sin), one layer's attention inputs (queries, latent, rope key,
    indexer query, weights and key) and its output."""
    a, el = arch, dtype.itemsize
    heads = max(1, a.num_attention_heads // max(1, tp_size))
    per_tok = (
        2 * a.hidden_size * el
        + 8 * 2
        + a.qk_rope_head_dim * 4
        + heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) * el
        + (a.kv_lora_rank + a.qk_rope_head_dim) * el
        + a.index_n_heads * (a.index_head_dim * el + 4)
        + a.index_head_dim * el
    )
    return n * per_tok


class TargetStack:
    """The model's decoder layers (``GlmMoeDsaModel.piece`` / ``attend``); input: token ids."""

    def __init__(self, model):
        self.m = model.model
        self.num_layers = len(self.m.layers)
        self.layers = list(self.m.layers)

    def input_buffers(self, n: int, device) -> dict[str, torch.Tensor]:
        return {"ids": torch.zeros(n, dtype=torch.int64, device=device)}

    def rope_angles(self, positions):
        return self.m.rope_angles(positions)

    def piece(self, i: int, inp: dict, x, positions, out, rope=None):
        return self.m.piece(i, inp["ids"] if i == 0 else x, positions, out if i else None, rope)

    def attend(self, i: int, a: AttentionInputs, topk, meta, out):
        return self.m.attend(i, a, topk, meta, out=out)


class MTPStack:
    """One MTP layer as two pieces around its block's attention; inputs: the next tokens' ids
    and the previous hidden states (``MTPLayer.pre_attention``, ``DecoderLayer.post_attention``)."""

    def __init__(self, model, index: int):
        self.embed = model.model.embed_tokens
        self.mtp = model.model.mtp[index]
        self.num_layers = 1
        self.layers = [self.mtp.block]
        self.hidden_size, self.dtype = model.arch.hidden_size, model.dtype

    def input_buffers(self, n: int, device) -> dict[str, torch.Tensor]:
        return {
            "ids": torch.zeros(n, dtype=torch.int64, device=device),
            "prev": torch.zeros(n, self.hidden_size, dtype=self.dtype, device=device),
        }

    def rope_angles(self, positions):
        return None  # one layer: its block computes them

    def piece(self, i: int, inp: dict, x, positions, out, rope=None):
        if i == 0:
            return self.mtp.pre_attention(self.embed(inp["ids"]), inp["prev"], positions)
        return self.mtp.block.post_attention(x, out), None

    def attend(self, i: int, a: AttentionInputs, topk, meta, out):
        attn = self.mtp.block.self_attn.attn
        return attn(a.q_nope, a.q_pe, a.kv_c, a.k_pe, a.idx, None, meta, out=out)


class PiecewiseGraphs:
    def __init__(self, runner, sizes: tuple[int, ...], stack, name: str = "model", pool=None):
        self.runner, self.stack, self.name = runner, stack, name
        self.sizes = tuple(sorted(sizes))
        self.num_layers = stack.num_layers
        n, dev = self.sizes[-1], runner.device
        self.inputs = stack.input_buffers(n, dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.capture = dev.type == "cuda"
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = pool
        # static buffers: hidden states, one layer's attention inputs and its output
        self.hidden = self.out = None
        self.bufs: dict[str, torch.Tensor] = {}
        # the positions' rotary (cos, sin), written by piece 0 and read by every layer's piece
        # (the stack's layers share them; None: each piece computes its own)
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._alloc(n)

    def _alloc(self, n: int) -> None:
        """Buffers for n tokens, shaped as the first piece's outputs over two tokens (and, for
        the indexer's, as the first full indexer layer's projections)."""
        st = self.stack
        pos = self.positions[:2]
        with torch.inference_mode():
            x, a = st.piece(0, {k: v[:2] for k, v in self.inputs.items()}, None, pos, None)
            idx = next(
                (layer.pre_attention(x, pos).idx for layer in st.layers if layer.self_attn.indexer),
                None,
            )

        def like(v: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
            return torch.zeros((n, *(shape or v.shape[1:])), dtype=v.dtype, device=v.device)

        attn = st.layers[0].self_attn.attn
        rope = st.rope_angles(pos)
        if rope is not None:
            self.rope = (like(rope[0]), like(rope[1]))
        self.hidden = like(x)
        self.out = like(a.q_nope, (attn.num_heads, attn.v_dim))
        for f in _FIELDS:
            self.bufs[f] = like(getattr(a, f))
        if a.q_nope.dtype == a.q_pe.dtype:
            # q_nope and q_pe as the two halves of one [n, H, nope + rope] buffer, as the model
            # produces them: the dense prefill form then reads the query without concatenating,
            # and a piece stores the model's query with one contiguous copy
            nope = a.q_nope.shape[-1]
            q = like(a.q_nope, (*a.q_nope.shape[1:-1], nope + a.q_pe.shape[-1]))
            self.bufs["q"], self.bufs["q_nope"], self.bufs["q_pe"] = q, q[..., :nope], q[..., nope:]
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

    def covers(self, num_tokens: int) -> bool:
        """Whether a forward of ``num_tokens`` tokens runs through the pieces: a captured size
        holds it. Prompt chunks of every kind do, sparse-prefill ones (context past
        ``index_topk``) included: their attention runs eagerly between the pieces like any
        other."""
        return self.size_for(num_tokens) is not None

    # ---- the pieces ----------------------------------------------------------------------------
    def _piece(self, i: int, size: int) -> None:
        """Piece ``i`` over the static buffers' first ``size`` rows (captured, or run on CPU)."""
        inp = {k: v[:size] for k, v in self.inputs.items()}
        pos, rope = self.positions[:size], None
        if self.rope is not None:
            rope = (self.rope[0][:size], self.rope[1][:size])
            if i == 0:  # once a step, in piece 0's graph
                for buf, v in zip(rope, self.stack.rope_angles(pos), strict=True):
                    buf.copy_(v)
        with ep_forward(size, graph=True):
            x, a = self.stack.piece(i, inp, self.hidden[:size], pos, self.out[:size], rope)
        self.hidden[:size].copy_(x)
        if a is None:
            return
        q = joined(a.q_nope, a.q_pe) if "q" in self.bufs else None
        for f in _FIELDS:
            if q is not None and f in ("q_nope", "q_pe"):
                continue
            self.bufs[f][:size].copy_(getattr(a, f))
        if q is not None:
            self.bufs["q"][:size].copy_(q)
        if a.idx is not None:
            for f in _IDX_FIELDS:
                self.bufs["idx_" + f][:size].copy_(getattr(a.idx, f))

    def _attn_inputs(self, i: int, t: int) -> AttentionInputs:
        """Layer i's attention inputs for the step's ``t`` real tokens, from the buffers."""
        b = self.bufs
        idx = None
        if self.stack.layers[i].self_attn.indexer is not None:
            idx = IndexerInputs(q=b["idx_q"][:t], w=b["idx_w"][:t], k=b["idx_k"][:t])
        return AttentionInputs(*(b[f][:t] for f in _FIELDS), idx)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size's pieces, largest first (the smaller ones reuse its pool)."""
        if not self.capture:
            return
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info()[0]
        if self.pool is None:
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
            "captured piecewise CUDA graphs of the %s for %d token counts (%d..%d, %d pieces "
            "each) in %.1f s, using %.2f GiB",
            self.name,
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            self.num_layers + 1,
            time.perf_counter() - t0,
            (free0 - torch.cuda.mem_get_info()[0]) / 2**30,
        )

    # ---- one forward ---------------------------------------------------------------------------
    def run(self, inputs: dict[str, torch.Tensor], positions: torch.Tensor, meta) -> torch.Tensor:
        """The stack over ``inputs`` (the stack's input buffers' names -> [T, ...]) at
        ``positions`` [T] (T <= the largest size) with the step's attention metadata -> final
        hidden states [T, hidden] (a view of a static buffer, valid until the next forward)."""
        t = positions.shape[0]
        size = self.size_for(t)
        assert size is not None, f"{t} tokens: larger than every piecewise size"
        for k, buf in self.inputs.items():
            buf[:t].copy_(inputs[k])
            if size > t:
                buf[t:size].zero_()
        self.positions[:t].copy_(positions)
        if size > t:
            self.positions[t:size].zero_()
        graphs = self.graphs.get(size)
        topk = None
        for i in range(self.num_layers + 1):
            if graphs is not None:
                graphs[i].replay()
            else:
                self._piece(i, size)
            if i < self.num_layers:
                _, topk = self.stack.attend(i, self._attn_inputs(i, t), topk, meta, self.out[:t])
        return self.hidden[:t]
