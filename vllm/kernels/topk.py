"""Exact top-k selection over indexer logits: sampled pre-filter, radix select, sort of the winners.

One program per row. Scores become order-preserving int32 keys (−0.0 folded onto +0.0, positions
at or past the row's limit below every score). Then:

  1. pivot (``SAMPLED``): SAMPLE evenly strided keys of the eligible prefix; a 16-step bisection
     on the top key bits finds a value whose sample rank sits a few standard deviations past k,
     so that about 1.5·k elements of the row are at or above it;
  2. one pass over the row compacts the positions at or above the pivot (in position order) into
     a per-row scratch list of CAP entries. If fewer than k or more than CAP land there (a bad
     sample, ~0.1–2 % of random rows), the row falls back to working on the whole row;
  3. radix select on the candidates (four 8-bit histogram passes) finds the exact k-th key and
     how many of its ties to keep — the lowest positions, as the stable reference sort keeps;
  4. a compaction pass writes each winner as one int64 key (score descending, position
     ascending); ``torch.sort`` of those [T, k] keys after the kernel (a segmented radix sort,
     far cheaper than Triton's in-program bitonic ``tl.sort``) makes the output equal
     :func:`topk_ref` exactly, −1 padded.

HBM traffic: the row once (sample and compaction; the candidates and the final gathers hit L2).
Per-element work on the full row is a key, a compare and a prefix sum; the histogram passes (Triton
lowers ``tl.histogram`` to warp ballots, ~50 instructions per element at 256 bins) only see the
~1.5·k candidates. Rows are independent: a single 1M-candidate row runs on one SM.
NaN scores are not supported (a NaN's key sorts above +inf or below −inf by its sign bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.attention.ops.indexer import topk_ref
from vllm.kernels.triton_utils import check_cuda_or_interpreter, next_pow2, record

__all__ = ["indexer_topk", "topk_ref", "topk_cost"]


@triton.jit
def _keys(logit_row_ptr, pos, mask):
    """Signed int32 keys with the float order; masked-off positions get INT32_MIN."""
    x = tl.load(logit_row_ptr + pos, mask=mask, other=0.0)
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x == 0.0, 0, bits)  # −0.0 ties with +0.0, as in the reference sort
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(mask, key, -2147483648)


@triton.jit
def _sample_pivot(lrow, limit, n, SAMPLE: tl.constexpr):
    """A key with about n·(1 + 3/√r) elements of the row at or above it (r = n·SAMPLE/limit)."""
    si = tl.arange(0, SAMPLE)
    spos = ((si.to(tl.int64) * limit) // SAMPLE).to(tl.int32)
    skey = _keys(lrow, spos, spos < limit)  # [SAMPLE]
    r = (n.to(tl.int64) * SAMPLE // limit).to(tl.int32)
    rank = r + (3.0 * tl.sqrt((r + 1).to(tl.float32))).to(tl.int32) + 4
    rank = tl.minimum(rank, SAMPLE - 1)
    # bisection over the top 16 unsigned key bits, MSB first: the largest such u with
    # #{sample >= u} > rank (a pivot needs no more resolution: 2^-7 relative in the score)
    u = tl.zeros((), tl.int32)
    for b in tl.static_range(16):
        if b == 0:
            cand = u | -2147483648
        else:
            cand = u | (1 << (31 - b))
        cnt = tl.sum((skey >= (cand ^ -2147483648)).to(tl.int32))
        u = tl.where(cnt > rank, cand, u)
    return u ^ -2147483648


@triton.jit
def _item_keys(lrow, srow, c0, offs, src_len, limit, from_list):
    """Positions and keys of items [c0, c0 + CHUNK): candidate-list entries or row positions."""
    idx = c0 + offs
    valid = idx < src_len
    listed = tl.load(srow + idx, mask=valid & from_list, other=0)
    pos = tl.where(from_list, listed, idx)
    mask = valid & (pos < limit)
    return pos, mask, _keys(lrow, pos, mask)


@triton.jit
def _topk_kernel(
    logits_ptr,  # [T, S] fp32, strides (stride_lt, 1)
    limit_ptr,  # [T] int, positions < limit are eligible
    keys_ptr,  # [T, TOPK_PAD] int64 composite sort keys of the winners, then padding
    scratch_ptr,  # [T, CAP] int32 candidate positions
    num_cols,
    stride_lt,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,  # next power of two >= TOPK
    CHUNK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    SAMPLED: tl.constexpr,
    SAMPLE: tl.constexpr,
    CAP: tl.constexpr,
):
    NUM_BINS: tl.constexpr = 1 << RADIX_BITS
    NUM_PASSES: tl.constexpr = 32 // RADIX_BITS
    row = tl.program_id(0).to(tl.int64)
    lrow = logits_ptr + row * stride_lt
    krow = keys_ptr + row * TOPK_PAD
    srow = scratch_ptr + row * CAP
    limit = tl.minimum(tl.maximum(tl.load(limit_ptr + row).to(tl.int32), 0), num_cols)
    n = tl.minimum(limit, TOPK)  # how many positions this row selects
    bins = tl.arange(0, NUM_BINS)
    offs = tl.arange(0, CHUNK)

    # ---- 1-2. sampled pivot, candidates compacted in position order ---------------------------
    count = tl.zeros((), tl.int32)
    if SAMPLED:
        if limit > TOPK:
            pivot = _sample_pivot(lrow, limit, n, SAMPLE)
            for c0 in range(0, limit, CHUNK):
                pos = c0 + offs
                key = _keys(lrow, pos, pos < limit)
                sel = (pos < limit) & (key >= pivot)
                sel_i = sel.to(tl.int32)
                dst = count + tl.cumsum(sel_i, 0) - 1
                tl.store(srow + dst, pos, mask=sel & (dst < CAP))
                count += tl.sum(sel_i)
    from_list = (count >= n) & (count <= CAP) & (limit > TOPK)
    src_len = tl.where(from_list, count, limit)
    tl.debug_barrier()  # the candidate list written above is read back by other threads

    # ---- 3. radix select: the n-th largest key `prefix` and how many of its ties to keep -------
    prefix = tl.zeros((), tl.int32)  # unsigned key bits decided so far (key ^ INT32_MIN)
    need = n
    for p in tl.static_range(NUM_PASSES):
        shift = 32 - RADIX_BITS * (p + 1)  # compile-time: p is a static_range index
        hist = tl.zeros((NUM_BINS,), tl.int32)
        if limit > TOPK:
            for c0 in range(0, src_len, CHUNK):
                pos, mask, key = _item_keys(lrow, srow, c0, offs, src_len, limit, from_list)
                u = key ^ -2147483648  # unsigned order as int32 bits
                digit = (u >> shift) & (NUM_BINS - 1)
                if p == 0:
                    match = mask
                else:
                    high = (1 << (32 - shift - RADIX_BITS)) - 1
                    match = mask & (((u >> (shift + RADIX_BITS)) & high) == prefix)
                hist += tl.histogram(digit, NUM_BINS, mask=match)
        # largest bin whose suffix count reaches `need`
        above_incl = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # [NUM_BINS] count in bins >= b
        b_star = tl.sum((above_incl >= need).to(tl.int32)) - 1
        b_star = tl.maximum(b_star, 0)
        need -= tl.sum(tl.where(bins > b_star, hist, 0))
        prefix = (prefix << RADIX_BITS) | b_star

    # ---- 4. winners in position order, then sorted ---------------------------------------------
    thr = prefix ^ -2147483648  # signed key of the n-th largest
    n_sel = tl.zeros((), tl.int32)
    n_tie = tl.zeros((), tl.int32)
    for c0 in range(0, src_len, CHUNK):
        pos, mask, key = _item_keys(lrow, srow, c0, offs, src_len, limit, from_list)
        tie = mask & (key == thr)
        tie_rank = n_tie + tl.cumsum(tie.to(tl.int32), 0) - 1
        sel = mask & ((limit <= TOPK) | (key > thr) | (tie & (tie_rank < need)))
        sel_i = sel.to(tl.int32)
        dst = n_sel + tl.cumsum(sel_i, 0) - 1
        # one int64 whose ascending order is (score descending, position ascending)
        inv = 2147483647 - key.to(tl.int64)  # in [0, 2^32)
        tl.store(krow + dst, (inv << 31) | pos.to(tl.int64), mask=sel)  # < 2^63
        n_sel += tl.sum(sel_i)
        n_tie += tl.sum(tie.to(tl.int32))
    i = tl.arange(0, TOPK_PAD)  # padding sorts last; winners filled [0, n) exactly
    tl.store(krow + i, tl.full((TOPK_PAD,), 9223372036854775807, tl.int64), mask=i >= n)


def indexer_topk(
    logits: torch.Tensor,
    limit: torch.Tensor,
    topk: int,
    chunk: int = 4096,
    num_warps: int = 8,
    sampled: bool = True,
    sample: int = 4096,
    cap: int | None = None,
) -> torch.Tensor:
    """Top-k positions per row.

    logits: [T, S] fp32 (no NaN); limit: [T] int, positions >= limit[t] are not eligible (the
    causal limit); topk: k. Returns int32 [T, topk]: the min(topk, limit[t], S) eligible positions
    with the largest scores, ordered by (score descending, position ascending) — ties go to the
    lower position — then −1. Identical to :func:`topk_ref`. ``sampled``/``sample``/``cap`` tune
    the pre-filter (results never depend on them).
    """
    if logits.dim() != 2 or limit.shape != (logits.shape[0],):
        raise ValueError(f"logits {tuple(logits.shape)} must be [T, S] with limit [T]")
    check_cuda_or_interpreter(logits, limit)
    t, s = logits.shape
    if t == 0 or topk == 0:
        return torch.empty(t, topk, dtype=torch.int32, device=logits.device)
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        logits = logits.float().contiguous()
    cap = cap or 4 * next_pow2(topk)
    sampled = sampled and s > topk
    scratch = torch.empty(t if sampled else 1, cap, dtype=torch.int32, device=logits.device)
    chunk = min(chunk, max(16, next_pow2(s)))
    keys = torch.empty(t, next_pow2(topk), dtype=torch.int64, device=logits.device)
    k = _topk_kernel[(t,)](
        logits, limit.contiguous(), keys, scratch, s, logits.stride(0),
        TOPK=topk, TOPK_PAD=next_pow2(topk), CHUNK=chunk, RADIX_BITS=8,
        SAMPLED=sampled, SAMPLE=sample, CAP=cap, num_warps=num_warps,
    )  # fmt: skip
    record("topk", k)
    # Triton's tl.sort of 2048 keys per program costs more than the whole selection; torch's
    # segmented sort of the [T, k] composite keys is a few µs
    keys = torch.sort(keys, dim=1).values[:, :topk]
    return torch.where(keys == torch.iinfo(torch.int64).max, -1, keys & 0x7FFFFFFF).to(torch.int32)


def topk_cost(num_rows: int, num_cols: int, topk: int = 2048) -> tuple[int, int]:
    """(flops, bytes): no matrix work; the logits read once from HBM, the indices written."""
    return 0, num_rows * (num_cols * 4 + topk * 4 + 8)
