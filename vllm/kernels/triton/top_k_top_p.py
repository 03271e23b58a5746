"""Top-k / top-p filtering in Triton (spec: :func:`vllm.kernels.sampling.top_k_top_p`): one
program per row; streaming passes narrow each filter's cut to a short bracket of values, one
pass writes the row and lists the bracketed tokens, an exact select over the list finishes.

The reference sorts every row (~10 ms at B = 256, V = 154,880). Here a row costs two reads and
one write when the cut is easy to bracket (LLM-like rows, top-k with small k), one or two more
reads when the distribution is flat near the cut:

  1. statistics: the row max m and the counts of the finite tokens in NB bins of width 1/UNIT
     logit units below it (the window; slot g mod NB of grid index g = floor(x · UNIT), exact
     as UNIT is a power of two; the bins a higher block max pushes out join the tail count).
  2. brackets (in registers): top-k's cut lies in the bin where the counts from the top reach k
     (exact); top-p's, among top-k's survivors, in the bins whose mass ratio above / (above +
     below) may reach top_p given each bin's bounds count · exp(bin edge - m) (margin EPS). With
     both filters and few tokens at or above top-k's bin, all of those are bracketed (top-p is
     then done exactly on the list). Bins above a bracket are kept, bins below it dropped.
  3. refinement, while the brackets hold more than CAP tokens: one pass counts the tokens of a
     bracket in NB sub-bins (a finer power-of-two unit) and sums the exact masses above and
     below top-p's; the brackets shrink accordingly (top-p's when it lies above top-k's).
  4. write: every decided token written (x or -inf); the bracketed ones written as x and listed
     (thread-major: one scan across threads per block, the rest in-thread), with the exact
     masses of the tokens above each bracket.
  5. select over the list (L1-resident, its first TILE entries in registers): top-k's cut is
     the largest key u with #{keys >= u} >= k, top-p's the largest with the mass at keys >= u
     >= top_p · (top-k survivors' mass) (interpolating searches that close on list keys, a few
     steps); the tokens tied at a cut are kept lowest index first (the j-th tie at top-p's cut
     while mass-above + j · its mass < the limit), the index cut found by bisection; the listed
     tokens rewritten.

The counts are exact (bin edges g / unit are exact floats; rows with |max| >= 2^21 go dense), so
the list always holds top-k's cut; top-p's bracket rests on bounds, and the select checks that
the last token above it is kept and the first survivor below it dropped. When that check fails
(rounding at the bracket's edge), the list would exceed CAP (mass ties; top-p's cut inside a large
top-k bracket) or refinement stops helping, the row is redone with the whole row as the list
(dense: one pass per search step; exact, slow, rare). Values are compared as order-preserving
int32 keys (-0.0 folded onto +0.0, as the reference's sort ties them). Histograms have NB = 64
bins: Triton's histogram costs ~NB/32 instructions per token per thread (one popcount per bin a
lane owns); 2048 bins made the first pass compute-bound at ~500 instructions per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.triton.topk import _key_of
from vllm.kernels.triton.utils import check_cuda_or_interpreter, record

__all__ = ["launch_config", "top_k_top_p"]

INT32_MIN = tl.constexpr(-2147483648)
INT32_MAX = tl.constexpr(2147483647)
NEG_INF_KEY = tl.constexpr(-2139095041)  # _key_of(-inf); every finite value's key is above it
TAIL_G = tl.constexpr(-1073741824)  # the grid's floor (-inf and the lowest finite values)
FLT_MAX = tl.constexpr(3.4028234663852886e38)
EPS = 1e-5  # margin of the top-p brackets on the mass ratio (fp32 sums: ~1e-6 relative)
MAX_REFINE = 3  # refinement passes per row at most
MAX_UNIT = 2.0**16  # finest grid: |x| · unit stays below 2^24 (exact) for |x| < 256


@triton.jit
def _grid(x, unit):
    """fp32 -> floor(x · unit) clamped to ±2^30 (-inf -> -2^30); exact: unit is a power of 2."""
    g = tl.floor(x * unit)
    return tl.minimum(tl.maximum(g, -1073741824.0), 1073741824.0).to(tl.int32)


@triton.jit
def _flag(c):
    """A scalar condition as an int comparison (the interpreter splats a scalar float comparison
    into a float block, which then fails in bitwise ops with booleans)."""
    return tl.where(c, 1, 0) != 0


@triton.jit
def _edge(g, unit):
    """Grid index -> its value g / unit (exact below 2^24); the grid's floor -> -FLT_MAX."""
    v = tl.math.div_rn(g.to(tl.float32), unit)
    return tl.where(g <= TAIL_G, -FLT_MAX, v)


@triton.jit
def _stats(xrow, V, NB: tl.constexpr, UNIT: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1 -> (m, g_top = floor(m · UNIT), [NB] counts by slot g mod NB, tail count)."""
    offs = tl.arange(0, BLOCK)
    slots = tl.arange(0, NB)
    h = tl.zeros((NB,), tl.int32)
    acc_t = tl.zeros((BLOCK,), tl.int32)
    m = tl.full((), float("-inf"), tl.float32)
    g_top = tl.zeros((), tl.int32)
    n_tail = tl.zeros((), tl.int32)
    x = tl.load(xrow + offs, mask=offs < V, other=float("-inf"))
    for b0 in range(0, V, BLOCK):
        nxt = b0 + BLOCK + offs  # the next block is loaded while this one is binned
        x_next = tl.load(xrow + nxt, mask=nxt < V, other=float("-inf"))
        bm = tl.max(x, 0)
        if bm > m:  # the window moves up: the bins that leave it join the tail
            gn = _grid(bm, UNIT)
            gone = g_top - ((g_top - slots) & (NB - 1)) <= gn - NB
            n_tail += tl.sum(tl.where(gone, h, 0))
            h = tl.where(gone, 0, h)
            m = bm
            g_top = gn
        g = _grid(x, UNIT)
        fin = x > float("-inf")
        h += tl.histogram(g & (NB - 1), NB, mask=fin & (g > g_top - NB))
        acc_t += (fin & (g <= g_top - NB)).to(tl.int32)
        x = x_next
    return m, g_top, h, n_tail + tl.sum(acc_t)


@triton.jit
def _p_cut(c, lo, hi, a_l, a_h, b_l, b_h, p, NB: tl.constexpr, EPS: tl.constexpr):
    """Bins in descending value order: c [NB] top-k survivors, exp(x - m) of their tokens in
    [lo, hi]; the masses above and below all NB bins in [a_l, a_h], [b_l, b_h]. A bin's first
    token has mass-before / total >= al / (al + bh), its last one <= (ah + bin) / (ah + bin +
    bl'). -> (first bin not surely all kept, last bin not surely all dropped): NB and -1 if
    none."""
    j = tl.arange(0, NB)
    wl = c.to(tl.float32) * lo
    wh = c.to(tl.float32) * hi
    al = a_l + tl.cumsum(wl, 0) - wl
    ah = a_h + tl.cumsum(wh, 0) - wh
    tot_l = a_l + tl.sum(wl) + b_l
    tot_h = a_h + tl.sum(wh) + b_h
    r_first = al / tl.maximum(al + tl.maximum(tot_h - ah, 0.0), 1e-30)
    ahn = ah + wh
    r_last = ahn / tl.maximum(ahn + tl.maximum(tot_l - al - wl, 0.0), 1e-30)
    first = tl.min(tl.where((c > 0) & (r_last >= p - EPS), j, NB))
    last = tl.max(tl.where((c > 0) & (r_first < p + EPS), j, -1))
    return first, last


@triton.jit
def _refine(xrow, V, m, k_ref, ku, kglo, vk_lo, vk_hi, p_ref, pu, pglo, vp_lo, vp_hi, vb_lo,
            NB: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """A refinement pass -> ([NB] counts of top-k's bracket by sub-bin floor(x · ku) - kglo,
    [NB] counts of top-p's by floor(x · pu) - pglo, the exact masses above top-p's bracket and
    below it down to vb_lo)."""
    offs = tl.arange(0, BLOCK)
    hk = tl.zeros((NB,), tl.int32)
    hp = tl.zeros((NB,), tl.int32)
    acc_a = tl.zeros((BLOCK,), tl.float32)
    acc_b = tl.zeros((BLOCK,), tl.float32)
    x = tl.load(xrow + offs, mask=offs < V, other=float("-inf"))
    for b0 in range(0, V, BLOCK):
        nxt = b0 + BLOCK + offs
        x_next = tl.load(xrow + nxt, mask=nxt < V, other=float("-inf"))
        fin = x > float("-inf")
        if k_ref:
            ik = _grid(x, ku) - kglo
            hk += tl.histogram(ik & (NB - 1), NB, mask=fin & (x >= vk_lo) & (x < vk_hi))
        if p_ref:
            ip = _grid(x, pu) - pglo
            hp += tl.histogram(ip & (NB - 1), NB, mask=fin & (x >= vp_lo) & (x < vp_hi))
            e = tl.where(fin, tl.exp(x - m), 0.0)
            acc_a += tl.where(x >= vp_hi, e, 0.0)
            acc_b += tl.where((x < vp_lo) & (x >= vb_lo), e, 0.0)
        x = x_next
    return hk, hp, tl.sum(acc_a), tl.sum(acc_b)


@triton.jit
def _write_decided(xrow, orow, lrow, V, m, d_lo, ck_lo, ck_hi, cp_lo, cp_hi, sk_hi, sp_hi,
                   CAP: tl.constexpr, THREADS: tl.constexpr, R: tl.constexpr):  # fmt: skip
    """Write pass: tokens below d_lo dropped, the others written as they are; those in either
    bracket ([ck_lo, ck_hi), [cp_lo, cp_hi)) listed (index << 32 | value bits; up to CAP).
    -> (list size, may exceed CAP; the masses exp(x - m) at or above sk_hi and at or above
    sp_hi). [THREADS, R] tiles, element (t, r) at r · THREADS + t: each warp load reads 128
    contiguous bytes and row t lies in thread t, so the compaction scans in-thread but for one
    scan across threads (the list is thread-major, not in index order)."""
    t = tl.arange(0, THREADS)[:, None]
    offs = tl.arange(0, R)[None, :] * THREADS + t
    acc_k = tl.zeros((THREADS, R), tl.float32)
    acc_p = tl.zeros((THREADS, R), tl.float32)
    n = tl.zeros((), tl.int32)
    x = tl.load(xrow + tl.max_contiguous(offs, [1, 1]), mask=offs < V, other=float("-inf"))
    for b0 in range(0, V, THREADS * R):
        pos = b0 + offs
        nxt = tl.max_contiguous(pos + THREADS * R, [1, 1])
        x_next = tl.load(xrow + nxt, mask=nxt < V, other=float("-inf"))
        e = tl.exp(x - m)  # 0 at -inf (m is finite)
        acc_k += tl.where(x >= sk_hi, e, 0.0)
        acc_p += tl.where(x >= sp_hi, e, 0.0)
        tl.store(orow + tl.max_contiguous(pos, [1, 1]), tl.where(x >= d_lo, x, float("-inf")),
                 mask=pos < V)  # fmt: skip
        cand = ((x >= ck_lo) & (x < ck_hi)) | ((x >= cp_lo) & (x < cp_hi))
        ci = cand.to(tl.int32)
        per_thread = tl.sum(ci, axis=1)
        at = n + (tl.cumsum(per_thread, 0) - per_thread)[:, None] + tl.cumsum(ci, axis=1) - ci
        item = (pos.to(tl.int64) << 32) | (x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
        tl.store(lrow + at, item, mask=cand & (at < CAP))
        n += tl.sum(per_thread)
        x = x_next
    return n, tl.sum(tl.sum(acc_k, axis=1)), tl.sum(tl.sum(acc_p, axis=1))


# ---- select over a list of entries: the candidates, or the whole row (dense) -------------------
@triton.jit
def _tile(lrow, xrow, t0, n, dense, m, TILE: tl.constexpr):
    """Entries t0 .. t0 + TILE - 1 -> (index, x, key, exp(x - m)); -inf past n."""
    j = t0 + tl.arange(0, TILE)
    if dense:
        idx = j
        x = tl.load(xrow + j, mask=j < n, other=float("-inf"))
    else:
        item = tl.load(lrow + j, mask=j < n, other=0xFF800000)  # -inf past n
        idx = (item >> 32).to(tl.int32)
        x = item.to(tl.int32).to(tl.float32, bitcast=True)
    key = _key_of(x.to(tl.int32, bitcast=True))
    e = tl.exp(x - m)
    return idx, x, key, e


@triton.jit
def _sel(idx, x, key, e, WHICH: tl.constexpr, vk_lo, vk_hi, thr_k, cut_k, vp_lo, vp_hi):
    """(selected, weight): WHICH 0, top-k's bracket, weight 1; WHICH 1, the entries of top-p's
    bracket that top-k keeps, weight exp(x - m)."""
    fin = key > NEG_INF_KEY
    if WHICH == 0:
        sel = fin & (x >= vk_lo) & (x < vk_hi)
        w = tl.where(sel, 1.0, 0.0)
    else:
        kept = (key > thr_k) | ((key == thr_k) & (idx < cut_k))
        sel = fin & (x >= vp_lo) & (x < vp_hi) & kept
        w = tl.where(sel, e, 0.0)
    return sel, w


@triton.jit
def _scan(i0, x0, key0, e0, lrow, xrow, n, dense, m, vk_lo, vk_hi, thr_k, cut_k, vp_lo, vp_hi,
          WHICH: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
    """Over the selected entries -> (min key, max key, count, weight, top-k survivors' mass)."""
    kmin = tl.full((), INT32_MAX, tl.int32)
    kmax = tl.full((), INT32_MIN, tl.int32)
    cnt = tl.zeros((), tl.int32)
    tot = tl.zeros((), tl.float32)
    s_add = tl.zeros((), tl.float32)
    for t0 in range(0, n, TILE):
        if t0 == 0:
            idx, x, key, e = i0, x0, key0, e0
        else:
            idx, x, key, e = _tile(lrow, xrow, t0, n, dense, m, TILE)
        sel, w = _sel(idx, x, key, e, WHICH, vk_lo, vk_hi, thr_k, cut_k, vp_lo, vp_hi)
        kmin = tl.minimum(kmin, tl.min(tl.where(sel, key, INT32_MAX)))
        kmax = tl.maximum(kmax, tl.max(tl.where(sel, key, INT32_MIN)))
        cnt += tl.sum(sel.to(tl.int32))
        tot += tl.sum(w)
        kept = (key > thr_k) | ((key == thr_k) & (idx < cut_k))
        k_in = (key > NEG_INF_KEY) & (x >= vk_lo) & (x < vk_hi)
        s_add += tl.sum(tl.where(k_in & kept, e, 0.0))
    return kmin, kmax, cnt, tot, s_add


@triton.jit
def _ge(u, sel, w, key):
    """(weight, count, least key) of the selected entries with key >= u; largest key below u."""
    ge = sel & (key >= u)
    least = tl.min(tl.where(ge, key, INT32_MAX))
    below = tl.max(tl.where(sel & ~ge, key, INT32_MIN))
    return tl.sum(tl.where(ge, w, 0.0)), tl.sum(ge.to(tl.int32)), least, below


@triton.jit
def _ge_rest(u, lrow, xrow, n, dense, m, vk_lo, vk_hi, thr_k, cut_k, vp_lo, vp_hi,
             WHICH: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
    """:func:`_ge` over the entries past the first tile (read again: L1)."""
    f = tl.zeros((), tl.float32)
    c = tl.zeros((), tl.int32)
    a = tl.full((), INT32_MAX, tl.int32)
    b = tl.full((), INT32_MIN, tl.int32)
    for t0 in range(TILE, n, TILE):
        idx, x, key, e = _tile(lrow, xrow, t0, n, dense, m, TILE)
        sel, w = _sel(idx, x, key, e, WHICH, vk_lo, vk_hi, thr_k, cut_k, vp_lo, vp_hi)
        f2, c2, a2, b2 = _ge(u, sel, w, key)
        f += f2
        c += c2
        a = tl.minimum(a, a2)
        b = tl.maximum(b, b2)
    return f, c, a, b


@triton.jit
def _search(target, base, lo, hi, f_lo, f_hi, c_lo, sel0, w0, i0, x0, key0, e0, lrow, xrow, n,
            dense, m, vk_lo, vk_hi, thr_k, cut_k, vp_lo, vp_hi, WHICH: tl.constexpr,
            TILE: tl.constexpr):  # fmt: skip
    """The largest key u with F(u) = base + weight(selected keys >= u) >= target, given F(lo) >=
    target > F(hi) (lo a key). Probes interpolate F linearly between the bracket's ends
    (Illinois rule: an end kept twice in a row has its value pulled halfway to the target; the
    midpoint when a probe did not halve the bracket), and the bracket then closes on the nearest
    keys on either side, so a list of a few keys takes a few steps. -> (u, #{keys >= u},
    #{keys > u}, F(u + 1))."""
    c_hi = tl.zeros((), tl.int32)
    f_hi = tl.zeros((), tl.float32) + f_hi
    w_lo = tl.zeros((), tl.float32) + f_lo
    w_hi = f_hi
    side = tl.zeros((), tl.int32)
    bisect = n < 0  # false
    while hi - lo > 1:
        frac = (w_lo - target) / tl.maximum(w_lo - w_hi, 1e-30)
        g = lo + ((hi - lo).to(tl.float32) * frac).to(tl.int64)
        g = tl.where(bisect, (lo + hi) >> 1, tl.minimum(tl.maximum(g, lo + 1), hi - 1))
        u = g.to(tl.int32)
        f, c, a, b = _ge(u, sel0, w0, key0)
        if n > TILE:
            f2, c2, a2, b2 = _ge_rest(u, lrow, xrow, n, dense, m, vk_lo, vk_hi, thr_k, cut_k,
                                      vp_lo, vp_hi, WHICH, TILE)  # fmt: skip
            f += f2
            c += c2
            a = tl.minimum(a, a2)
            b = tl.maximum(b, b2)
        f += base
        up = f >= target
        width = hi - lo
        lo = tl.where(up, a.to(tl.int64), lo)  # no key in [g, a): F(a) = F(g)
        hi = tl.where(up, hi, b.to(tl.int64) + 1)  # nor in (b, g)
        c_lo = tl.where(up, c, c_lo)
        c_hi = tl.where(up, c_hi, c)
        f_hi = tl.where(up, f_hi, f)
        w_lo = tl.where(up, f, tl.where(side < 0, (w_lo + target) * 0.5, w_lo))
        w_hi = tl.where(up, tl.where(side > 0, (w_hi + target) * 0.5, w_hi), f)
        side = tl.where(up, 1, -1)
        bisect = (hi - lo) * 2 > width
    return lo.to(tl.int32), c_lo, c_hi, f_hi


@triton.jit
def _tie_cut(v, keep, n_ties, i0, x0, key0, e0, lrow, xrow, n, dense, m, vk_lo, vk_hi, thr_k,
             cut_k, vp_lo, vp_hi, V, WHICH: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
    """Of the selected entries tied at key v, the `keep` lowest indices stay: the index of the
    first one that does not (INT32_MAX when all stay). The whole row (dense) is in index order:
    one pass ranks the ties; a list is not: bisection on the index."""
    sel0, w0 = _sel(i0, x0, key0, e0, WHICH, vk_lo, vk_hi, thr_k, cut_k, vp_lo, vp_hi)
    tie0 = sel0 & (key0 == v)
    cut = tl.full((), INT32_MAX, tl.int32)
    if dense & (keep < n_ties):
        t = tie0.to(tl.int32)
        rank = tl.cumsum(t, 0) - t
        cut = tl.min(tl.where(tie0 & (rank == keep), i0, INT32_MAX))
        run = tl.sum(t)
        for t0 in range(TILE, n, TILE):
            idx, x, key, e = _tile(lrow, xrow, t0, n, dense, m, TILE)
            sel, w = _sel(idx, x, key, e, WHICH, vk_lo, vk_hi, thr_k, cut_k, vp_lo, vp_hi)
            tie = sel & (key == v)
            t = tie.to(tl.int32)
            rank = run + tl.cumsum(t, 0) - t
            cut = tl.minimum(cut, tl.min(tl.where(tie & (rank == keep), idx, INT32_MAX)))
            run += tl.sum(t)
    else:
        lo = tl.zeros((), tl.int32)  # #{ties below lo} < keep <= #{ties below hi}
        hi = tl.where(keep < n_ties, V, 0)
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            c = tl.sum((tie0 & (i0 < mid)).to(tl.int32))
            for t0 in range(TILE, n, TILE):
                idx, x, key, e = _tile(lrow, xrow, t0, n, dense, m, TILE)
                sel, w = _sel(idx, x, key, e, WHICH, vk_lo, vk_hi, thr_k, cut_k, vp_lo, vp_hi)
                c += tl.sum((sel & (key == v) & (idx < mid)).to(tl.int32))
            lo = tl.where(c < keep, mid, lo)
            hi = tl.where(c < keep, hi, mid)
        cut = tl.where(keep < n_ties, hi, INT32_MAX)
    return cut


@triton.jit
def _select(lrow, xrow, n, dense, m, k_on, need, vk_lo, vk_hi, base_k, p_on, p, vp_lo, vp_hi,
            base_p, n_below, V, TILE: tl.constexpr):  # fmt: skip
    """-> (thr_k, cut_k, v_p, cut_p, ok): a token is kept iff its key > thr_k, or == thr_k at an
    index < cut_k, and likewise for (v_p, cut_p). ok: top-p's bracket held. The first TILE
    entries stay in registers; the bisections read the others again (from L1: the list is
    short) on every step."""
    i0, x0, key0, e0 = _tile(lrow, xrow, 0, n, dense, m, TILE)
    thr_k = tl.full((), INT32_MIN, tl.int32)
    cut_k = tl.zeros((), tl.int32)
    ok = n >= 0  # true
    if k_on:
        kmin, kmax, n_in, _, _ = _scan(i0, x0, key0, e0, lrow, xrow, n, dense, m, vk_lo, vk_hi,
                                       thr_k, cut_k, vp_lo, vp_hi, 0, TILE)  # fmt: skip
        ok = (need >= 1) & (need <= n_in)  # the cut is in the list
        sel0, w0 = _sel(i0, x0, key0, e0, 0, vk_lo, vk_hi, thr_k, cut_k, vp_lo, vp_hi)
        # the need-th largest key: the largest u with #{keys >= u} >= need
        hi = tl.where(ok, kmax.to(tl.int64) + 1, kmin.to(tl.int64))
        thr_k, c_lo, c_hi, _ = _search(need, 0.0, kmin.to(tl.int64), hi, n_in.to(tl.float32), 0.0,
                                       n_in, sel0, w0, i0, x0, key0, e0, lrow, xrow, n, dense, m,
                                       vk_lo, vk_hi, thr_k, cut_k, vp_lo, vp_hi, 0,
                                       TILE)  # fmt: skip
        cut_k = _tie_cut(thr_k, need.to(tl.int32) - c_hi, c_lo - c_hi, i0, x0, key0, e0, lrow,
                         xrow, n, dense, m, vk_lo, vk_hi, thr_k, cut_k, vp_lo, vp_hi, V, 0,
                         TILE)  # fmt: skip
    v_p = tl.full((), INT32_MIN, tl.int32)
    cut_p = tl.zeros((), tl.int32)
    if p_on & ok:
        pmin, pmax, n_p, t_add, s_add = _scan(i0, x0, key0, e0, lrow, xrow, n, dense, m, vk_lo,
                                              vk_hi, thr_k, cut_k, vp_lo, vp_hi, 1,
                                              TILE)  # fmt: skip
        lim = tl.maximum(p, 1e-30) * (base_k + s_add)  # top_p · the top-k survivors' mass
        total = base_p + t_add
        ok = base_p < lim  # the last token above the bracket is kept
        if total < lim:  # the whole bracket is kept: no survivor may be below it
            ok = ok & (n_below == 0)
        elif ok & (n_p > 0):
            sel0, w0 = _sel(i0, x0, key0, e0, 1, vk_lo, vk_hi, thr_k, cut_k, vp_lo, vp_hi)
            # the last kept key: the largest u with base_p + mass(keys >= u) >= lim (its first
            # tie has mass-before base_p + mass(keys > u) < lim, every key below it does not)
            v_p, c_lo, c_hi, f_hi = _search(lim, base_p, pmin.to(tl.int64), pmax.to(tl.int64) + 1,
                                            total, base_p, n_p, sel0, w0, i0, x0, key0, e0, lrow,
                                            xrow, n, dense, m, vk_lo, vk_hi, thr_k, cut_k, vp_lo,
                                            vp_hi, 1, TILE)  # fmt: skip
            # its ties, in index order, are kept while the mass before each is < lim: the j-th
            # has f_hi + j · e before it (all share e)
            n_ties = c_lo - c_hi
            vbits = tl.where(v_p < 0, v_p ^ 0x7FFFFFFF, v_p)
            e_v = tl.exp(vbits.to(tl.float32, bitcast=True) - m)
            q = tl.minimum((lim - f_hi) / tl.maximum(e_v, 1e-38), n_ties.to(tl.float32))
            keep = tl.minimum(tl.maximum(tl.ceil(q).to(tl.int32), 1), n_ties)
            keep = tl.where((keep > 1) & (f_hi + (keep - 1).to(tl.float32) * e_v >= lim), keep - 1,
                            keep)  # fmt: skip
            keep = tl.where((keep < n_ties) & (f_hi + keep.to(tl.float32) * e_v < lim), keep + 1,
                            keep)  # fmt: skip
            cut_p = _tie_cut(v_p, keep, n_ties, i0, x0, key0, e0, lrow, xrow, n, dense, m, vk_lo,
                             vk_hi, thr_k, cut_k, vp_lo, vp_hi, V, 1, TILE)  # fmt: skip
        else:
            ok = False
    return thr_k, cut_k, v_p, cut_p, ok


@triton.jit
def _write_list(orow, lrow, xrow, n, dense, m, thr_k, cut_k, v_p, cut_p, TILE: tl.constexpr):
    """The list's entries (the whole row when dense) written: x if kept, else -inf."""
    for t0 in range(0, n, TILE):
        idx, x, key, e = _tile(lrow, xrow, t0, n, dense, m, TILE)
        keep_k = (key > thr_k) | ((key == thr_k) & (idx < cut_k))
        keep_p = (key > v_p) | ((key == v_p) & (idx < cut_p))
        j = t0 + tl.arange(0, TILE)
        tl.store(orow + idx, tl.where(keep_k & keep_p, x, float("-inf")), mask=j < n)


@triton.jit
def _scale(w, NB: tl.constexpr):
    """The power of two s <= NB with s · w <= NB: sub-bins per bin of a w-bin bracket."""
    s = tl.full((), NB, tl.int32)
    while s * w > NB:
        s = s // 2
    return s


@triton.jit
def _union(small, k_on, nk, k_abv, vk_lo, vk_hi, p_act, n_p, vp_lo, vp_hi):
    """Tokens in either bracket (top-k's lies in one first-pass bin: inside top-p's or apart)."""
    inside = (vk_lo >= vp_lo) & (vk_hi <= vp_hi)
    n = tl.where(k_on, nk, 0) + tl.where(p_act, n_p, 0)
    n = tl.where(k_on & p_act & inside, n_p, n)
    return tl.where(small, k_abv + nk, n)


@triton.jit
def _top_k_top_p_kernel(
    x_ptr,  # [B, V] fp32, row stride stride_x
    out_ptr,  # [B, V] fp32, row stride stride_o
    k_ptr,  # [B] int: top-k, <= 0 off (read when HAS_K)
    p_ptr,  # [B] fp32: top-p, >= 1 off (read when HAS_P)
    hist_ptr,  # [B, NB] int32 scratch
    list_ptr,  # [B, CAP] int64 scratch: listed tokens (index << 32 | value bits)
    stats_ptr,  # [B, 3] int32: refinement passes, list size, dense (when HAS_STATS)
    V,
    stride_x,
    stride_o,
    HAS_K: tl.constexpr,
    HAS_P: tl.constexpr,
    HAS_STATS: tl.constexpr,
    NB: tl.constexpr,  # histogram bins (a power of two)
    UNIT: tl.constexpr,  # first pass's bins per logit unit (a power of two)
    EPS: tl.constexpr,
    CAP: tl.constexpr,  # list capacity per row
    MAX_REFINE: tl.constexpr,
    MAX_UNIT: tl.constexpr,
    BLOCK: tl.constexpr,  # streaming block
    TILE: tl.constexpr,  # select tile (the first one held in registers)
    THREADS: tl.constexpr,  # 32 · num_warps
):
    row = tl.program_id(0).to(tl.int64)
    xrow = x_ptr + row * stride_x
    orow = out_ptr + row * stride_o
    k = tl.zeros((), tl.int32)
    p = tl.full((), 1.0, tl.float32)
    if HAS_K:
        k = tl.minimum(tl.maximum(tl.load(k_ptr + row).to(tl.int64), 0), V).to(tl.int32)
    if HAS_P:
        p = tl.load(p_ptr + row).to(tl.float32)
    k_on = (k > 0) & (k < V)
    p_on = _flag(p < 1.0)
    if k_on | p_on:
        m, g_top, h, n_tail = _stats(xrow, V, NB, UNIT, BLOCK)
        m = tl.maximum(m, -3.0e38)  # a row of -inf: exp(x - m) stays 0, not NaN
        hrow = hist_ptr + row * NB
        j = tl.arange(0, NB)
        tl.store(hrow + j, h)  # read back from the top bin down
        n_win = tl.sum(h)
        k_on = k_on & (k < n_win + n_tail)  # else top-k keeps every finite token
        p_on = p_on & (n_win + n_tail > 0)
        tl.debug_barrier()
        gj = g_top - j  # the bins from the top; the tail: finite tokens at grid <= gt
        gt = g_top - NB
        hl = tl.load(hrow + (gj & (NB - 1)))
        above = tl.cumsum(hl, 0) - hl
        # top-k's bracket: the bin of the k-th token (the tail if beyond the window)
        in_tail = k > n_win
        at = k_on & (above < k) & (above + hl >= k)
        kglo = tl.where(in_tail, TAIL_G, tl.max(tl.where(at, gj, INT32_MIN)))
        kghi = tl.where(in_tail, gt, kglo)
        nk = tl.where(in_tail, n_tail, tl.sum(tl.where(at, hl, 0)))
        k_abv = tl.where(in_tail, n_win, tl.sum(tl.where(at, above, 0)))
        ku = tl.full((), UNIT, tl.float32)
        vk_lo = _edge(kglo, ku)
        vk_hi = _edge(kghi + 1, ku)
        # top-p's bracket among top-k's survivors
        small = k_on & p_on & (k_abv + nk <= CAP)  # list them all: top-p done on the list
        p_act = p_on & (small == 0)
        pglo = tl.full((), TAIL_G, tl.int32)
        pghi = gt
        n_p = tl.zeros((), tl.int32)
        n_below = tl.zeros((), tl.int32)  # top-k survivors below top-p's bracket
        if p_act:
            cs = tl.where(k_on, tl.minimum(tl.maximum(k - above, 0), hl), hl)
            cs_t = tl.where(k_on, tl.minimum(tl.maximum(k - n_win, 0), n_tail), n_tail)
            gf = gj.to(tl.float32)
            lo = tl.exp(gf / UNIT - m)
            hi = tl.minimum(tl.exp((gf + 1.0) / UNIT - m), 1.0)
            tail_h = cs_t.to(tl.float32) * tl.minimum(tl.exp((gt + 1).to(tl.float32) / UNIT - m),
                                                      1.0)  # fmt: skip
            first, last = _p_cut(cs, lo, hi, 0.0, 0.0, 0.0, tail_h, p, NB, EPS)
            if cs_t > 0:  # the tail is never surely kept; dropped iff its first token surely is
                tot_l = tl.sum(cs.to(tl.float32) * lo)
                if tot_l / tl.maximum(tot_l + tail_h, 1e-30) < p + EPS:
                    last = NB
            p_act = (first < NB) | (cs_t > 0)  # else every survivor is surely kept
            last = tl.maximum(last, first - 1)  # an empty bracket sits at the cut
            pghi = tl.where(first == NB, gt, g_top - first)
            pglo = tl.where(last == NB, TAIL_G, g_top - last)
            n_p = tl.sum(tl.where((j >= first) & (j <= last), hl, 0))
            n_p += tl.where(last == NB, n_tail, 0)
            n_below = tl.sum(tl.where(j > last, cs, 0)) + tl.where(last < NB, cs_t, 0)
        pu = tl.full((), UNIT, tl.float32)
        vp_lo = _edge(pglo, pu)
        vp_hi = _edge(pghi + 1, pu)
        # refinement passes while the brackets hold more than CAP tokens. The counts are exact as
        # the grid's edges are (g / unit exact): beyond |m| >= 2^21 the row goes dense instead
        n_cand = _union(small, k_on, nk, k_abv, vk_lo, vk_hi, p_act, n_p, vp_lo, vp_hi)
        sane = (m < 2097152.0) & (m > -2097152.0)
        n_cand = tl.where(sane, n_cand, CAP + 1)
        level = tl.zeros((), tl.int32)
        go = sane & (n_cand > CAP)
        while go:
            sk = _scale(tl.minimum(kghi - kglo + 1, NB), NB)  # 1: cannot refine
            sp = _scale(tl.minimum(pghi - pglo + 1, NB), NB)
            vk_abs = tl.minimum(tl.maximum(tl.abs(vk_lo), tl.abs(vk_hi)), 1e30)
            vp_abs = tl.minimum(tl.maximum(tl.abs(vp_lo), tl.abs(vp_hi)), 1e30)
            k_ref = k_on & (small == 0) & (nk > CAP // 2) & (kglo > TAIL_G) & (sk > 1)
            k_ref = k_ref & (ku * sk <= MAX_UNIT) & (vk_abs * ku * sk < 16777216.0)
            # top-p's bracket refines when above top-k's (every token in it survives top-k)
            p_ref = p_act & ((k_on == 0) | (vp_lo >= vk_hi)) & (n_p > CAP // 2)
            p_ref = p_ref & (pglo > TAIL_G) & (sp > 1)
            p_ref = p_ref & (pu * sp <= MAX_UNIT) & (vp_abs * pu * sp < 16777216.0)
            if k_ref | p_ref:
                ku2 = ku * sk
                pu2 = pu * sp
                # the survivors below top-p's bracket: exact down to top-k's bracket, whose
                # k - k_abv survivors are bounded by its edges
                vb_lo = tl.where(k_on, vk_hi, float("-inf"))
                kb_n = tl.where(k_on, k - k_abv, 0).to(tl.float32)
                kb_l = kb_n * tl.exp(tl.minimum(vk_lo, m) - m)
                kb_h = kb_n * tl.exp(tl.minimum(vk_hi, m) - m)
                hk, hp, a_m, b_m = _refine(xrow, V, m, k_ref, ku2, kglo * sk, vk_lo, vk_hi, p_ref,
                                           pu2, pglo * sp, vp_lo, vp_hi, vb_lo, NB,
                                           BLOCK)  # fmt: skip
                if k_ref:  # sub-bins ascending: the one holding the k-th token
                    ck = k_abv + tl.cumsum(hk, 0, reverse=True) - hk
                    at = (ck < k) & (ck + hk >= k)
                    kglo = kglo * sk + tl.max(tl.where(at, j, -1))
                    kghi = kglo
                    nk = tl.sum(tl.where(at, hk, 0))
                    k_abv = tl.sum(tl.where(at, ck, 0))
                    ku = ku2
                    vk_lo = _edge(kglo, ku)
                    vk_hi = _edge(kghi + 1, ku)
                if p_ref:  # sub-bins from the top (through the scratch row), exact outer masses
                    tl.store(hrow + j, hp)
                    tl.debug_barrier()
                    hd = tl.load(hrow + (NB - 1 - j))
                    tl.debug_barrier()
                    gd = pglo * sp + (NB - 1) - j
                    gf = gd.to(tl.float32)
                    lo = tl.exp(tl.math.div_rn(gf, pu2) - m)
                    hi = tl.minimum(tl.exp(tl.math.div_rn(gf + 1.0, pu2) - m), 1.0)
                    first, last = _p_cut(hd, lo, hi, a_m, a_m, b_m + kb_l, b_m + kb_h, p, NB, EPS)
                    last = tl.maximum(last, first - 1)
                    pghi = pglo * sp + (NB - 1) - first
                    pglo = pglo * sp + (NB - 1) - last
                    n_p = tl.sum(tl.where((j >= first) & (j <= last), hd, 0))
                    n_below += tl.sum(tl.where(j > last, hd, 0))
                    pu = pu2
                    vp_lo = _edge(pglo, pu)
                    vp_hi = _edge(pghi + 1, pu)
                # a refined top-k bracket may leave few enough survivors to list them all
                small = small | (k_on & p_on & (k_abv + nk <= CAP))
                p_act = p_act & (small == 0)
                n_cand = _union(small, k_on, nk, k_abv, vk_lo, vk_hi, p_act, n_p, vp_lo, vp_hi)
                level += 1
                go = (n_cand > CAP) & (level < MAX_REFINE)
            else:
                go = False
        # the brackets of inactive filters are empty (at +inf); base_k sums every token when
        # top-k is off
        vp_lo = tl.where(small, vk_lo, vp_lo)
        vp_hi = tl.where(small, float("inf"), vp_hi)
        n_below = tl.where(small, 0, n_below)
        p_act = p_act | small
        vk_lo = tl.where(k_on, vk_lo, float("inf"))
        sk_hi = tl.where(k_on, vk_hi, float("-inf"))
        vk_hi = tl.where(k_on, vk_hi, float("inf"))
        d_lo = tl.maximum(
            tl.where(k_on, vk_lo, float("-inf")), tl.where(p_act, vp_lo, float("-inf"))
        )
        lrow = list_ptr + row * CAP
        n = n_cand
        need = k.to(tl.float32)
        base_k = tl.zeros((), tl.float32)
        base_p = tl.zeros((), tl.float32)
        if n_cand <= CAP:
            n, base_k, base_p = _write_decided(xrow, orow, lrow, V, m, d_lo, vk_lo, vk_hi,
                                               tl.where(p_act, vp_lo, float("inf")),
                                               tl.where(p_act, vp_hi, float("inf")), sk_hi, vp_hi,
                                               CAP, THREADS, BLOCK // THREADS)  # fmt: skip
            need = (k - k_abv).to(tl.float32)
        tl.debug_barrier()  # the list, and the decided writes before the list's rewrite
        dense = n > CAP
        go = n >= 0  # true
        while go:
            if dense:  # the whole row is the list: both filters from scratch
                n_l = V
                lo_k = tl.full((), -FLT_MAX, tl.float32)
                hi_k = tl.full((), float("inf"), tl.float32)
                nd = k.to(tl.float32)
                bk = tl.zeros((), tl.float32)
                lo_p = tl.full((), -FLT_MAX, tl.float32)
                hi_p = tl.full((), float("inf"), tl.float32)
                bp = tl.zeros((), tl.float32)
                nb = tl.zeros((), tl.int32)
                pa = p_on
            else:
                n_l = n
                lo_k = vk_lo
                hi_k = vk_hi
                nd = need
                bk = base_k
                lo_p = vp_lo
                hi_p = vp_hi
                bp = base_p
                nb = n_below
                pa = p_act
            thr_k, cut_k, v_p, cut_p, ok = _select(lrow, xrow, n_l, dense, m, k_on, nd, lo_k, hi_k,
                                                   bk, pa, p, lo_p, hi_p, bp, nb, V,
                                                   TILE)  # fmt: skip
            if ok | dense:
                _write_list(orow, lrow, xrow, n_l, dense, m, thr_k, cut_k, v_p, cut_p, TILE)
                go = False
            else:
                dense = True
        if HAS_STATS:
            tl.store(stats_ptr + row * 3 + tl.arange(0, 4),
                     tl.where(tl.arange(0, 4) == 0, level, tl.where(tl.arange(0, 4) == 1, n,
                                                                   dense.to(tl.int32))),
                     mask=tl.arange(0, 4) < 3)  # fmt: skip
    else:
        offs = tl.arange(0, BLOCK)
        for b0 in range(0, V, BLOCK):
            pos = b0 + offs
            tl.store(orow + pos, tl.load(xrow + pos, mask=pos < V), mask=pos < V)


def launch_config(num_bins=64, bins_per_unit=2, cap=4096, block=2048, tile=1024, num_warps=8):
    """The kernel's constexprs and ``num_warps`` for these tuning knobs (see
    :func:`top_k_top_p`); the launcher and the sm_90 build check resolve them here."""
    for name, val, least in (("num_bins", num_bins, 2), ("bins_per_unit", bins_per_unit, 1)):
        if val < least or val & (val - 1):
            raise ValueError(f"{name} must be a power of two >= {least}, got {val}")
    return dict(NB=num_bins, UNIT=float(bins_per_unit), EPS=EPS, CAP=cap, MAX_REFINE=MAX_REFINE,
                MAX_UNIT=MAX_UNIT, BLOCK=block, TILE=tile, THREADS=min(32 * num_warps, block),
                num_warps=num_warps)  # fmt: skip


def top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    num_bins: int = 64,
    bins_per_unit: int = 2,
    cap: int = 4096,
    block: int = 2048,
    tile: int = 1024,
    num_warps: int = 8,
    stats: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`vllm.kernels.sampling.top_k_top_p` on CUDA (or the interpreter).

    Tuning (the result never depends on it): ``num_bins`` / ``bins_per_unit`` (powers of two):
    the first pass's window (64 bins of 1/2: 32 logit units below the max; the tokens beyond
    carry < V · e^-32 of the mass) and every refinement's bins; ``cap``: list entries per row;
    ``block``: the streaming passes' block; ``tile``: the select's tile. ``stats`` ([B, 3] int32,
    for tests and the benchmark) receives per active row the refinement passes, the list size and
    whether the row took the dense fallback."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    cfg = launch_config(num_bins, bins_per_unit, cap, block, tile, num_warps)
    check_cuda_or_interpreter(logits, *(t for t in (top_k, top_p) if t is not None))
    b, v = logits.shape
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        logits = logits.float().contiguous()
    out = torch.empty_like(logits)
    if b == 0 or v == 0:
        return out
    dev = logits.device
    hist = torch.empty(b, num_bins, dtype=torch.int32, device=dev)
    lst = torch.empty(b, cap, dtype=torch.int64, device=dev)
    k_arg = top_k.contiguous() if top_k is not None else hist
    p_arg = top_p.float().contiguous() if top_p is not None else logits
    kern = _top_k_top_p_kernel[(b,)](
        logits, out, k_arg, p_arg, hist, lst, stats if stats is not None else hist, v,
        logits.stride(0), out.stride(0), HAS_K=top_k is not None, HAS_P=top_p is not None,
        HAS_STATS=stats is not None, **cfg,
    )  # fmt: skip
    record("top_k_top_p", kern)
    return out
