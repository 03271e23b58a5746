"""LSE merge of partial attentions over disjoint key sets: the DCP combine (``ag_rs``/``a2a``) and
the split-K combine of the decode kernels.

    lse = log Σ_i exp(lse_i);  out = Σ_i exp(lse_i − lse) · out_i

A shard with lse −inf contributes nothing; when every shard is −inf the result is zeros and −inf,
never NaN. CUDA tensors: ``vllm/kernels/triton/merge_attn.py``; elsewhere the reference.
"""

from __future__ import annotations

import torch

from vllm.kernels import kernel_module


def merge_attn_states(
    outs: torch.Tensor, lses: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine N partial attentions over disjoint key sets.

    outs: [N, ..., d_v] (any float dtype); lses: [N, ...] fp32 natural-log LSE, −inf = empty shard.
    Returns out [..., d_v] in ``out_dtype`` and lse [...] fp32.
    """
    fast = kernel_module("triton.merge_attn", outs)
    if fast is not None:
        return fast.merge_attn_states(outs, lses, out_dtype)
    out, lse = merge_attn_states_ref(outs, lses)
    return out.to(out_dtype), lse


def merge_attn_states_ref(
    outs: torch.Tensor, lses: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 reference: lse_g = logsumexp_i lse_i; out = Σ_i exp(lse_i − lse_g)·out_i."""
    lse_g = torch.logsumexp(lses.float(), dim=0)
    w = torch.exp(lses - lse_g.unsqueeze(0).clamp_min(torch.finfo(torch.float32).min))
    w = torch.nan_to_num(w, nan=0.0)
    return (w.unsqueeze(-1) * outs.float()).sum(dim=0), lse_g


def merge_attn_cost(num_shards: int, num_rows: int, d_v: int, in_bytes: int = 4) -> tuple[int, int]:
    """(flops, bytes): a multiply-add per shard and value; every shard read once, result written."""
    flops = 2 * num_shards * num_rows * d_v
    nbytes = num_shards * num_rows * (d_v * in_bytes + 4) + num_rows * (d_v * 4 + 4)
    return flops, nbytes
