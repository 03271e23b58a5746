"""Weight bytes one rank holds, by kind, from the architecture alone (nothing allocated).

One function for the worker's start-up check (do this rank's weights fit its GPU?) and for
`vllm plan`. It mirrors `GlmMoeDsaForCausalLM`'s parameters: their shapes under TP/EP, e4m3 +
fp32 block scales for the FP8 linears and routed experts (``weight_block`` of the arch),
``dtype`` elsewhere, the router and the indexer's ``weights_proj``/``k_norm`` in fp32; kv_b_proj
as the absorbed W_UK/W_UV (``dtype``) the attention layers derive from it at load, dropping it.
tests/model_executor/test_fp8_weights.py compares it with a built model's parameters.

GLM-5.3 in FP8 at EP8 with attention replicated (the seed's DP8+EP8 decode and PCP8×DCP8×EP8
prefill): routed experts 75 layers × 256 × 3 × 2048 × 6144 B = 725 GB / 8 = 90.6 GB per GPU;
attention 14.2 GB (2.3 GB of it the bf16 absorbed W_UK/W_UV), shared experts 2.8 GB, dense MLP
0.7 GB, embeddings and lm_head 3.8 GB (bf16), router and norms 0.5 GB: ~112.6 GB (104.9 GiB) per
GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.config.arch import ModelArch
from vllm.model_executor.layers.linear import cdiv, shard_block, weight_block

GiB = 1 << 30
KINDS = (
    "routed experts",
    "attention",
    "dense MLP",
    "shared experts",
    "embeddings/lm_head",
    "other",  # layer norms, router, MTP's eh_proj and norms
)
FP32 = 4
SCALE = 4  # fp32 per block


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of one rank's weights by kind (keys: KINDS)."""

    by_kind: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def describe(self) -> str:
        """'108.10 GiB (routed experts 84.40, attention 16.45, ...)' (MiB below 1 GiB)."""
        unit, name = (GiB, "GiB") if self.total >= GiB else (1 << 20, "MiB")
        parts = ", ".join(f"{k} {v / unit:.2f}" for k, v in self.by_kind.items() if v)
        return f"{self.total / unit:.2f} {name} ({parts})"


def _linear(
    n: int,
    k: int,
    dtype: torch.dtype,
    block: tuple[int, int] | None,
    shard: str | None = None,
    tp: tuple[int, int] = (0, 1),
) -> int:
    """Bytes of a `Linear` [n, k] (full sizes) on TP rank tp[0] of tp[1]."""
    rank, size = tp
    row0 = col0 = 0
    if shard == "col":
        n //= size
        row0 = rank * n
    elif shard == "row":
        k //= size
        col0 = rank * k
    if block is None:
        return n * k * dtype.itemsize
    bn, bk = shard_block(row0, n, block[0]), shard_block(col0, k, block[1])
    return n * k + cdiv(n, bn) * cdiv(k, bk) * SCALE


def _attention(a: ModelArch, has_indexer: bool, dtype, block, tp) -> int:
    d, heads = dtype.itemsize, a.num_attention_heads // tp[1]
    # _linear takes [out, in]: q_a_proj is [q_lora_rank, hidden]
    b = _linear(a.q_lora_rank, a.hidden_size, dtype, block)
    b += a.q_lora_rank * d + a.kv_lora_rank * d  # q_a / kv_a layernorms
    b += _linear(a.num_attention_heads * a.qk_head_dim, a.q_lora_rank, dtype, block, "col", tp)
    b += _linear(a.kv_lora_rank + a.qk_rope_head_dim, a.hidden_size, dtype, block)
    nv = a.qk_nope_head_dim + a.v_head_dim
    b += _linear(a.hidden_size, a.num_attention_heads * a.v_head_dim, dtype, block, "row", tp)
    # kv_b_proj lives on as the absorbed W_UK, W_UV in the model dtype (it is dropped at load)
    b += heads * nv * a.kv_lora_rank * d
    if has_indexer:
        di = a.index_head_dim
        b += _linear(a.index_n_heads * di, a.q_lora_rank, dtype, block, "col", tp)
        b += _linear(di, a.hidden_size, dtype, block)
        b += 2 * di * FP32  # k_norm weight + bias
        b += _linear(a.index_n_heads, a.hidden_size, torch.float32, None, "col", tp)
    return b


def _mlp(h: int, inter: int, dtype, block, tp) -> int:
    return 2 * _linear(inter, h, dtype, block, "col", tp) + _linear(
        h, inter, dtype, block, "row", tp
    )


def _routed(a: ModelArch, dtype, block, tp, ep_size: int | None) -> int:
    h, inter, e = a.hidden_size, a.moe_intermediate_size, a.n_routed_experts
    if ep_size is None:  # every expert, TP-sharded intermediates
        inter //= tp[1]
    else:  # whole experts, 1/EP of them
        e //= ep_size
    if block is None:
        return e * 3 * inter * h * dtype.itemsize
    gi, gh = cdiv(inter, block[0]), cdiv(h, block[1])
    return e * (3 * inter * h + 3 * gi * gh * SCALE)


def weight_bytes_per_rank(
    arch: ModelArch,
    dtype: torch.dtype,
    *,
    tp_size: int = 1,
    tp_rank: int = 0,
    ep_size: int | None = None,
    num_mtp: int = 0,
) -> WeightBytes:
    """Weight bytes of TP rank ``tp_rank`` of ``tp_size`` by kind (KINDS). ``ep_size``: the EP
    group's size under --enable-expert-parallel (whole experts, E / ep_size per rank), None
    without it (every expert, intermediates TP-sharded). FP8 when ``weight_block(arch)``; ``dtype``
    is the model's compute dtype for everything that is not FP8 (and not fp32 by design)."""
    a, block, tp = arch, weight_block(arch), (tp_rank, tp_size)
    d, h = dtype.itemsize, arch.hidden_size
    kinds = dict.fromkeys(KINDS, 0)
    layers = [(i, a.indexer_types[i] == "full") for i in range(a.num_hidden_layers)]
    layers += [(a.num_hidden_layers + j, True) for j in range(num_mtp)]
    for i, has_indexer in layers:
        kinds["attention"] += _attention(a, has_indexer, dtype, block, tp)
        kinds["other"] += 2 * h * d  # input / post-attention layernorms
        if not a.is_moe_layer(i):
            kinds["dense MLP"] += _mlp(h, a.intermediate_size, dtype, block, tp)
            continue
        kinds["routed experts"] += _routed(a, dtype, block, tp, ep_size)
        # router weight + bias, fp32 as stored; a bf16 model on CUDA holds the weight as up to three
        # exact bf16 terms instead (vllm/kernels/router.py: 1.5x for an fp32-valued router, 0.5x for
        # a bf16-valued one; GLM-5.3: +0.25 GB at most), counted where the KV cache is sized
        kinds["other"] += a.n_routed_experts * (h + 1) * FP32
        if a.n_shared_experts:
            inter = a.moe_intermediate_size * a.n_shared_experts
            kinds["shared experts"] += _mlp(h, inter, dtype, block, tp)
    kinds["embeddings/lm_head"] = 2 * a.vocab_size * h * d
    kinds["other"] += h * d  # final norm
    kinds["other"] += num_mtp * (3 * h * d + _linear(h, 2 * h, dtype, block))
    return WeightBytes(kinds)


def check_weights_fit(
    weights: WeightBytes, free_bytes: int, total_bytes: int, utilization: float, where: str
) -> None:
    """Raise ValueError naming the shortfall in GiB when ``weights`` exceed this process's share
    of the GPU: total · --gpu-memory-utilization (as upstream: an engine's fraction, whatever
    other processes hold), and never more than is free."""
    budget = min(total_bytes * utilization, free_bytes)
    if weights.total <= budget:
        return
    raise ValueError(
        f"the weights do not fit {where}: this rank holds {weights.describe()}, but "
        f"{max(budget, 0) / GiB:.2f} GiB is available (--gpu-memory-utilization {utilization:g} "
        f"of {total_bytes / GiB:.2f} GiB, {free_bytes / GiB:.2f} GiB free): "
        f"{(weights.total - budget) / GiB:.2f} GiB short. Use an FP8 checkpoint or "
        "--quantization fp8, spread the experts over more ranks (--enable-expert-parallel with "
        "a larger --data-parallel-size or --tensor-parallel-size), or raise "
        "--gpu-memory-utilization"
    )
