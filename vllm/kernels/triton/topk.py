"""Exact top-k selection over indexer logits in Triton (spec: :mod:`vllm.kernels.indexer`): sampled pivot, one streaming pass, small select.

Scores are compared as order-preserving int32 keys (−0.0 folded onto +0.0; positions at or past
the row's limit below every score). Four launches:

  1. pivot, one program per row: a jittered, stratified sample of the eligible scores in runs
     of RUN (8) adjacent ones — a run is one 32-byte sector, so the sample costs an eighth of
     the sectors one score per sector would — one score per SAMPLE_STRIDE columns in all, and a
     search (:func:`_kth_largest`) give a key whose sample rank is about e + Z·σ (e = k·m/limit,
     the sample count expected above the true k-th score), so that about k + Z·√(k·stride)
     eligible scores of the row are at or above it — at least k and at most CAP (4·k) except with
     probability ~3e-7 per row (Z = 5). σ² is the binomial e(1 − e/m) when the runs' counts above
     the pivot vary no more than independent samples' would; adjacent scores that correlate make
     them vary more, and when that design effect (their variance over the binomial one) exceeds
     1.5 the search runs again with σ² times it. Rows with limit <= k are answered here
     (0..limit−1, then −1).
  2. collect, one program per CHUNK of a group of up to 32 rows (many programs per row: 64 rows
     of 128K or 1M candidates fill the GPU), the group's rows one after the other: the scores at
     or above the pivot are appended to the row's candidate list (position << 32 | score bits) at
     an offset that is the sum of the candidate counts of the row's earlier chunks (decoupled
     look-back: a program publishes its count, then waits until every earlier chunk of the row
     has; those belong to programs with lower ids, which start first and never wait for later
     ones). The list is thus deterministic; within a chunk it is in thread-major order, so the
     compaction scan is in-thread but for one scan across threads.
  3. select, one program per row: the exact k-th largest candidate key `thr` by the same search
     (~10 probes for continuous scores; it stops once exactly k keys are >= the probe) over 4096
     keys held in registers and the rest (~200) re-read from L1; a bisection for the position cut
     among the ties at `thr` (only when some ties lose); then one scan over the list writes the
     winners.
  4. fallback, one program per row, for rows whose candidate count fell outside [k, CAP] (a bad
     sample, or masses of tied scores): a four-pass 8-bit radix select over the whole row. Exact,
     slow, rare.

HBM traffic: the eligible logits once, plus the sample (a 32-byte sector per run of 8 sampled
scores, one score in 32) and the candidate lists (~2·k · 8 bytes per row written and read;
T·CAP·8 bytes allocated). The order of the positions within an output row is unspecified
(deterministic for one configuration); −1 padding comes last. NaN scores are not supported (a NaN's key sorts above +inf or below −inf).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.triton.utils import check_cuda_or_interpreter, next_pow2, prev_pow2, record

__all__ = [
    "indexer_topk",
    "topk_stages",
    "topk_launches",
    "topk_launch_config",
    "topk_compile_plan",
]

INT32_MIN = -2147483648
MAX_SAMPLE = 16384  # pivot sample held in registers (16 warps × 32 per thread)
# the pivot's margin is widened when the sampled runs' design effect exceeds this (see the top)
DEFF_REDO = 1.5
# The sizes that change with every call (rows, columns, chunks) are not specialised on (Triton
# would compile a kernel per class: == 1, a multiple of 16, other), so that the compiled variants
# depend only on the constexprs, which change at powers of two of the columns: a server compiles
# them all at start-up (:func:`topk_compile_plan`), and none inside a request. The logits' row
# stride stays specialised: the logits producers pad it to a multiple of 16.
NOT_SPECIALIZED = ("num_rows", "num_cols", "num_chunks")


@triton.jit
def _key_of(bits):
    """int32 float bits -> signed int32 key with the float order (−0.0 folded onto +0.0)."""
    bits = tl.where(bits == -2147483648, 0, bits)  # −0.0 ties with +0.0, as in the reference sort
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _keys(logit_row_ptr, pos, mask):
    """Keys of the scores at ``pos``; masked-off positions get INT32_MIN (below every score)."""
    x = tl.load(logit_row_ptr + pos, mask=mask, other=0.0)
    return tl.where(mask, _key_of(x.to(tl.int32, bitcast=True)), -2147483648)


@triton.jit
def _probe(lo, hi, e_lo, e_hi, k, interp):
    """The next probe in (lo, hi), given #{keys >= lo} >= k > #{keys >= hi}: where the count
    would reach k if it fell linearly from e_lo at lo to e_hi at hi (e_lo >= k > e_hi: the counts
    there, Illinois-weighted by :func:`_search_step`), or the midpoint (``interp`` 0)."""
    # in fp32 with a fast division (an int64 one is a long software routine, run once per probe
    # by every thread): the probe only has to land in (lo, hi), the clamp sees to that
    frac = tl.fdiv((2 * (e_lo - k) + 1).to(tl.float32), (2 * (e_lo - e_hi)).to(tl.float32))
    g = lo + ((hi - lo).to(tl.float32) * frac).to(tl.int64)
    g = tl.minimum(tl.maximum(g, lo + 1), hi - 1)
    return tl.where(interp != 0, g, (lo + hi) >> 1)


@triton.jit
def _search_step(mid, c, k, lo, hi, cnt, e_lo, e_hi, side):
    """Update the bracket with probe ``mid`` (count c). Illinois rule: when the same end is kept
    twice in a row, its interpolation count is pulled halfway to k (keeps e_lo >= k > e_hi).
    Returns (lo, hi, cnt, e_lo, e_hi, side, interp): the next probe bisects when this one did not
    halve the bracket, so the search takes at most twice the bisection's steps."""
    w = hi - lo
    up = c >= k
    lo = tl.where(up, mid, lo)
    cnt = tl.where(up, c, cnt)
    hi = tl.where(up, hi, mid)
    e_lo = tl.where(up, c, tl.where(side < 0, (e_lo + k + 1) // 2, e_lo))
    e_hi = tl.where(up, tl.where(side > 0, (e_hi + k) // 2, e_hi), c)
    side = tl.where(up, 1, -1)
    return lo, hi, cnt, e_lo, e_hi, side, ((hi - lo) * 2 <= w).to(tl.int32)


@triton.jit
def _kth_largest(key, k, lo):
    """The largest int32 u with #{keys >= u} >= k, given #{keys >= lo} >= k >= 1 (INT32_MIN =
    no key). Search on [lo, max key] by interpolation probes (Illinois-weighted, with bisection
    steps as a guard: :func:`_search_step`); it stops once exactly k keys are >= u (selecting
    the keys >= u, ties included, is then the answer): ~10 probes for i.i.d. normal scores where
    bisection takes ~13, at most twice the bisection's ~32 for mass ties."""
    hi = tl.max(key).to(tl.int64) + 1  # #{keys >= hi} = 0 < k
    cnt = tl.sum((key >= lo).to(tl.int32))
    e_lo = cnt
    e_hi = tl.zeros((), tl.int32)
    side = tl.zeros((), tl.int32)
    lo = lo.to(tl.int64)
    interp = tl.full((), 1, tl.int32)
    while (hi - lo > 1) & (cnt != k):
        mid = _probe(lo, hi, e_lo, e_hi, k, interp)  # in (lo, hi), so > INT32_MIN: no padding
        c = tl.sum((key >= mid.to(tl.int32)).to(tl.int32))
        lo, hi, cnt, e_lo, e_hi, side, interp = _search_step(mid, c, k, lo, hi, cnt, e_lo, e_hi,
                                                             side)  # fmt: skip
    return lo.to(tl.int32)


@triton.jit
def _emit(orow, key, pos, valid, thr, need, n_gt, n_tie):
    """Write the winners of one position-ordered block: keys > thr, and ties (key == thr) while
    fewer than ``need`` ties were seen before. Returns the running (n_gt, n_tie)."""
    gt = valid & (key > thr)
    tie = valid & (key == thr)
    packed = gt.to(tl.int32) + (tie.to(tl.int32) << 16)  # one scan for both (blocks < 2^16)
    before = tl.cumsum(packed, 0) - packed
    gt_before = n_gt + (before & 0xFFFF)
    tie_before = n_tie + (before >> 16)
    sel = gt | (tie & (tie_before < need))
    tl.store(orow + gt_before + tl.minimum(tie_before, need), pos, mask=sel)
    return n_gt + tl.sum(gt.to(tl.int32)), n_tie + tl.sum(tie.to(tl.int32))


@triton.jit(do_not_specialize=NOT_SPECIALIZED)
def _pivot_kernel(
    logits_ptr,  # [T, S] fp32, strides (stride_lt, 1)
    limit_ptr,  # [T] int, positions < limit are eligible
    out_ptr,  # [T, TOPK] int32; rows with limit <= TOPK are written here
    pivot_ptr,  # [T] int32 key: candidates are the eligible keys >= pivot
    tab_ptr,  # [T, num_chunks] int32 per-chunk candidate counts + 1, zeroed here
    num_cols,
    num_chunks,
    stride_lt,
    z,  # fp32 margin in standard deviations of the sample count
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    CAP: tl.constexpr,
    SAMPLE_STRIDE: tl.constexpr,
    SAMPLE_PAD: tl.constexpr,
    NUM_CHUNKS_PAD: tl.constexpr,
    RUN: tl.constexpr,  # adjacent scores per sampled run
    DEFF_REDO: tl.constexpr = 1.5,  # design effect above which the margin is widened
):
    row = tl.program_id(0).to(tl.int64)
    limit = tl.minimum(tl.maximum(tl.load(limit_ptr + row).to(tl.int32), 0), num_cols)
    c = tl.arange(0, NUM_CHUNKS_PAD)
    tl.store(tab_ptr + row * num_chunks + c, tl.zeros_like(c), mask=c < num_chunks)
    if limit <= TOPK:  # everything eligible is selected
        i = tl.arange(0, TOPK_PAD)
        tl.store(out_ptr + row * TOPK + i, tl.where(i < limit, i, -1), mask=i < TOPK)
    elif limit <= CAP:  # the whole row fits in the candidate list
        tl.store(pivot_ptr + row, -2147483648)
    else:
        # runs of RUN adjacent scores (one 32-byte sector for RUN = 8), one per stratum of
        # RUN · SAMPLE_STRIDE columns at a jittered, RUN-aligned start
        RUNS: tl.constexpr = SAMPLE_PAD // RUN
        nr = tl.minimum(tl.cdiv(limit, SAMPLE_STRIDE * RUN), RUNS)
        j = tl.arange(0, RUNS)
        jitter = ((j * -1640531535) >> 20) & 1023  # Fibonacci hash: no aliasing with periodic rows
        span = (limit - RUN).to(tl.int64)  # limit > CAP >= RUN here
        start = (((j.to(tl.int64) * 1024 + jitter) * span) // (nr.to(tl.int64) * 1024)).to(tl.int32)
        spos = (start // RUN * RUN)[:, None] + tl.arange(0, RUN)[None, :]
        run_ok = j < nr
        skey = _keys(logits_ptr + row * stride_lt, spos, run_ok[:, None] & (spos < limit))
        m = nr * RUN
        e = (TOPK * m).to(tl.float32) / limit.to(tl.float32)
        var = e * (1.0 - e / m.to(tl.float32))  # binomial: independent samples
        lo = tl.full((), -2147483648, tl.int32)
        r = tl.minimum(tl.maximum((e + z * tl.sqrt(var)).to(tl.int32) + 1, 1), m)
        piv = _kth_largest(skey, r, lo)
        if RUN > 1:
            # adjacent scores may be correlated: the design effect (the runs' variance of their
            # counts above the pivot over the binomial one; the cluster-sampling estimator),
            # and when it is large the search again with the margin widened by its root
            h = tl.where(run_ok, tl.sum((skey >= piv).to(tl.float32), axis=1), 0.0)
            nrf = nr.to(tl.float32)
            hits = tl.sum(h)
            dev = tl.where(run_ok, h - hits / nrf, 0.0)
            var_c = tl.sum(dev * dev) * nrf / tl.maximum(nrf - 1.0, 1.0)
            deff = var_c / tl.maximum(hits * (1.0 - hits / m.to(tl.float32)), 1.0)
            if deff > DEFF_REDO:
                r = tl.minimum(tl.maximum((e + z * tl.sqrt(var * deff)).to(tl.int32) + 1, 1), m)
                piv = _kth_largest(skey, r, lo)
        tl.store(pivot_ptr + row, piv)


@triton.jit(do_not_specialize=NOT_SPECIALIZED)
def _collect_kernel(
    logits_ptr,  # [T, S] fp32, strides (stride_lt, 1)
    limit_ptr,  # [T] int
    pivot_ptr,  # [T] int32
    tab_ptr,  # [T, num_chunks] int32: each chunk's candidate count + 1 once known, else 0
    count_ptr,  # [T] int32: the row's candidate count (may exceed CAP)
    list_ptr,  # [T, CAP] int64 candidates: position << 32 | fp32 score bits
    num_rows,
    num_cols,
    num_chunks,
    stride_lt,
    TOPK: tl.constexpr,
    CAP: tl.constexpr,
    CHUNK: tl.constexpr,
    THREADS: tl.constexpr,  # 32 · num_warps: one row of the [THREADS, CHUNK / THREADS] tile each
    ROWS: tl.constexpr,  # rows per program, one after the other (same chunk of each)
    NUM_CHUNKS_PAD: tl.constexpr,
    PREFETCH: tl.constexpr,  # load the next row's chunk while this one is compacted
):
    pid = tl.program_id(0)
    c = pid % num_chunks
    row0 = (pid // num_chunks) * ROWS
    # [THREADS, R] tile, element (t, r) at c·CHUNK + r·THREADS + t: each warp load reads 128
    # contiguous bytes and row t lies in thread t. No vector loads: the scatter below is scalar,
    # and one layout for both saves a shared-memory transpose (with no contiguity, Triton puts
    # the lanes along axis 0)
    t = tl.arange(0, THREADS)[:, None]
    pos = c * CHUNK + tl.arange(0, CHUNK // THREADS)[None, :] * THREADS + t
    lpos = tl.max_contiguous(pos, [1, 1])
    end = tl.minimum(num_rows, row0 + ROWS)
    if not PREFETCH:  # fewer registers live: more programs per SM instead
        for i in range(ROWS):
            row = row0 + i
            lim = _limit(limit_ptr, row, end, num_cols)
            if (lim > TOPK) & (c * CHUNK < lim):
                piv = tl.load(pivot_ptr + row)
                x = tl.load(logits_ptr + row.to(tl.int64) * stride_lt + lpos, mask=pos < lim)
                _collect_chunk(x, pos, lim, piv, tab_ptr + row.to(tl.int64) * num_chunks, c,
                               count_ptr + row, list_ptr + row.to(tl.int64) * CAP, CAP, CHUNK,
                               NUM_CHUNKS_PAD)  # fmt: skip
        return
    lim = _limit(limit_ptr, row0, end, num_cols)
    lim1 = _limit(limit_ptr, row0 + 1, end, num_cols)
    piv = tl.load(pivot_ptr + row0, mask=row0 < end, other=0)
    x = tl.load(logits_ptr + row0.to(tl.int64) * stride_lt + lpos, mask=(pos < lim) & (lim > TOPK))
    for i in range(ROWS):
        row = row0 + i
        # the next row's chunk is loaded while this one is compacted (its look-back waits hide);
        # limits are read two rows ahead so that this load need not wait for one
        lim2 = _limit(limit_ptr, row + 2, end, num_cols)
        npiv = tl.load(pivot_ptr + row + 1, mask=row + 1 < end, other=0)
        nmask = (pos < lim1) & (lim1 > TOPK)
        nx = tl.load(logits_ptr + (row + 1).to(tl.int64) * stride_lt + lpos, mask=nmask)
        if (lim > TOPK) & (c * CHUNK < lim):
            _collect_chunk(x, pos, lim, piv, tab_ptr + row.to(tl.int64) * num_chunks, c,
                           count_ptr + row, list_ptr + row.to(tl.int64) * CAP, CAP, CHUNK,
                           NUM_CHUNKS_PAD)  # fmt: skip
        x = nx
        lim = lim1
        lim1 = lim2
        piv = npiv


@triton.jit
def _limit(limit_ptr, row, num_rows, num_cols):
    """The row's limit clamped to [0, num_cols]; 0 for rows >= num_rows."""
    lim = tl.load(limit_ptr + row, mask=row < num_rows, other=0).to(tl.int32)
    return tl.minimum(tl.maximum(lim, 0), num_cols)


@triton.jit
def _collect_chunk(x, pos, limit, pivot, trow, c, count_ptr, lrow, CAP: tl.constexpr,
                   CHUNK: tl.constexpr, NUM_CHUNKS_PAD: tl.constexpr):  # fmt: skip
    """Append chunk c's scores >= pivot to the row's list after those of chunks 0..c−1."""
    # key >= pivot as a float compare (the key order is the float order, −0.0 == +0.0)
    pbits = tl.where(pivot < 0, pivot ^ 0x7FFFFFFF, pivot)
    pivot_f = tl.where(pivot <= -2139095041, float("-inf"), pbits.to(tl.float32, bitcast=True))
    sel = (pos < limit) & (x >= pivot_f)
    sel_i = sel.to(tl.int32)
    per_thread = tl.sum(sel_i, axis=1)  # [THREADS], in-thread sums
    cnt = tl.sum(per_thread)
    tl.store(trow + c, cnt + 1)
    # offset = candidates of the chunks before (decoupled look-back over all of them); they
    # belong to programs with lower ids, started before this one, which never wait for it
    prev = tl.arange(0, NUM_CHUNKS_PAD)
    pm = prev < c
    v = tl.load(trow + prev, mask=pm, other=1, volatile=True)
    while tl.min(v) == 0:
        v = tl.load(trow + prev, mask=pm, other=1, volatile=True)
    base = tl.sum(v - 1)
    if (c + 1) * CHUNK >= limit:
        tl.store(count_ptr, base + cnt)
    # list order within the chunk is thread-major (t, then r): one scan across threads, the rest
    # in-thread; the select resolves ties by position, not by list order
    dst = base + (tl.cumsum(per_thread, 0) - per_thread)[:, None]
    dst += tl.cumsum(sel_i, axis=1) - sel_i
    item = (pos.to(tl.int64) << 32) | (x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
    tl.store(lrow + dst, item, mask=sel & (dst < CAP))


@triton.jit
def _list_keys(lrow, j, valid):
    """Keys of list entries j (INT32_MIN where not valid): the low words of the row's int64
    entries (position << 32 | score bits), loaded whole so that a warp reads whole sectors."""
    e = tl.load(lrow + j, mask=valid, other=0)
    return tl.where(valid, _key_of(e.to(tl.int32)), -2147483648)


@triton.jit
def _count_ge_list(ka, u, lrow, jt, total, BLK: tl.constexpr, TILE: tl.constexpr):
    """#{candidate keys >= u}: entries [0, BLK) held in registers (ka), the rest (usually a
    few hundred, L1-resident) read again in [THREADS, SUB] tiles."""
    c = tl.sum((ka >= u).to(tl.int32), axis=1)  # [THREADS]
    for b0 in range(BLK, total, TILE):
        kt = _list_keys(lrow, b0 + jt, b0 + jt < total)
        c += tl.sum((kt >= u).to(tl.int32), axis=1)
    return tl.sum(c)


@triton.jit
def _max_list(ka, lrow, jt, total, BLK: tl.constexpr, TILE: tl.constexpr):
    m = tl.max(ka, axis=1)
    for b0 in range(BLK, total, TILE):
        m = tl.maximum(m, tl.max(_list_keys(lrow, b0 + jt, b0 + jt < total), axis=1))
    return tl.max(m)


@triton.jit
def _kth_largest_list(ka, lrow, jt, total, k, lo, BLK: tl.constexpr, TILE: tl.constexpr):
    """:func:`_kth_largest` over the row's `total` candidates (``_count_ge_list``)."""
    hi = _max_list(ka, lrow, jt, total, BLK, TILE).to(tl.int64) + 1
    cnt = _count_ge_list(ka, lo, lrow, jt, total, BLK, TILE)
    e_lo = cnt
    e_hi = tl.zeros((), tl.int32)
    side = tl.zeros((), tl.int32)
    lo = lo.to(tl.int64)
    interp = tl.full((), 1, tl.int32)
    while (hi - lo > 1) & (cnt != k):
        mid = _probe(lo, hi, e_lo, e_hi, k, interp)
        c = _count_ge_list(ka, mid.to(tl.int32), lrow, jt, total, BLK, TILE)
        lo, hi, cnt, e_lo, e_hi, side, interp = _search_step(mid, c, k, lo, hi, cnt, e_lo, e_hi,
                                                             side)  # fmt: skip
    return lo.to(tl.int32)


@triton.jit(do_not_specialize=NOT_SPECIALIZED)
def _select_kernel(
    limit_ptr,  # [T] int
    pivot_ptr,  # [T] int32
    count_ptr,  # [T] int32
    list_ptr,  # [T, CAP] int64
    out_ptr,  # [T, TOPK] int32
    num_cols,
    TOPK: tl.constexpr,
    CAP: tl.constexpr,
    THREADS: tl.constexpr,  # 32 · num_warps
    REGS: tl.constexpr,  # candidate keys per thread held in registers
    SUB: tl.constexpr,  # per thread in the tiles read from memory
):
    """Rows whose candidate count is in [TOPK, CAP]: the TOPK-th largest key `thr` by bisection
    (the first THREADS·REGS keys in registers, the rest re-read from L1); the ties at `thr` to
    keep are those below a position cut (a bisection too, only when some ties lose); then the
    winners are written tile by tile. Few registers, so that many rows are in flight per SM."""
    BLK: tl.constexpr = THREADS * REGS
    TILE: tl.constexpr = THREADS * SUB
    row = tl.program_id(0).to(tl.int64)
    limit = tl.minimum(tl.maximum(tl.load(limit_ptr + row).to(tl.int32), 0), num_cols)
    total = tl.load(count_ptr + row)
    if (limit > TOPK) & (total >= TOPK) & (total <= CAP):
        lrow = list_ptr + row * CAP
        # [THREADS, n] tiles, entry r·THREADS + t in thread t: coalesced, scans in-thread
        t = tl.arange(0, THREADS)[:, None]
        ja = tl.max_contiguous(tl.arange(0, REGS)[None, :] * THREADS + t, [1, 1])
        jt = tl.max_contiguous(tl.arange(0, SUB)[None, :] * THREADS + t, [1, 1])
        ka = _list_keys(lrow, ja, ja < total)
        pivot = tl.load(pivot_ptr + row)
        thr = _kth_largest_list(ka, lrow, jt, total, TOPK, pivot, BLK, TILE)
        n_gt = _count_ge_list(ka, thr + 1, lrow, jt, total, BLK, TILE)  # thr <= key(+inf)
        need = TOPK - n_gt
        n_tie = _count_ge_list(ka, thr, lrow, jt, total, BLK, TILE) - n_gt
        # keep the ties at positions < cut: all of them, or the `need` lowest
        cut = limit
        if n_tie > need:
            lo = tl.zeros((), tl.int32)  # #{ties at positions < lo} < need <= #{... < hi}
            hi = limit
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                c = tl.zeros((), tl.int32)
                for b0 in range(0, total, TILE):
                    j = b0 + jt
                    e = tl.load(lrow + j, mask=j < total, other=0)
                    tie = (j < total) & (_key_of(e.to(tl.int32)) == thr)
                    pos = (e >> 32).to(tl.int32)
                    c += tl.sum((tie & (pos < mid)).to(tl.int32))
                lo = tl.where(c < need, mid, lo)
                hi = tl.where(c < need, hi, mid)
            cut = hi
        orow = out_ptr + row * TOPK
        n_out = tl.zeros((), tl.int32)
        for b0 in range(0, total, TILE):
            j = b0 + jt
            e = tl.load(lrow + j, mask=j < total, other=0)
            key = tl.where(j < total, _key_of(e.to(tl.int32)), -2147483648)
            pos = (e >> 32).to(tl.int32)
            sel = (key > thr) | ((key == thr) & (pos < cut))
            sel_i = sel.to(tl.int32)
            per_thread = tl.sum(sel_i, axis=1)
            dst = n_out + (tl.cumsum(per_thread, 0) - per_thread)[:, None]
            tl.store(orow + dst + tl.cumsum(sel_i, axis=1) - sel_i, pos, mask=sel)
            n_out += tl.sum(per_thread)


@triton.jit(do_not_specialize=NOT_SPECIALIZED)
def _fallback_kernel(
    logits_ptr,  # [T, S] fp32, strides (stride_lt, 1)
    limit_ptr,  # [T] int
    count_ptr,  # [T] int32
    out_ptr,  # [T, TOPK] int32
    num_cols,
    stride_lt,
    TOPK: tl.constexpr,
    CAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Rows whose candidate count fell outside [TOPK, CAP]: the whole row, radix select (four
    8-bit histogram passes), then one scan writes the winners. Slow, and rare."""
    row = tl.program_id(0).to(tl.int64)
    limit = tl.minimum(tl.maximum(tl.load(limit_ptr + row).to(tl.int32), 0), num_cols)
    total = tl.load(count_ptr + row)
    if (limit > TOPK) & ((total < TOPK) | (total > CAP)):
        lrow = logits_ptr + row * stride_lt
        bins = tl.arange(0, 256)
        offs = tl.arange(0, BLOCK)
        prefix = tl.zeros((), tl.int32)  # unsigned key bits decided so far (key ^ INT32_MIN)
        need = tl.zeros((), tl.int32) + TOPK
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            hist = tl.zeros((256,), tl.int32)
            for c0 in range(0, limit, BLOCK):
                pos = c0 + offs
                mask = pos < limit
                u = _keys(lrow, pos, mask) ^ -2147483648  # unsigned order as int32 bits
                if p > 0:
                    high = (1 << (8 * p)) - 1
                    mask = mask & (((u >> (shift + 8)) & high) == prefix)
                hist += tl.histogram((u >> shift) & 255, 256, mask=mask)
            above_incl = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # [256] count in bins >= b
            b_star = tl.maximum(tl.sum((above_incl >= need).to(tl.int32)) - 1, 0)
            need -= tl.sum(tl.where(bins > b_star, hist, 0))
            prefix = (prefix << 8) | b_star
        thr = prefix ^ -2147483648
        n_gt = tl.zeros((), tl.int32)
        n_tie = tl.zeros((), tl.int32)
        orow = out_ptr + row * TOPK
        for c0 in range(0, limit, BLOCK):
            pos = c0 + offs
            mask = pos < limit
            key = _keys(lrow, pos, mask)
            n_gt, n_tie = _emit(orow, key, pos, mask, thr, need, n_gt, n_tie)


def indexer_topk(
    logits: torch.Tensor,
    limit: torch.Tensor,
    topk: int,
    chunk: int = 4096,
    num_warps: int = 8,
    select_warps: int = 4,
    sample_stride: int | None = None,
    z: float = 5.0,
    cap: int | None = None,
    block: int = 2048,
    rows_per_program: int | None = None,
    select_regs: int | None = None,
    prefetch: bool = False,
    collect_maxnreg: int | None = 64,
    sample_run: int = 8,
    pivot_warps: int | None = None,
) -> torch.Tensor:
    """Top-k positions per row, as a set.

    logits: [T, S] fp32 (no NaN); limit: [T] int, positions >= limit[t] are not eligible (the
    causal limit); topk: k. Returns int32 [T, topk]: the min(topk, limit[t], S) eligible positions
    with the largest scores — ties go to the lower position — then −1. The same set per row as
    ``topk_ref``, but the order of the positions within a row is unspecified (deterministic
    for a given configuration); callers that need score order sort them.

    Tuning (the set never depends on it): ``chunk``/``num_warps``: the streaming pass's tile per
    program; ``rows_per_program``: rows per collect program (default a power of two up to 32,
    keeping ~1000 programs); ``select_warps``/``select_regs``: the per-row select's warps and candidate keys
    per thread held in registers (default 4096 per row); ``prefetch``: load a row's chunk while
    the previous row's is compacted (off by default: it holds twice the registers);
    ``collect_maxnreg``: a register cap for the streaming pass, so that 4 programs of 8 warps fit
    on an SM (CUDA only; on an H200, 121 registers → 64 with 16 rows per program took the
    8192 × 128K causal collect pass from 2.92 to 1.87 ms); ``sample_stride`` (columns per sampled
    score, default k/32, at most 32), ``sample_run`` (adjacent scores per sampled run, a power of
    two, default 8; 1: one score per sector, and the default stride 64 beyond 64K columns),
    ``pivot_warps`` (default 2 to 16 by the sample's size) and ``z`` (default 5): the pivot
    sample; ``cap`` (a power of two >= topk, default 4·k): candidate list per row (T·cap·8
    bytes); ``block``: the whole-row fallback.
    """
    out, stages, _ = topk_stages(logits, limit, topk, chunk, num_warps, select_warps,
                                 sample_stride, z, cap, block, rows_per_program,
                                 select_regs, prefetch, collect_maxnreg, sample_run,
                                 pivot_warps)  # fmt: skip
    for launch in stages:
        launch()
    return out


def topk_launch_config(
    t,
    s,
    topk,
    chunk=4096,
    num_warps=8,
    select_warps=4,
    sample_stride=None,
    z=5.0,
    cap=None,
    block=2048,
    rows_per_program=None,
    select_regs=None,
    prefetch=False,
    collect_maxnreg=64,
    sample_run=8,
    pivot_warps=None,
):
    """The four kernels' launch metadata for T rows of S candidates and these tuning knobs (see
    :func:`indexer_topk`): {"pivot" | "collect" | "select" | "fallback": constexprs plus
    ``num_warps`` (and the collect's ``maxnreg``)}, and the grid sizes and ``cap``. The launcher
    and the sm_90 build check (``tools/aot_triton_sm90.py``) both resolve it here."""
    cap = cap or 4 * next_pow2(topk)
    if cap != next_pow2(cap) or cap < max(topk, 2):
        raise ValueError(f"cap {cap} must be a power of two >= topk {topk}")
    if sample_run < 1 or sample_run != next_pow2(sample_run):
        raise ValueError(f"sample_run must be a power of two >= 1, got {sample_run}")
    threads = 32 * num_warps
    chunk = max(threads, min(chunk, next_pow2(s)))
    num_chunks = triton.cdiv(s, chunk)
    chunks_pad = next_pow2(num_chunks)
    # several rows per collect program (fewer, longer programs: the look-back waits overlap with
    # other programs' loads), while keeping ~1000 programs or more; a power of two, so that the
    # compiled variants stay few (six)
    rows = rows_per_program or prev_pow2(max(1, min(32, t * num_chunks // 1024)))
    sthreads = min(32 * select_warps, cap)
    # the margin needs e = k / stride >~ 32 sample hits above the k-th score (see the top): one
    # score in 32 (runs of 8 adjacent scores: a 32-byte sector per 8 samples instead of one per
    # sample); one sector per sampled score (sample_run 1): one score in 32 up to 64K columns
    # and in 64 beyond, where the larger sample's cost outweighed its tighter pivot (measured
    # on an H200: docs/design/topk.md)
    stride = 32 if sample_run > 1 or s <= 65536 else 64
    sample_stride = sample_stride or max(1, min(stride, next_pow2(topk) // 32))
    sample_pad = max(min(next_pow2(triton.cdiv(s, sample_stride)), MAX_SAMPLE), sample_run)
    collect = dict(TOPK=topk, CAP=cap, CHUNK=chunk, THREADS=threads, ROWS=rows,
                   NUM_CHUNKS_PAD=chunks_pad, PREFETCH=prefetch, num_warps=num_warps)  # fmt: skip
    if collect_maxnreg:
        collect["maxnreg"] = collect_maxnreg
    return dict(
        cap=cap,
        num_chunks=num_chunks,
        collect_grid=triton.cdiv(t, rows) * num_chunks,
        z=float(z),
        pivot=dict(
            TOPK=topk,
            TOPK_PAD=next_pow2(topk),
            CAP=cap,
            SAMPLE_STRIDE=sample_stride,
            SAMPLE_PAD=sample_pad,
            NUM_CHUNKS_PAD=chunks_pad,
            RUN=sample_run,
            DEFF_REDO=DEFF_REDO,
            num_warps=pivot_warps or max(2 if sample_run > 1 else 4, min(16, sample_pad // 1024)),
        ),
        collect=collect,
        select=dict(
            TOPK=topk,
            CAP=cap,
            THREADS=sthreads,
            REGS=select_regs or max(1, min(cap, 4096) // sthreads),
            SUB=max(1, min(8, cap // sthreads)),
            num_warps=select_warps,
        ),
        fallback=dict(TOPK=topk, CAP=cap, BLOCK=min(block, max(16, next_pow2(s))), num_warps=4),
    )


_RECORD_NAMES = dict(
    pivot="topk_pivot", collect="topk", select="topk_select", fallback="topk_fallback"
)


def _grid(cfg, stage: str, t: int) -> tuple[int]:
    return (cfg["collect_grid"],) if stage == "collect" else (t,)


def _launches(cfg, t, s, stride_lt, logits, limit, out, pivot, tab, count, cand):
    """{stage: (kernel, positional arguments, keyword arguments)} of the four launches, from
    tensors or (for a compile-only warm-up) their dtypes; the launcher and
    :func:`topk_compile_plan` both build them here, so that the plan compiles what runs."""
    nc = cfg["num_chunks"]
    return dict(
        pivot=(_pivot_kernel, (logits, limit, out, pivot, tab, s, nc, stride_lt, cfg["z"]),
               cfg["pivot"]),
        collect=(_collect_kernel, (logits, limit, pivot, tab, count, cand, t, s, nc, stride_lt),
                 cfg["collect"]),
        select=(_select_kernel, (limit, pivot, count, cand, out, s), cfg["select"]),
        fallback=(_fallback_kernel, (logits, limit, count, out, s, stride_lt), cfg["fallback"]),
    )  # fmt: skip


def topk_compile_plan(
    max_rows: int, max_cols: int, topk: int, limit_dtype: torch.dtype = torch.int64, **tuning
) -> list[tuple]:
    """Every kernel variant :func:`indexer_topk` compiles for at most ``max_rows`` rows of at
    most ``max_cols`` columns (CUDA launches, logits rows strided by a multiple of 16 as the
    indexer's logits are), as ``(kernel, args, kwargs)`` with dtypes in place of tensors — what
    ``kernel.warmup(*args, grid=..., **kwargs)`` compiles without launching. The constexprs are
    those of the power-of-two bucket of the columns, but for the collect's rows per program,
    which follows rows × chunks: every power of two between the bucket's least and greatest.
    Columns <= ``topk`` need the pivot pass only. One entry per variant."""
    plan: dict[tuple, tuple] = {}
    if max_rows < 1 or max_cols < 1 or topk < 1:
        return []
    i32, i64, f32 = torch.int32, torch.int64, torch.float32
    b = 1
    while True:
        lo, hi = (b // 2 + 1 if b > 1 else 1), min(b, max_cols)  # the bucket (b/2, b]
        r_lo = topk_launch_config(1, lo, topk, **tuning)["collect"]["ROWS"]
        r_hi = topk_launch_config(max_rows, hi, topk, **tuning)["collect"]["ROWS"]
        for s in (lo, hi):
            r = r_lo
            while r <= r_hi:
                cfg = topk_launch_config(1, s, topk, **tuning)
                cfg["collect"]["ROWS"] = r
                launches = _launches(cfg, 1, s, 16, f32, limit_dtype, i32, i32, i32, i32, i64)
                for stage, (kernel, args, kw) in launches.items():
                    if s <= topk and stage != "pivot":
                        continue
                    # the sizes are not specialised on: the constexprs and options are the key
                    plan.setdefault((kernel.fn.__name__, tuple(sorted(kw.items()))),
                                    (kernel, args, kw))  # fmt: skip
                r *= 2
        if hi >= max_cols:
            return list(plan.values())
        b *= 2


def topk_launches(logits, limit, topk, *args, **kwargs):
    """(out, cfg, {stage: (kernel, args, kwargs)}, count) for :func:`indexer_topk` on these
    tensors, over freshly allocated buffers, nothing launched (``cfg`` None and no launches for
    an empty problem). Every buffer starts 16-byte aligned, so that the kernels' pointer
    specialisations do not follow T."""
    if logits.dim() != 2 or limit.shape != (logits.shape[0],):
        raise ValueError(f"logits {tuple(logits.shape)} must be [T, S] with limit [T]")
    check_cuda_or_interpreter(logits, limit)
    t, s = logits.shape
    dev = logits.device
    out = torch.empty(t, topk, dtype=torch.int32, device=dev)
    if t == 0 or topk == 0:
        return out, None, {}, None
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        logits = logits.float().contiguous()
    cfg = topk_launch_config(t, s, topk, *args, **kwargs)
    if not logits.is_cuda:
        cfg["collect"].pop("maxnreg", None)
    limit = limit.contiguous()
    if limit.data_ptr() % 16:
        limit = limit.clone()
    i32 = dict(dtype=torch.int32, device=dev)
    pivot, count = torch.empty(t, **i32), torch.empty(t, **i32)
    tab = torch.empty(t, cfg["num_chunks"], **i32)
    cand = torch.empty(t, cfg["cap"], dtype=torch.int64, device=dev)
    launches = _launches(cfg, t, s, logits.stride(0), logits, limit, out, pivot, tab, count, cand)
    return out, cfg, launches, count


def topk_stages(logits, limit, topk, *args, **kwargs):
    """(out, [pivot, collect, finish], count): the launches of :func:`indexer_topk` as closures
    over freshly allocated buffers, for the benchmark's per-stage times (pivot and collect may be
    repeated in that order; finish is the select and fallback launches), and the per-row
    candidate counts they fill (rows with limit > topk; outside [topk, cap]: the fallback).
    When no row has more than ``topk`` columns the pivot pass alone answers every row, and is
    the only stage. The tuning arguments are :func:`topk_launch_config`'s."""
    out, cfg, launches, count = topk_launches(logits, limit, topk, *args, **kwargs)
    if cfg is None:
        return out, [], None
    t, s = logits.shape

    def run(stage):
        kernel, args, kw = launches[stage]
        record(_RECORD_NAMES[stage], kernel[_grid(cfg, stage, t)](*args, **kw))

    def pivot_launch():
        run("pivot")

    def collect_launch():
        run("collect")

    def finish_launch():
        run("select")
        run("fallback")

    if s <= topk:  # every row's limit is <= topk: the pivot pass answers them all
        return out, [pivot_launch], count
    return out, [pivot_launch, collect_launch, finish_launch], count
