"""GLM-5.3 (`GlmMoeDsaForCausalLM`, HF `model_type: glm_moe_dsa`): MLA with q/kv LoRA, the DSA
lightning indexer with IndexShare, sigmoid-routed MoE with a shared expert, and the MTP layer.

Math only. Parameter names follow the HF checkpoint, except that routed experts are stacked
(`mlp.experts.w13_weight` [E, 2I, H], `mlp.experts.w2_weight` [E, H, I], with
`w13_weight_scale_inv`/`w2_weight_scale_inv` when FP8); the loader maps the per-expert checkpoint
tensors onto them. With an FP8 `quantization_config` in the arch (`vllm.config.quantization`)
every Linear but lm_head and the indexer's fp32 `weights_proj`, and the routed experts, are e4m3
with 128×128 block scales. Tensor parallelism shards heads (MLA and indexer) and
MLP intermediates through the `tp` group; expert parallelism goes through `distributed/ep.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm.attention.layer import IndexerInputs, SparseMLAAttention
from vllm.attention.metadata import MLAMetadata
from vllm.config.arch import ModelArch
from vllm.distributed.parallel_state import ParallelContext
from vllm.kernels.activation import silu_and_mul_quant
from vllm.kernels.fp8_gemm import FP8_DTYPE, own_split_counters, takes_x_quant
from vllm.kernels.hadamard import hadamard_transform
from vllm.kernels.moe import fp8_scale_shapes, fused_experts
from vllm.kernels.norm_rope import add_rms_norm, add_rms_norm_quant, rms_norm_quant
from vllm.kernels.router import fp32_out_mm_available, router_logits, split_bf16_terms
from vllm.model_executor.layers.layernorm import LayerNorm, RMSNorm
from vllm.model_executor.layers.linear import Linear, fuse_linears, linear_forward, weight_block
from vllm.model_executor.layers.moe import route_tokens, shared_experts_stream
from vllm.model_executor.layers.rotary import apply_rope, rope_cos_sin


class Indexer(nn.Module):
    """DSA lightning indexer projections: q from the q LoRA latent, one key per token."""

    def __init__(self, arch: ModelArch, pc: ParallelContext, dtype: torch.dtype):
        super().__init__()
        tp = pc.tp
        self.n_heads, self.head_dim, self.rope_dim = (
            arch.index_n_heads,
            arch.index_head_dim,
            arch.qk_rope_head_dim,
        )
        self.interleave, self.tp = arch.indexer_rope_interleave, tp
        kw = dict(tp_rank=tp.rank_in_group, tp_size=tp.world_size)
        q = weight_block(arch)
        self.wq_b = Linear(
            arch.q_lora_rank,
            self.n_heads * self.head_dim,
            shard="col",
            shard_unit=self.head_dim,
            dtype=dtype,
            quant_block=q,
            **kw,
        )
        self.wk = Linear(arch.hidden_size, self.head_dim, dtype=dtype, quant_block=q)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6)
        # fp32, as HF keeps it: the per-head weights decide the selection
        self.weights_proj = Linear(
            arch.hidden_size, self.n_heads, shard="col", dtype=torch.float32, **kw
        )
        self.w_scale = self.n_heads**-0.5 * self.head_dim**-0.5

    def forward(self, x, c_q, cos, sin, k=None) -> IndexerInputs:
        """``k``: wk's product of x where the caller computed it (stacked with q_a and kv_a,
        ``MLAAttention.fused_qkv_a``)."""
        t = x.shape[0]
        q = self.wq_b(c_q).view(
            t, self.wq_b.out_features // self.head_dim, self.head_dim
        )  # [T, Hi_local, D], rope dims first
        # rotated in place: the rope dims stay where they are in each head (no concatenation)
        r = self.rope_dim
        apply_rope(q[..., :r], cos, sin, self.interleave, out=q[..., :r])
        k = self.k_norm(self.wk(x) if k is None else k)  # [T, D]
        apply_rope(k[:, :r], cos, sin, self.interleave, out=k[:, :r])
        w = self.weights_proj(x.float()) * self.w_scale  # [T, Hi_local]
        q = hadamard_transform(q)
        # every TP rank scores with all indexer heads (the indexer's work is not split by TP)
        q = self.tp.all_gather(q, dim=1)
        w = self.tp.all_gather(w, dim=1)
        return IndexerInputs(q=q, w=w, k=hadamard_transform(k))


@dataclass
class AttentionInputs:
    """An attention layer's inputs from :meth:`MLAAttention.project`."""

    q_nope: torch.Tensor  # [T, H, nope]
    q_pe: torch.Tensor  # [T, H, rope], roped
    kv_c: torch.Tensor  # [T, kv_lora_rank], normed
    k_pe: torch.Tensor  # [T, rope], roped
    idx: IndexerInputs | None  # the indexer's q, weights and key (full indexer layers)


class MLAAttention(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        layer_idx: int,
        has_indexer: bool,
        pc: ParallelContext,
        dtype: torch.dtype,
        force_mqa: bool,
    ):
        super().__init__()
        tp = pc.tp
        if arch.num_attention_heads % tp.world_size:
            raise ValueError(
                f"{arch.num_attention_heads} attention heads do not split across "
                f"--tensor-parallel-size {tp.world_size}"
            )
        self.tp, self.dtype = tp, dtype
        self.num_heads = arch.num_attention_heads // tp.world_size
        self.nope, self.rope, self.v = arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim
        self.kv_lora_rank, self.interleave, self.theta = (
            arch.kv_lora_rank,
            arch.rope_interleave,
            arch.rope_theta,
        )
        q = weight_block(arch)
        kw = dict(tp_rank=tp.rank_in_group, tp_size=tp.world_size, dtype=dtype, quant_block=q)
        self.q_a_proj = Linear(arch.hidden_size, arch.q_lora_rank, dtype=dtype, quant_block=q)
        self.q_a_layernorm = RMSNorm(arch.q_lora_rank, arch.rms_norm_eps, dtype)
        self.q_b_proj = Linear(
            arch.q_lora_rank,
            arch.num_attention_heads * arch.qk_head_dim,
            shard="col",
            shard_unit=arch.qk_head_dim,
            **kw,
        )
        self.kv_a_proj_with_mqa = Linear(
            arch.hidden_size, arch.kv_lora_rank + self.rope, dtype=dtype, quant_block=q
        )
        self.kv_a_layernorm = RMSNorm(arch.kv_lora_rank, arch.rms_norm_eps, dtype)
        # (weight, scale, block) of q_a_proj and kv_a_proj_with_mqa stacked, after loading
        # (process_weights_after_loading); their parameters are then views of it
        self.fused_qkv_a: tuple | None = None
        self.qkv_a_split: list[int] = []  # the stack's parts' widths: q_a[, wk], kv_a
        self.q_lora_rank, self.kv_a_width = arch.q_lora_rank, arch.kv_lora_rank + self.rope
        self.kv_b_proj = Linear(
            arch.kv_lora_rank,
            arch.num_attention_heads * (self.nope + self.v),
            shard="col",
            shard_unit=self.nope + self.v,
            **kw,
        )
        self.o_proj = Linear(
            arch.num_attention_heads * self.v,
            arch.hidden_size,
            shard="row",
            shard_unit=self.v,
            **kw,
        )
        self.indexer = Indexer(arch, pc, dtype) if has_indexer else None
        self.attn = SparseMLAAttention(
            layer_idx,
            self.num_heads,
            self.nope,
            self.v,
            arch.kv_lora_rank,
            self.rope,
            arch.softmax_scale,
            has_indexer,
            force_mqa,
        )

    def process_weights_after_loading(self) -> None:
        """Absorb kv_b_proj into the attention's W_UK / W_UV, in the model dtype (as upstream's
        MLA: an fp8 kv_b is dequantised once), and drop it: nothing else reads it, and GLM-5.3's
        kv_b (79 layers) would otherwise hold 1.2 GB per GPU in fp8 beside 2.3 GB absorbed."""
        if self.kv_b_proj is None:
            return
        self.attn.set_kv_b(self.kv_b_proj.dense_weight(torch.float32), self.dtype)
        self.kv_b_proj = None
        # q_a and kv_a read the same x: one GEMM (upstream's fused_qkv_a_proj, N = 2048 + 576 for
        # GLM-5.3): kv_a alone (N = 576) leaves most of the GPU idle at decode sizes, and under
        # FP8 x is quantised once. A full indexer layer's wk (N = 128) reads it too and joins the
        # stack between them (q_a's and wk's rows end on a scale block; kv_a's 576 do not, so it
        # goes last): one launch and one quantisation of x fewer
        wk = self.indexer.wk if self.indexer is not None else None
        for parts in (
            [self.q_a_proj, wk, self.kv_a_proj_with_mqa],
            [self.q_a_proj, self.kv_a_proj_with_mqa],
        ):
            if None in parts:
                continue
            fused = fuse_linears(parts)
            if fused is not None:
                self.fused_qkv_a = (*fused, self.q_a_proj.block)
                self.qkv_a_split = [p.out_features for p in parts]
                break

    def project(self, x, positions, x_quant=None, rope=None) -> AttentionInputs:
        """Everything before the attention kernels: the q/kv LoRA projections and norms, RoPE,
        and the indexer's projections (no metadata, no KV cache: a piece of a piecewise graph).
        ``x_quant``: x quantised by the norm before it, for the FP8 q_a+kv_a GEMM. ``rope``: the
        positions' (cos, sin) when the caller has them (every layer's are the same)."""
        t = x.shape[0]
        cos, sin = rope if rope is not None else self.rope_angles(positions)
        if self.fused_qkv_a is not None:
            qkv = linear_forward(x, *self.fused_qkv_a, x_quant=x_quant)
            c_q, *idx_k, kv = qkv.split(self.qkv_a_split, -1)
        else:
            c_q, kv, idx_k = self.q_a_proj(x), self.kv_a_proj_with_mqa(x), []
        qb = self.q_b_proj
        c_q, c_q_quant = norm_for_gemm(
            self.q_a_layernorm, c_q, qb.weight, qb.weight_scale_inv, qb.block
        )
        q = qb(c_q, c_q_quant).view(t, self.num_heads, self.nope + self.rope)
        # the rope dims rotated in place: q_nope and q_pe stay the two halves of one [T, H, nope +
        # rope] tensor, which the dense prefill form takes as its query without a concatenation
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        apply_rope(q_pe, cos, sin, self.interleave, out=q_pe)
        kv_c = self.kv_a_layernorm(kv[:, : self.kv_lora_rank])
        k_pe = apply_rope(kv[:, self.kv_lora_rank :], cos, sin, self.interleave)
        idx = None
        if self.indexer is not None:
            idx = self.indexer(x, c_q, cos, sin, idx_k[0] if idx_k else None)
        return AttentionInputs(q_nope, q_pe, kv_c, k_pe, idx)

    def rope_angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, rope/2] fp32 of the positions, for :meth:`project`."""
        return rope_cos_sin(positions, self.rope, self.theta)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """The attention output [T, H, v] -> o_proj, reduced over TP."""
        t = out.shape[0]
        return self.tp.all_reduce(self.o_proj(out.reshape(t, self.num_heads * self.v)))

    def forward(self, x, positions, meta: MLAMetadata, prev_topk):
        a = self.project(x, positions)
        out, topk = self.attn(a.q_nope, a.q_pe, a.kv_c, a.k_pe, a.idx, prev_topk, meta)
        return self.output(out), topk


def norm_for_gemm(
    norm: RMSNorm,
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    block: tuple[int, int],
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """``norm(x)`` for the linear (weight, scale, block) that reads it next, and where that is an
    FP8 GEMM reading a producer's quantisation (decode sizes, ``takes_x_quant``), x's e4m3 bytes
    and scales from the same launch (one launch fewer; the GEMM's own quantisation's bytes):
    (y, x_quant or None)."""
    if scale is not None and takes_x_quant(x, weight, block):
        return rms_norm_quant(x, norm.weight, norm.eps, block[1])
    return norm(x), None


def add_norm_for_gemm(
    norm: RMSNorm,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    block: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """:func:`norm_for_gemm` of s = x + residual, the add in the norm's pass: (y, s, x_quant or
    None)."""
    if scale is not None and takes_x_quant(x, weight, block):
        return add_rms_norm_quant(x, residual, norm.weight, norm.eps, block[1])
    y, s = add_rms_norm(x, residual, norm.weight, norm.eps)
    return y, s, None


class MLP(nn.Module):
    """SwiGLU MLP, TP-sharded along the intermediate dimension (reduce done by the caller)."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        pc: ParallelContext,
        dtype: torch.dtype,
        shard: bool = True,
        quant_block: tuple[int, int] | None = None,
    ):
        super().__init__()
        kw = (
            dict(tp_rank=pc.tp.rank_in_group, tp_size=pc.tp.world_size, dtype=dtype)
            if shard
            else dict(dtype=dtype)
        )
        kw["quant_block"] = quant_block
        self.gate_proj = Linear(hidden, inter, shard="col" if shard else None, **kw)
        self.up_proj = Linear(hidden, inter, shard="col" if shard else None, **kw)
        self.down_proj = Linear(inter, hidden, shard="row" if shard else None, **kw)
        # gate and up read the same x: one GEMM (upstream's gate_up_proj), and under FP8 one
        # quantisation of x
        fused = fuse_linears([self.gate_proj, self.up_proj])
        self.gate_up = None if fused is None else (*fused, self.gate_proj.block)

    def input_gemm(self) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int]]:
        """(weight, scale, block) of the GEMM that reads x first (for ``norm_for_gemm``)."""
        g = self.gate_proj
        return self.gate_up or (g.weight, g.weight_scale_inv, g.block)

    def forward(self, x, x_quant=None):
        """``x_quant``: x quantised by the norm before it (``norm_for_gemm``)."""
        if self.gate_up is not None:
            gu = linear_forward(x, *self.gate_up, x_quant=x_quant)
            d = self.down_proj
            if d.weight_scale_inv is not None and takes_x_quant(gu, d.weight, d.block):
                # SiLU·up and the down GEMM's quantisation of it in one launch (decode sizes)
                h, h_quant = silu_and_mul_quant(gu.reshape(-1, gu.shape[-1]), d.block[1])
                return d(h.view(*gu.shape[:-1], -1), h_quant)
            gate, up = gu.chunk(2, -1)
        else:
            gate, up = self.gate_proj(x, x_quant), self.up_proj(x, x_quant)
        return self.down_proj(nn.functional.silu(gate) * up)


class Router(nn.Module):
    """The gate: fp32 logits of x against the fp32 router weight, then :func:`route_tokens`.
    After loading on CUDA in a bf16 model the weight becomes its exact bf16 terms
    (:mod:`vllm.kernels.router`: the same logits up to summation order, on the tensor cores)."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(arch.n_routed_experts, arch.hidden_size), requires_grad=False
        )
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(arch.n_routed_experts), requires_grad=False
        )
        self.arch, self.dtype = arch, dtype
        self.num_terms = 0  # > 0: weight holds that many bf16 terms [num_terms·E, H]

    def process_weights_after_loading(self) -> None:
        w = self.weight
        if self.num_terms or self.dtype != torch.bfloat16 or w.dtype != torch.float32:
            return
        if not fp32_out_mm_available(w.device):
            return
        terms = split_bf16_terms(w.data)
        if terms is not None:
            self.num_terms = terms.shape[0] // w.shape[0]
            self.weight = nn.Parameter(terms, requires_grad=False)

    def forward(self, x):
        a = self.arch
        if self.num_terms:
            logits = router_logits(x, self.weight, self.num_terms)
        else:
            logits = nn.functional.linear(x.float(), self.weight.float())
        return route_tokens(
            logits,
            self.e_score_correction_bias,
            a.num_experts_per_tok,
            a.n_group,
            a.topk_group,
            a.norm_topk_prob,
            a.routed_scaling_factor,
        )


class Experts(nn.Module):
    """Routed experts held by this rank: all of them (TP-sharded intermediates) or, under EP, the
    contiguous range [expert_start, expert_start + num_local) at full width. FP8 (``weight_block``
    of the arch): e4m3 weights with fp32 ``w13_weight_scale_inv`` [E_loc, 2·ceil(I/128),
    ceil(H/128)] (gate's row blocks, then up's) and ``w2_weight_scale_inv`` [E_loc, ceil(H/128),
    ceil(I/128)], the layout of :func:`vllm.kernels.moe.experts_ref`."""

    def __init__(self, arch: ModelArch, pc: ParallelContext, dtype: torch.dtype):
        super().__init__()
        inter, h = arch.moe_intermediate_size, arch.hidden_size
        self.ep, self.pc = pc.ep, pc
        self.expert_start, self.num_local = pc.expert_shard(arch.n_routed_experts)
        self.num_experts = arch.n_routed_experts
        if self.ep is not None:  # whole experts, full width
            self.tp_size, self.tp_rank = 1, 0
        else:  # every expert, TP-sharded intermediates
            self.tp_size, self.tp_rank = pc.tp.world_size, pc.tp.rank_in_group
            inter //= self.tp_size
        self.inter = inter
        self.block = weight_block(arch)
        wdtype = dtype if self.block is None else FP8_DTYPE
        self.w13_weight = nn.Parameter(
            torch.empty(self.num_local, 2 * inter, h, dtype=wdtype), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(self.num_local, h, inter, dtype=wdtype), requires_grad=False
        )
        self.w13_weight_scale_inv: nn.Parameter | None = None
        self.w2_weight_scale_inv: nn.Parameter | None = None
        if self.block is not None:
            s13, s2 = fp8_scale_shapes(self.num_local, h, inter, self.block[0])
            self.w13_weight_scale_inv = nn.Parameter(
                torch.empty(s13, dtype=torch.float32), requires_grad=False
            )
            self.w2_weight_scale_inv = nn.Parameter(
                torch.empty(s2, dtype=torch.float32), requires_grad=False
            )

    def process_weights_after_loading(self) -> None:
        """The e4m3 experts' block scales stored with the K blocks first ([E, K/128, N/128] in
        memory, the same [E, N/128, K/128] values and shape): the layout CUTLASS's grouped GEMM
        reads, so the prefill path passes them without a copy per call; the Triton kernels and
        the reference read them through their strides."""
        for name in ("w13_weight_scale_inv", "w2_weight_scale_inv"):
            p = getattr(self, name)
            if p is not None and not p.transpose(1, 2).is_contiguous():
                p.data = p.data.transpose(1, 2).contiguous().transpose(1, 2)

    def forward(self, x, weights, ids, x_quant=None):
        """``x_quant``: x's FP8 quantisation by its producer, read without EP (under EP the
        dispatched rows are quantised where they land)."""
        if self.ep is not None:
            from vllm.distributed.ep import ep_moe

            return ep_moe(self.pc, x, weights, ids, self)
        return self._local(x, weights, ids, x_quant)

    def _local(self, x, weights, ids, x_quant=None):
        return self.run_local(x, weights, ids, x_quant)

    def run_local(self, x, weights, ids, x_quant=None, all_local=False):
        """This rank's experts over rows x [N, H] with global ids/weights [N, k]; pairs whose
        expert another rank owns contribute 0 (the one seam every caller, EP included, uses).
        ``all_local``: every pair is this rank's (EP's counts path), so the kernels size their
        tiles by pairs per local expert, not by a share of pairs spread over all experts."""
        return fused_experts(
            x,
            self.w13_weight,
            self.w2_weight,
            ids,
            weights,
            self.expert_start,
            w13_scale=self.w13_weight_scale_inv,
            w2_scale=self.w2_weight_scale_inv,
            num_experts=None if all_local else self.num_experts,
            x_quant=x_quant if self.block is not None else None,
        )


class MoE(nn.Module):
    """Routed + shared experts. Returns the full (TP-reduced) output: without EP the routed experts
    are TP-sharded like the shared one and one reduce covers both; under EP the routed output is
    already complete and only the shared expert is reduced."""

    def __init__(self, arch: ModelArch, pc: ParallelContext, dtype: torch.dtype):
        super().__init__()
        self.tp = pc.tp
        self.gate = Router(arch, dtype)
        self.experts = Experts(arch, pc, dtype)
        self.shared_experts = (
            MLP(
                arch.hidden_size,
                arch.moe_intermediate_size * arch.n_shared_experts,
                pc,
                dtype,
                quant_block=weight_block(arch),
            )
            if arch.n_shared_experts
            else None
        )

    def input_gemm(self) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int]] | None:
        """The shared expert's first GEMM (``MLP.input_gemm``), None without one."""
        return None if self.shared_experts is None else self.shared_experts.input_gemm()

    def forward(self, x, x_quant=None):
        """``x_quant``: x quantised by the norm before it (decode sizes), for the shared
        expert and the routed ones (one quantisation of x for both). At decode sizes on CUDA the
        shared expert runs on a side stream (``shared_experts_stream``) while the router and the
        routed experts (and EP's exchanges) run on the current one; the current stream waits for
        it before the sum. Neither branch writes x or x_quant, and every block either side
        allocates is freed for reuse only in its own stream's order after the join: no
        ``record_stream`` is needed, eagerly or under graph capture. The shared expert's split-K
        GEMMs reduce with counters of their own (``own_split_counters``)."""
        side = shared_experts_stream(x) if self.shared_experts is not None else None
        if side is not None:
            main = torch.cuda.current_stream(x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side), own_split_counters():
                shared = self.shared_experts(x, x_quant)
            weights, ids = self.gate(x)
            routed = self.experts(x, weights, ids, x_quant)
            main.wait_stream(side)
        else:
            weights, ids = self.gate(x)
            routed = self.experts(x, weights, ids, x_quant)
            shared = (
                self.shared_experts(x, x_quant)
                if self.shared_experts is not None
                else torch.zeros_like(x)
            )
        if self.experts.ep is not None:
            return routed + self.tp.all_reduce(shared)
        return self.tp.all_reduce(routed + shared)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        layer_idx: int,
        has_indexer: bool,
        pc: ParallelContext,
        dtype: torch.dtype,
        force_mqa: bool,
    ):
        super().__init__()
        self.tp = pc.tp
        self.is_moe = arch.is_moe_layer(layer_idx)
        self.self_attn = MLAAttention(arch, layer_idx, has_indexer, pc, dtype, force_mqa)
        self.mlp = (
            MoE(arch, pc, dtype)
            if self.is_moe
            else MLP(
                arch.hidden_size, arch.intermediate_size, pc, dtype, quant_block=weight_block(arch)
            )
        )
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)

    def pre_attention(self, x, positions, rope=None) -> AttentionInputs:
        attn, norm = self.self_attn, self.input_layernorm
        if attn.fused_qkv_a is not None:
            y, x_quant = norm_for_gemm(norm, x, *attn.fused_qkv_a)
            return attn.project(y, positions, x_quant, rope)
        return attn.project(norm(x), positions, rope=rope)

    def add_pre_attention(self, x, h, positions, rope=None) -> tuple[torch.Tensor, AttentionInputs]:
        """:meth:`pre_attention` of x + h, where h is the previous layer's MLP output not yet
        added to its residual stream x: the add runs in the input norm's pass. Returns (x + h,
        the attention inputs)."""
        attn, norm = self.self_attn, self.input_layernorm
        if attn.fused_qkv_a is not None:
            y, x, x_quant = add_norm_for_gemm(norm, h, x, *attn.fused_qkv_a)
            return x, attn.project(y, positions, x_quant, rope)
        y, x = add_rms_norm(h, x, norm.weight, norm.eps)
        return x, attn.project(y, positions, rope=rope)

    def post_attention_parts(self, x, attn_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's residual stream after the attention, and its MLP's (reduced) output not
        yet added to it: (x + o_proj(attention), h). The attention's add runs in the
        post-attention norm's pass; the next layer's input norm, or the final norm, adds h."""
        a = self.self_attn.output(attn_out)
        norm, gemm = self.post_attention_layernorm, self.mlp.input_gemm()
        if gemm is None:
            y, x = add_rms_norm(a, x, norm.weight, norm.eps)
            h = self.mlp(y)
        else:
            y, x, x_quant = add_norm_for_gemm(norm, a, x, *gemm)
            h = self.mlp(y, x_quant)
        return x, (h if self.is_moe else self.tp.all_reduce(h))

    def post_attention(self, x, attn_out: torch.Tensor) -> torch.Tensor:
        """The layer's output from its input ``x`` and the attention output [T, H, v]."""
        x, h = self.post_attention_parts(x, attn_out)
        return x + h

    def forward(self, x, h, positions, meta, prev_topk, rope=None):
        """One step of the model's loop. ``h``: the previous layer's MLP output not yet added to
        the residual stream ``x`` (None before the first layer). Returns (x, this layer's MLP
        output, its top-k), the MLP output not yet added either: the next layer's input norm, or
        the final norm, adds it in its pass. ``prev_topk``: the top-k a shared-indexer layer
        reuses (ignored by layers with their own indexer)."""
        if h is None:
            a = self.pre_attention(x, positions, rope)
        else:
            x, a = self.add_pre_attention(x, h, positions, rope)
        attn = self.self_attn.attn
        prev = prev_topk if not attn.has_indexer else None
        out, topk = attn(a.q_nope, a.q_pe, a.kv_c, a.k_pe, a.idx, prev, meta)
        x, h = self.post_attention_parts(x, out)
        return x, h, topk


class MTPLayer(nn.Module):
    """The multi-token-prediction layer (index = num_hidden_layers in the checkpoint)."""

    def __init__(
        self,
        arch: ModelArch,
        layer_idx: int,
        pc: ParallelContext,
        dtype: torch.dtype,
        force_mqa: bool,
    ):
        super().__init__()
        h = arch.hidden_size
        self.enorm = RMSNorm(h, arch.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(h, arch.rms_norm_eps, dtype)
        self.eh_proj = Linear(2 * h, h, dtype=dtype, quant_block=weight_block(arch))
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, arch.rms_norm_eps, dtype)
        self.block = DecoderLayer(arch, layer_idx, True, pc, dtype, force_mqa)

    def forward(self, embeds, prev_hidden, positions, meta):
        """The block's output before the shared head's norm: what the next draft step takes as
        its previous hidden state (upstream's MTP proposers chain it the same way)."""
        x, a = self.pre_attention(embeds, prev_hidden, positions)
        out, _ = self.block.self_attn.attn(a.q_nope, a.q_pe, a.kv_c, a.k_pe, a.idx, None, meta)
        return self.block.post_attention(x, out)

    def pre_attention(self, embeds, prev_hidden, positions) -> tuple[torch.Tensor, AttentionInputs]:
        """The block's input and its attention inputs (a piece of a piecewise graph)."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev_hidden)], dim=-1))
        return x, self.block.pre_attention(x, positions)


class GlmMoeDsaModel(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        pc: ParallelContext,
        dtype: torch.dtype,
        force_mqa: bool,
        num_mtp: int,
    ):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, i, arch.indexer_types[i] == "full", pc, dtype, force_mqa)
            for i in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mtp = nn.ModuleList(
            MTPLayer(arch, arch.num_hidden_layers + j, pc, dtype, force_mqa) for j in range(num_mtp)
        )

    def forward(self, input_ids, positions, meta):
        x, h = self.embed_tokens(input_ids), None
        topk = None
        # the rotary angles of the positions once for every layer (the same dims and theta)
        rope = self.rope_angles(positions)
        # each layer's MLP output h is added to the residual stream x by the next norm's pass;
        # the layers are called as modules (their hooks fire: per-layer timings, probes)
        for layer in self.layers:
            x, h, topk = layer(x, h, positions, meta, topk, rope)
        return self._final_norm(x, h)

    def _final_norm(self, x: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
        if h is None:
            return self.norm(x)
        return add_rms_norm(h, x, self.norm.weight, self.norm.eps)[0]

    # The forward as pieces around the attention kernels (what piecewise CUDA graphs capture,
    # `worker/gpu/piecewise.py`): piece 0 embeds the tokens and projects layer 0's attention
    # inputs; piece i (0 < i < L) finishes layer i − 1 (o_proj, residual, MLP/MoE) and projects
    # layer i's; piece L finishes the last layer and applies the final norm. Between pieces,
    # :meth:`attend` runs layer i's attention (KV writes, indexer top-k, sparse or dense
    # attention), the only part that reads the metadata and the KV cache. The same functions as
    # :meth:`forward`'s loop (post_attention_parts, then the next layer's add_pre_attention: a
    # layer's MLP output is added to the residual stream in the next norm's pass).
    def piece(
        self,
        i: int,
        x: torch.Tensor,
        positions: torch.Tensor,
        attn_out: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, AttentionInputs | None]:
        """Piece ``i`` -> (hidden states, layer i's attention inputs; None after the last).
        ``x``: the input ids for piece 0, else the previous piece's hidden states. ``rope``: the
        positions' (cos, sin) (:meth:`rope_angles`) when the caller keeps them for every piece."""
        h = None
        if i == 0:
            x = self.embed_tokens(x)
        else:
            x, h = self.layers[i - 1].post_attention_parts(x, attn_out)
        if i == len(self.layers):
            return self._final_norm(x, h), None
        if h is None:
            return x, self.layers[i].pre_attention(x, positions, rope)
        return self.layers[i].add_pre_attention(x, h, positions, rope)

    def rope_angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The positions' rotary (cos, sin), the same for every layer (None without layers)."""
        return self.layers[0].self_attn.rope_angles(positions) if len(self.layers) else None

    def attend(
        self,
        i: int,
        a: AttentionInputs,
        prev_topk: torch.Tensor | None,
        meta: MLAMetadata,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer i's attention -> (output [T, H, v], top-k for the next shared layer); a shared
        layer reuses ``prev_topk``, a full indexer layer computes its own. ``out``: a buffer to
        write the output into."""
        attn = self.layers[i].self_attn.attn
        topk = None if attn.has_indexer else prev_topk
        return attn(a.q_nope, a.q_pe, a.kv_c, a.k_pe, a.idx, topk, meta, out=out)


class GlmMoeDsaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], meta) -> final normed hidden states [T, hidden];
    compute_logits(hidden) -> [N, vocab] fp32; mtp_forward / mtp_logits draft the token after next."""

    def __init__(
        self,
        arch: ModelArch,
        pc: ParallelContext | None = None,
        dtype: torch.dtype = torch.float32,
        force_mqa: bool = False,
        load_mtp: bool = True,
    ):
        super().__init__()
        pc = pc or ParallelContext.single()
        self.arch, self.pc, self.dtype = arch, pc, dtype
        self.num_mtp = arch.num_nextn_predict_layers if load_mtp else 0
        self.model = GlmMoeDsaModel(arch, pc, dtype, force_mqa, self.num_mtp)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, dtype=dtype)

    def attention_layers(self) -> list[SparseMLAAttention]:
        """Every attention layer in cache order: main layers, then MTP layers."""
        main = [layer.self_attn.attn for layer in self.model.layers]
        return main + [m.block.self_attn.attn for m in self.model.mtp]

    def process_weights_after_loading(self) -> None:
        for m in self.modules():
            if isinstance(m, (MLAAttention, Router, Experts)):
                m.process_weights_after_loading()

    def forward(self, input_ids, positions, meta: MLAMetadata):
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def mtp_forward(self, input_ids, prev_hidden, positions, meta: MLAMetadata, step: int = 0):
        """One MTP draft step over tokens [T]: at position t, the embedding of token t+1 with the
        previous hidden state of position t (the target's final hidden state for the first step,
        this method's own output after) -> hidden [T, hidden] for :meth:`mtp_logits`."""
        mtp = self.model.mtp[step % len(self.model.mtp)]
        return mtp(self.model.embed_tokens(input_ids), prev_hidden, positions, meta)

    def mtp_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        """[N, vocab] fp32 logits of the token after next: the MTP layer's shared head (its norm,
        then the model's lm_head)."""
        mtp = self.model.mtp[step % len(self.model.mtp)]
        return self.compute_logits(mtp.shared_head.norm(hidden))
