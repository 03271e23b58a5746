"""Exact top-k selection over indexer logits: radix select, then a sort of the k winners.

One program per row. Scores become order-preserving 32-bit keys (−0.0 folded onto +0.0, positions
at or past the row's limit below every score). Four passes of an 8-bit histogram over the
eligible prefix of the row find the exact k-th key and how many ties at it to keep (the lowest
positions, as the stable reference sort keeps); a fifth pass writes the winners' positions in
position order with a prefix-sum compaction; finally the k winners are sorted by the 64-bit key
(score descending, position ascending) so the output equals :func:`topk_ref` exactly, −1 padded.

Traffic: the row is read from HBM once; the four later passes hit L2 (a row is ≤ 4 MB and a
program re-reads only its own row). Work grows with S, not with k. Rows are independent, so a
single row of 1M candidates runs on one SM (about 20 MB of L2 reads): batch rows where it matters.
NaN scores are not supported (a NaN's key sorts above +inf or below −inf by its sign bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.attention.ops.indexer import topk_ref
from vllm.kernels.triton_utils import check_cuda_or_interpreter, next_pow2, record

__all__ = ["indexer_topk", "topk_ref", "topk_cost"]

INT32_MIN = -2147483648


@triton.jit
def _keys(logit_row_ptr, pos, limit):
    """Signed int32 keys with the float order; ineligible positions get INT32_MIN."""
    x = tl.load(logit_row_ptr + pos, mask=pos < limit, other=0.0)
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x == 0.0, 0, bits)  # −0.0 ties with +0.0, as in the reference sort
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(pos < limit, key, -2147483648)


@triton.jit
def _topk_kernel(
    logits_ptr,  # [T, S] fp32, strides (stride_lt, 1)
    limit_ptr,  # [T] int, positions < limit are eligible
    out_ptr,  # [T, TOPK] int32, contiguous
    num_cols,
    stride_lt,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,  # next power of two >= TOPK
    CHUNK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
):
    NUM_BINS: tl.constexpr = 1 << RADIX_BITS
    NUM_PASSES: tl.constexpr = 32 // RADIX_BITS
    row = tl.program_id(0).to(tl.int64)
    lrow = logits_ptr + row * stride_lt
    orow = out_ptr + row * TOPK
    limit = tl.minimum(tl.maximum(tl.load(limit_ptr + row).to(tl.int32), 0), num_cols)
    n = tl.minimum(limit, TOPK)  # how many positions this row selects
    bins = tl.arange(0, NUM_BINS)
    offs = tl.arange(0, CHUNK)

    # ---- radix select: the n-th largest key `prefix` and how many of its ties to keep ---------
    prefix = tl.zeros((), tl.int32)  # unsigned key bits decided so far (key ^ INT32_MIN)
    need = n
    for p in tl.static_range(NUM_PASSES):
        shift = 32 - RADIX_BITS * (p + 1)  # compile-time: p is a static_range index
        hist = tl.zeros((NUM_BINS,), tl.int32)
        if limit > TOPK:
            for c0 in range(0, limit, CHUNK):
                pos = c0 + offs
                u = _keys(lrow, pos, limit) ^ -2147483648  # unsigned order as int32 bits
                digit = (u >> shift) & (NUM_BINS - 1)
                if p == 0:
                    match = pos < limit
                else:
                    high = (1 << (32 - shift - RADIX_BITS)) - 1
                    match = (pos < limit) & (((u >> (shift + RADIX_BITS)) & high) == prefix)
                hist += tl.histogram(digit, NUM_BINS, mask=match)
        # largest bin whose suffix count reaches `need`
        above_incl = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # [NUM_BINS] count in bins >= b
        b_star = tl.sum((above_incl >= need).to(tl.int32)) - 1
        b_star = tl.maximum(b_star, 0)
        need -= tl.sum(tl.where(bins > b_star, hist, 0))
        prefix = (prefix << RADIX_BITS) | b_star

    # ---- compaction: winners in position order ------------------------------------------------
    thr = prefix ^ -2147483648  # signed key of the n-th largest
    n_sel = tl.zeros((), tl.int32)
    n_tie = tl.zeros((), tl.int32)
    for c0 in range(0, limit, CHUNK):
        pos = c0 + offs
        key = _keys(lrow, pos, limit)
        eligible = pos < limit
        tie = eligible & (key == thr)
        tie_rank = n_tie + tl.cumsum(tie.to(tl.int32), 0) - 1
        sel = eligible & ((limit <= TOPK) | (key > thr) | (tie & (tie_rank < need)))
        sel_i = sel.to(tl.int32)
        dst = n_sel + tl.cumsum(sel_i, 0) - 1
        tl.store(orow + dst, pos, mask=sel)
        n_sel += tl.sum(sel_i)
        n_tie += tl.sum(tie.to(tl.int32))
    tl.debug_barrier()  # the winners written above are read back by other threads

    # ---- order the winners: score descending, position ascending ------------------------------
    i = tl.arange(0, TOPK_PAD)
    have = i < n
    pos = tl.load(orow + i, mask=have, other=0)
    key = _keys(lrow, pos, limit)
    inv = 2147483647 - key.to(tl.int64)  # in [0, 2^32): ascending = score descending
    key64 = tl.where(have, (inv << 31) | pos.to(tl.int64), 9223372036854775807)  # < 2^63
    key64 = tl.sort(key64, 0)
    tl.debug_barrier()
    res = tl.where(have, (key64 & 2147483647).to(tl.int32), -1)  # low 31 bits: the position
    tl.store(orow + i, res, mask=i < TOPK)


def indexer_topk(
    logits: torch.Tensor, limit: torch.Tensor, topk: int, chunk: int = 4096, num_warps: int = 8
) -> torch.Tensor:
    """Top-k positions per row.

    logits: [T, S] fp32 (no NaN); limit: [T] int, positions >= limit[t] are not eligible (the
    causal limit); topk: k. Returns int32 [T, topk]: the min(topk, limit[t], S) eligible positions
    with the largest scores, ordered by (score descending, position ascending) — ties go to the
    lower position — then −1. Identical to :func:`topk_ref`.
    """
    if logits.dim() != 2 or limit.shape != (logits.shape[0],):
        raise ValueError(f"logits {tuple(logits.shape)} must be [T, S] with limit [T]")
    check_cuda_or_interpreter(logits, limit)
    t, s = logits.shape
    out = torch.empty(t, topk, dtype=torch.int32, device=logits.device)
    if t == 0 or topk == 0:
        return out
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        logits = logits.float().contiguous()
    chunk = min(chunk, max(16, next_pow2(s)))
    k = _topk_kernel[(t,)](
        logits, limit.contiguous(), out, s, logits.stride(0),
        TOPK=topk, TOPK_PAD=next_pow2(topk), CHUNK=chunk, RADIX_BITS=8, num_warps=num_warps,
    )  # fmt: skip
    record("topk", k)
    return out


def topk_cost(num_rows: int, num_cols: int, topk: int = 2048) -> tuple[int, int]:
    """(flops, bytes): no matrix work; the logits read once from HBM, the indices written."""
    return 0, num_rows * (num_cols * 4 + topk * 4 + 8)
