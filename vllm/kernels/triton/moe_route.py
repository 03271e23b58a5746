"""Sigmoid top-k routing of the MoE in one Triton kernel (spec: :func:`vllm.kernels.moe.route_topk`).

The torch formula runs ~8 kernels per layer after the router GEMM (sigmoid, the bias add, a
top-k's two passes, the gather, the sum, the division, the scaling): ~22 µs of a decode layer
at B = 64 on an H100 for a few KB of data. Here one program per token: its E logits are read
once, the top-k found by k rounds of max (ties to the lower expert id), the weights written.

Numerics: the scores are torch's CUDA sigmoid, 1 / (1 + expf(-x)) with the correctly rounded
libdevice ``expf`` and an IEEE division, so the choice sees the same fp32 values; the
normalising sum adds the k chosen scores in order (torch's reduction may pair them
differently: the weights may differ from the reference's in the last bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.triton.utils import check_cuda_or_interpreter, exp_f32, interpreting, next_pow2

__all__ = ["route_topk"]


@triton.jit(do_not_specialize=("stride",))
def _route_kernel(
    logits_ptr,  # fp32 [T, E], row stride `stride`
    bias_ptr,  # fp32 [E]
    w_ptr,  # fp32 [T, TOP_K]
    ids_ptr,  # int64 [T, TOP_K]
    stride,
    scaling,
    E: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    NORM: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    inb = e < E
    x = tl.load(logits_ptr + t * stride + e, mask=inb, other=0.0)
    s = tl.math.div_rn(tl.full([BLOCK_E], 1.0, tl.float32), 1.0 + exp_f32(-x, USE_LIBDEVICE))
    c = tl.where(inb, s + tl.load(bias_ptr + e, mask=inb, other=0.0), float("-inf"))
    k = tl.arange(0, TOP_K)
    ids = tl.zeros([TOP_K], dtype=tl.int32)
    w = tl.zeros([TOP_K], dtype=tl.float32)
    total = tl.zeros([1], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(c, axis=0)
        # (NaN logits match nothing: an in-range id all the same, never an out-of-range one)
        pick = tl.minimum(tl.min(tl.where(c == best, e, BLOCK_E), axis=0), E - 1)
        wj = tl.sum(tl.where(e == pick, s, 0.0), axis=0)
        ids = tl.where(k == j, pick, ids)
        w = tl.where(k == j, wj, w)
        total += wj
        c = tl.where(e == pick, float("-inf"), c)
    if NORM:
        w = tl.math.div_rn(w, total + 1e-20)
    tl.store(w_ptr + t * TOP_K + k, w * scaling)
    tl.store(ids_ptr + t * TOP_K + k, ids.to(tl.int64))


def route_topk(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, norm: bool, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [T, E] (unit column stride), bias [E] -> (weights fp32 [T, top_k], ids int64
    [T, top_k]), top_k a power of two."""
    check_cuda_or_interpreter(logits, bias)
    t, e = logits.shape
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return w, ids
    _route_kernel[(t,)](
        logits, bias.float().contiguous(), w, ids, logits.stride(0), float(scaling),
        E=e, TOP_K=top_k, BLOCK_E=next_pow2(e), NORM=norm, USE_LIBDEVICE=not interpreting(),
        num_warps=4 if e <= 512 else 8,
    )  # fmt: skip
    return w, ids
