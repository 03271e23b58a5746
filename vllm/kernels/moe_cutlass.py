"""Routed FP8 experts at prefill sizes through CUTLASS's grouped GEMM (``vllm._C``'s
``moe_grouped_fp8_gemm``, ``csrc/moe/moe_grouped_fp8_sm90.cu``), same contract as
:func:`vllm.kernels.moe.experts_ref` for e4m3 experts.

    experts_cutlass_fp8(x, w13, w2, ids, weights, offset, w13_scale, w2_scale) ≈ experts_ref(...)

Steps, all on the device with no host synchronisation (a fixed sequence of launches):
1. The T·k pairs keyed by local expert (other ranks' pairs after the last), stably sorted, and
   the experts' row offsets ``offsets`` int32 [E_loc + 1] (:func:`sort_pairs`).
2. x's per-token-group quantisation in that order: e4m3 [P, H] and its scales group-major (each
   expert's [H/128, m_e] block in turn: the layout CUTLASS's collective derives from each group's
   size). Each token is quantised once and written to its pairs' rows
   (:func:`~vllm.kernels.triton.moe_sorted.quantise_sorted_rows`); a quantisation its producer
   made (``x_quant``) is gathered instead (:func:`~vllm.kernels.triton.moe_sorted.gather_quantised_rows`).
3. GEMM 1 (gate and up rows of w13 at once) -> bf16 [P, 2I].
4. SiLU(gate)·up quantised per group of 128 in one pass (:mod:`vllm.kernels.triton.activation`,
   the bf16 product not stored) -> e4m3 [P, I] and its scales, written group-major.
5. GEMM 2 -> bf16 [P, H].
6. Each token's local pairs gathered back, times their routing weights, summed in fp32 in slot
   order, cast to x.dtype (:func:`~vllm.kernels.triton.moe_sorted.combine_sorted`).
Rows past the local pairs' count (``offsets[E_loc]``) are never computed or read.

Rounding against :func:`~vllm.kernels.moe.experts_ref` (which keeps gate, up, the product and
each pair's output in fp32): gate and up are rounded to bf16 before SiLU, and each pair's output
to bf16 before the weighted sum; each is one bf16 rounding (relative 2^-9) next to the FP8
quantisation of x and of the product (2^-4 per element) that both share. The Triton grouped
kernel (``vllm/kernels/triton/moe_grouped_fp8.py``) keeps those in fp32; it serves decode and
short prefill batches (:data:`MIN_ROWS_PER_EXPERT`), where the CUTLASS kernel's 128-row tiles would be
mostly empty.

On CUDA the steps run as :func:`kernels_path` (Triton kernels around CUTLASS's GEMM); off CUDA
as :func:`torch_path` (torch, :func:`grouped_gemm_ref` for the GEMMs). The tests also run
:func:`kernels_path` in the Triton interpreter around the GEMM's reference.
"""

from __future__ import annotations

import torch

from vllm import _custom_ops as ops
from vllm.kernels.activation import silu_and_mul_ref
from vllm.kernels.fp8_gemm import per_token_group_quant_fp8_ref

GROUP = 128

# Rows per local expert (expected: the batch's pairs times this rank's share of the experts) from
# which fused_experts takes this path on a GPU that has it; below, the Triton grouped kernel.
# H100, bench_fp8_moe.py, 256 local experts, graph replays: 3.96 against Triton's 5.17 ms at 64
# rows an expert (2K tokens), 7.99 against 10.72 at 256 (8K); fewer rows not yet measured.
MIN_ROWS_PER_EXPERT = 64


def takes(ids: torch.Tensor, num_local_experts: int, num_experts: int | None) -> bool:
    """Whether a batch of ``ids`` [T, k] is large enough for this path (:data:`MIN_ROWS_PER_EXPERT`)."""
    return ids.numel() >= MIN_ROWS_PER_EXPERT * (num_experts or num_local_experts)


def unavailable(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> str | None:
    """None if :func:`experts_cutlass_fp8` runs the CUTLASS kernel for these tensors, else why not."""
    if not x.is_cuda:
        return "needs a CUDA device"
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        return "needs an sm_90 (Hopper) GPU"
    if not ops.has_moe_grouped_fp8_gemm():
        return ops.native_ops_error() or "vllm._C was built without CUTLASS's headers"
    h, two_i = w13.shape[2], w13.shape[1]
    if h % GROUP or two_i % (2 * GROUP):
        return f"H ({h}) and I ({two_i // 2}) must be multiples of {GROUP}"
    return None


def grouped_gemm_ref(
    a: torch.Tensor,
    sa: torch.Tensor,
    w: torch.Tensor,
    sw: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The reference of ``ops.moe_grouped_fp8_gemm``: for each group e, the rows
    r in [offsets[e], offsets[e + 1]) of out (bf16 [P, N]) get
    Σ_kb sa_e[kb, r - offsets[e]] · sw[e, kb, n // 128] · (a[r, kb block] · w[e, n, kb block]) in
    fp32, rounded once; a e4m3 [P, K]; sa fp32 [K/128 · P] group-major (group e's [K/128, m_e]
    block at K/128 · offsets[e]); w e4m3 [E, N, K] with sw fp32 [E, K/128, N/128]."""
    bounds = offsets.tolist()
    k = a.shape[1]
    g = k // GROUP
    for e in range(w.shape[0]):
        r0, r1 = bounds[e], bounds[e + 1]
        if r0 == r1:
            continue
        sae = sa[g * r0 : g * r1].view(g, r1 - r0)
        acc = torch.zeros(r1 - r0, w.shape[1], dtype=torch.float32, device=a.device)
        swe = sw[e].float().repeat_interleave(GROUP, 1)  # [K/128, N]
        for kb in range(g):
            cols = slice(kb * GROUP, (kb + 1) * GROUP)
            part = a[r0:r1, cols].float() @ w[e, :, cols].float().t()
            acc += part * sae[kb, :, None] * swe[kb][None, :]
        out[r0:r1] = acc.to(out.dtype)


def group_major_ref(s: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """s fp32 [G, P] (sorted rows' scales) -> [G · P] group-major: group e's [G, m_e] block at
    G · offsets[e]; rows past offsets[-1] left zero."""
    g, p = s.shape
    out = torch.zeros(g * p, dtype=torch.float32, device=s.device)
    bounds = offsets.tolist()
    for e in range(len(bounds) - 1):
        r0, r1 = bounds[e], bounds[e + 1]
        out[g * r0 : g * r1] = s[:, r0:r1].reshape(-1)
    return out


def sort_pairs(
    ids: torch.Tensor, expert_offset: int, e_loc: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (order int64 [P]: pairs sorted by local expert, stably, other ranks' last;
    pos int64 [P]: pair -> its sorted row; offsets int32 [E_loc + 1]: expert e's rows are
    [offsets[e], offsets[e + 1]); grp int64 [P]: each sorted row's expert, E_loc for other
    ranks'). Sync-free. On CUDA a counting sort in three Triton launches
    (:func:`vllm.kernels.triton.moe_sort.sort_pairs`, up to its ``SORT_MAX_BINS - 2`` local
    experts), else :func:`sort_pairs_ref`."""
    if ids.is_cuda:
        from vllm.kernels.triton import moe_sort

        if e_loc + 2 <= moe_sort.SORT_MAX_BINS:
            return moe_sort.sort_pairs(ids, expert_offset, e_loc)
    return sort_pairs_ref(ids, expert_offset, e_loc)


def sort_pairs_ref(
    ids: torch.Tensor, expert_offset: int, e_loc: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sort_pairs` in torch: a stable sort of the keys, the counts by scatter_add."""
    local = ids.reshape(-1).long() - expert_offset
    key = torch.where((local >= 0) & (local < e_loc), local, e_loc)
    grp, order = torch.sort(key, stable=True)
    p = key.numel()
    pos = torch.empty_like(order)
    pos[order] = torch.arange(p, device=ids.device)
    counts = torch.zeros(e_loc + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offsets = torch.zeros(e_loc + 1, dtype=torch.int32, device=ids.device)
    offsets[1:] = torch.cumsum(counts[:e_loc], 0)
    return order, pos, offsets, grp


def experts_cutlass_fp8(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert_offset: int,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    x_quant: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`experts_ref`'s FP8 result by the steps of the module docstring (the caller checks
    the weights: ``moe._check_fp8``). H and I multiples of 128. ``x_quant``: x's per-token-group
    quantisation ([T, H] e4m3, [T, H/128] scales, any strides) when its producer made it."""
    t, h = x.shape
    e_loc, inter = w13.shape[0], w13.shape[1] // 2
    top_k = ids.shape[1]
    p = t * top_k
    if p == 0 or e_loc == 0:
        return torch.zeros_like(x)
    if h % GROUP or inter % GROUP:
        raise ValueError(f"H ({h}) and I ({inter}) must be multiples of {GROUP}")
    # the weights' block scales with the K blocks first, as the kernel reads them (no copy when
    # they are stored so: the model's Experts.process_weights_after_loading)
    sw13 = w13_scale.transpose(1, 2).contiguous()
    sw2 = w2_scale.transpose(1, 2).contiguous()
    args = (x, w13, w2, ids, weights, expert_offset, sw13, sw2, x_quant)
    if x.is_cuda:
        return kernels_path(*args, gemm=ops.moe_grouped_fp8_gemm)
    return torch_path(*args)


def kernels_path(x, w13, w2, ids, weights, expert_offset, sw13, sw2, x_quant, gemm):
    """Steps 1-6 by the Triton kernels (``vllm/kernels/triton/moe_sort.py``, ``moe_sorted.py``,
    ``activation.py``) around ``gemm`` (``ops.moe_grouped_fp8_gemm``; its reference
    :func:`grouped_gemm_ref` when the tests run the kernels in the interpreter). ``sw13`` /
    ``sw2``: the weights' block scales [E, K/128, N/128] contiguous."""
    from vllm.kernels.triton import activation, moe_sort, moe_sorted

    t, h = x.shape
    e_loc, inter = w13.shape[0], w13.shape[1] // 2
    top_k = ids.shape[1]
    p = t * top_k
    sort = moe_sort.sort_pairs if e_loc + 2 <= moe_sort.SORT_MAX_BINS else sort_pairs_ref
    order, pos, offsets, grp = sort(ids, expert_offset, e_loc)
    n_local = offsets[e_loc:]  # [1] int32 on the device
    if x_quant is None:  # each token quantised once, into its pairs' sorted rows
        a, sa = moe_sorted.quantise_sorted_rows(x, pos, grp, offsets, n_local)
    else:
        a, sa = moe_sorted.gather_quantised_rows(*x_quant, order // top_k, grp, offsets, n_local)
    gu = torch.empty(p, 2 * inter, dtype=torch.bfloat16, device=x.device)
    gemm(a, sa, w13, sw13, offsets, gu)
    _, hq, hs = activation.silu_and_mul_quant(
        gu, GROUP, store_h=False, n_rows=n_local, groups=(grp, offsets)
    )
    d = torch.empty(p, h, dtype=torch.bfloat16, device=x.device)
    gemm(hq, hs, w2, sw2, offsets, d)
    return moe_sorted.combine_sorted(d, pos, ids, weights, expert_offset, e_loc, x.dtype)


def torch_path(x, w13, w2, ids, weights, expert_offset, sw13, sw2, x_quant):
    """The same steps in torch, with :func:`grouped_gemm_ref` for the GEMMs (CPU)."""
    t, h = x.shape
    e_loc, inter = w13.shape[0], w13.shape[1] // 2
    top_k = ids.shape[1]
    p = t * top_k
    order, pos, offsets, grp = sort_pairs_ref(ids, expert_offset, e_loc)
    xq, sx = x_quant if x_quant is not None else per_token_group_quant_fp8_ref(x, GROUP)
    src = order // top_k
    a, sa = xq[src], group_major_ref(sx[src].t(), offsets)
    gu = torch.empty(p, 2 * inter, dtype=torch.bfloat16, device=x.device)
    grouped_gemm_ref(a, sa, w13, sw13, offsets, gu)
    hq, hs = per_token_group_quant_fp8_ref(silu_and_mul_ref(gu.float()).to(gu.dtype), GROUP)
    d = torch.empty(p, h, dtype=torch.bfloat16, device=x.device)
    grouped_gemm_ref(hq, group_major_ref(hs.t(), offsets), w2, sw2, offsets, d)
    return combine_sorted_ref(d, pos, ids, weights, expert_offset, e_loc, x.dtype)


def combine_sorted_ref(
    d: torch.Tensor,
    pos: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert_offset: int,
    e_loc: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The reference of :func:`vllm.kernels.triton.moe_sorted.combine_sorted`."""
    t, top_k = ids.shape
    y = torch.zeros(t, d.shape[1], dtype=torch.float32, device=d.device)
    local = ids.long() - expert_offset
    for j in range(top_k):
        ok = (local[:, j] >= 0) & (local[:, j] < e_loc)
        rows = pos.view(t, top_k)[:, j]
        contrib = weights[:, j, None].float() * d[rows].float()
        y += torch.where(ok[:, None], contrib, 0.0)
    return y.to(dtype)


__all__ = [
    "MIN_ROWS_PER_EXPERT",
    "combine_sorted_ref",
    "experts_cutlass_fp8",
    "group_major_ref",
    "grouped_gemm_ref",
    "kernels_path",
    "sort_pairs",
    "sort_pairs_ref",
    "takes",
    "torch_path",
    "unavailable",
]
