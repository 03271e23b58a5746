"""Warp-specialised sparse-MLA attention over bf16 rows for Hopper (sm_90), written in Gluon.

Same function as the Triton kernel ``_sparse_mla_fwd_kernel`` (one query token, all of its heads,
one slice of its top-k list per program) at GLM-5.3's fixed dims: kv_lora 512, rope 64, at most
64 heads. It serves bf16 sparse prefill (flat bf16 context rows) and decode over a bf16 cache;
fp8_ds_mla rows go to the CUDA C++ kernel. What the Triton kernel cannot express and this one
does:

- **A producer partition** (4 warps, 40 registers) gathers the selected rows into a ring of two
  64-row shared-memory stages with ``cp.async`` (16-byte pieces, zero-filled for −1 slots),
  16 rows per batch so that one batch's 64-bit addresses fit its registers. It holds no row in
  registers: each thread's copies arrive on the stage's ``ready`` barrier when they land.
- **Two consumer warpgroups in the seesaw schedule** (:func:`_seesaw_consumer`, after
  FlashMLA's dense decode kernel): blocks come in pairs and each warpgroup scores its own block
  of the pair (64-wide wgmmas: the query is read from shared memory once per block, not twice as
  when both warpgroups score half of one block), and owns half of the 512 value columns. One
  warpgroup's softmax runs while the other's matmuls do; they exchange row maxima and P through
  shared memory, P living in its block's rope slot (free once the block's scores are done), so
  the query and two stages take 216 KB. Against both warpgroups sharing each block: prefill
  364.8 vs 353.7 TFLOP/s at 8192 queries × 32K, 332.2 vs 301.1 at 32768 × 128K (H200).
- **The top-k ids in shared memory** (``IDX_SMEM``): the slice's ids (up to ``IDX_CAP`` = 2048,
  8 KB) are loaded once before the fork. Read from global memory, each 16-row batch's ids were a
  dependent round trip before its copies could be issued (~2 µs to issue one 64-row block), and
  the consumers waited for rows: a steady pair of blocks took 6.49 µs, 4.86 µs with the ids in
  shared memory (8192 × 32K; kernel 6.31 → 5.46 ms). A slice longer than ``IDX_CAP`` reads them
  from global memory.
- **The query by cp.async** (``Q_ASYNC``), arriving on its own barrier, so the first blocks'
  copies are in flight with it: the prologue went from 2.56 to 0.77 µs per program. A query
  that cannot be copied in aligned 16-byte bf16 pieces is loaded and stored before the fork.
- **Partitions and registers**: the producer is the default partition and the consumers are
  worker partitions. ptxas holds the default partition's code to the launch's register count
  (65536 / 384 threads = 168) while a worker gets its ``setmaxnreg`` count (232 beside the
  40-register producer): a consumer warpgroup in the default partition spilled 169 instructions'
  worth where the same code as a worker spilled 2.

Scores use an online base-2 softmax exactly as the Triton kernel (same masking, same −inf/zero
conventions for tokens without a valid row), so the merge of split-K slices is shared.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

D_NOPE = gl.constexpr(512)
D_ROPE = gl.constexpr(64)
BLOCK_H = gl.constexpr(64)  # heads per program: all of a token's
BLOCK_N = gl.constexpr(64)  # rows per block; blocks come in pairs, one per consumer warpgroup
NUM_STAGES = gl.constexpr(2)  # one pair of blocks: with the query they fill the shared memory
COPY_ROWS = gl.constexpr(16)  # rows per cp.async batch of the producer
IDX_CAP = gl.constexpr(2048)  # top-k ids of one slice staged in shared memory (8 KB)
PRODUCER_WARPS = gl.constexpr(4)  # the default partition: the launch's num_warps
_THREADS = 32 * (PRODUCER_WARPS.value + 8)  # and two consumer warpgroups: 384
# registers per thread at launch: the register file (64K) over the threads, rounded down to a
# multiple of 8 (168); setmaxnreg then rebalances: the consumers ask for what a 40-register
# producer leaves (232), and the compiler gives the producer what they leave
LAUNCH_REGS = 65536 // _THREADS // 8 * 8
PRODUCER_REGS = 40
_CONSUMER_POOL = LAUNCH_REGS * _THREADS - 32 * PRODUCER_WARPS.value * PRODUCER_REGS
CONSUMER_REGS = gl.constexpr(_CONSUMER_POOL // 256 // 8 * 8)
PAIR_ROWS = 2 * BLOCK_N.value  # a top-k slice is a whole number of pairs of blocks
D_QK = D_NOPE.value + D_ROPE.value  # a query's and a row's width: 576


@gluon.jit
def _producer(
    kv_ptr, idx_ptr, kv_s, kr_s, ready, empty, t, split, topk, k_per_split, stride_it,
    row_stride, idx_s, IDX_SMEM: gl.constexpr,
):  # fmt: skip
    """Gather block i's rows into stage i % NUM_STAGES once both warpgroups have released it."""
    n_blocks = k_per_split // BLOCK_N
    k_lo = split * k_per_split
    idx_row = idx_ptr + t * stride_it + k_lo
    k_lim = gl.minimum(k_per_split, topk - k_lo)
    VR: gl.constexpr = COPY_ROWS * 64 // (PRODUCER_WARPS * 32)
    nl: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [PRODUCER_WARPS, 1], [1, 0])
    rl: gl.constexpr = gl.BlockedLayout([1, VR], [VR // 2, 64 // VR], [PRODUCER_WARPS, 1], [1, 0])
    rows = gl.arange(0, COPY_ROWS, layout=gl.SliceLayout(1, nl))
    dn = gl.arange(0, D_NOPE, layout=gl.SliceLayout(0, nl))
    rows_r = gl.arange(0, COPY_ROWS, layout=gl.SliceLayout(1, rl))
    dr = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, rl))
    for i in range(n_blocks):
        st = i % NUM_STAGES
        kv_st = kv_s.index(st)  # [BLOCK_N, D_NOPE]
        kr_st = kr_s.index(st)  # [BLOCK_N, D_ROPE]
        mbarrier.wait(empty.index(st), ((i // NUM_STAGES) & 1) ^ 1)
        for r0 in gl.static_range(0, BLOCK_N, COPY_ROWS):
            rid = _batch_ids(idx_row, idx_s, i, r0, rows, k_lim, gl.SliceLayout(1, nl), IDX_SMEM)
            row = kv_ptr + rid.to(gl.int64) * row_stride
            async_copy.async_copy_global_to_shared(
                kv_st.slice(r0, COPY_ROWS, dim=0),
                row[:, None] + dn[None, :],
                mask=(rid >= 0)[:, None],
            )
            rid_r = _batch_ids(idx_row, idx_s, i, r0, rows_r, k_lim, gl.SliceLayout(1, rl),
                               IDX_SMEM)  # fmt: skip
            row_r = kv_ptr + rid_r.to(gl.int64) * row_stride + D_NOPE
            async_copy.async_copy_global_to_shared(
                kr_st.slice(r0, COPY_ROWS, dim=0),
                row_r[:, None] + dr[None, :],
                mask=(rid_r >= 0)[:, None],
            )
        async_copy.mbarrier_arrive(ready.index(st), increment_count=False)


@gluon.jit
def _load_query(q_ptr, t, stride_qt, stride_qh, num_heads, q_nope_s, q_rope_s):
    """The query (all heads of token t) into shared memory as bf16, once; then the fence and
    barrier that publish it (and the barrier inits before it) to every partition."""
    ql: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ql))
    dn = gl.arange(0, D_NOPE, layout=gl.SliceLayout(0, ql))
    dr = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, ql))
    q_rows = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    hmask = (heads < num_heads)[:, None]
    q_nope_s.store(gl.load(q_rows + dn[None, :], mask=hmask, other=0.0).to(gl.bfloat16))
    q_rope_s.store(gl.load(q_rows + D_NOPE + dr[None, :], mask=hmask, other=0.0).to(gl.bfloat16))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _load_query_async(q_ptr, t, stride_qt, stride_qh, num_heads, q_nope_s, q_rope_s, qbar):
    """The query by ``cp.async`` (16-byte pieces, zero-filled past ``num_heads``), not waited
    for: each default-partition thread's copies arrive on ``qbar`` when they land, so the
    producer's first blocks are in flight together with the query and the consumers wait on
    ``qbar`` before their first QK. The fence and barrier publish the barrier inits."""
    fence_async_shared()
    gl.thread_barrier()
    QH: gl.constexpr = 16  # heads per batch: 8 pieces per thread at 4 warps
    nl: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    rl: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [gl.num_warps(), 1], [1, 0])
    hn = gl.arange(0, QH, layout=gl.SliceLayout(1, nl))
    dn = gl.arange(0, D_NOPE, layout=gl.SliceLayout(0, nl))
    for h0 in gl.static_range(0, BLOCK_H, QH):
        rows = q_ptr + t * stride_qt + (h0 + hn)[:, None] * stride_qh
        async_copy.async_copy_global_to_shared(
            q_nope_s.slice(h0, QH, dim=0), rows + dn[None, :], mask=((h0 + hn) < num_heads)[:, None]
        )
    hr = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rl))
    dr = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, rl))
    async_copy.async_copy_global_to_shared(
        q_rope_s,
        q_ptr + t * stride_qt + hr[:, None] * stride_qh + D_NOPE + dr[None, :],
        mask=(hr < num_heads)[:, None],
    )
    async_copy.mbarrier_arrive(qbar, increment_count=False)


@gluon.jit
def _query(q_ptr, t, stride_qt, stride_qh, num_heads, q_nope_s, q_rope_s, qbar,
           Q_ASYNC: gl.constexpr):  # fmt: skip
    """The query into shared memory: by cp.async arriving on ``qbar`` (Q_ASYNC), or loaded and
    stored by the default partition before the partitions fork."""
    if Q_ASYNC:
        mbarrier.init(qbar, count=gl.num_warps() * 32)
        _load_query_async(q_ptr, t, stride_qt, stride_qh, num_heads, q_nope_s, q_rope_s, qbar)
    else:
        _load_query(q_ptr, t, stride_qt, stride_qh, num_heads, q_nope_s, q_rope_s)


@gluon.jit
def _stage_ids(idx_ptr, t, stride_it, split, k_per_split, topk, IDX_SMEM: gl.constexpr):
    """Allocate ``idx_s`` and, with IDX_SMEM, load the slice's top-k ids into it (−1 past its
    end; [IDX_CAP / BLOCK_N, BLOCK_N], one row per block) and publish them before the fork, so the
    producer's and consumers' id reads are shared-memory reads, not a dependent global round
    trip per batch of rows. Without IDX_SMEM ``idx_s`` is a one-row dummy."""
    rows: gl.constexpr = IDX_CAP // BLOCK_N if IDX_SMEM else 1
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    idx_s = gl.allocate_shared_memory(gl.int32, [rows, BLOCK_N], flat)
    if IDX_SMEM:
        il: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
        kk = gl.arange(0, IDX_CAP, layout=il)
        k_lo = split * k_per_split
        k_lim = gl.minimum(k_per_split, topk - k_lo)
        ids = gl.load(idx_ptr + t * stride_it + k_lo + kk, mask=kk < k_lim, other=-1)
        idx_s._reinterpret(gl.int32, [IDX_CAP], flat).store(ids)
        gl.thread_barrier()
    return idx_s


@gluon.jit
def _batch_ids(idx_row, idx_s, blk, r0: gl.constexpr, rows, k_lim, lay: gl.constexpr,
               IDX_SMEM: gl.constexpr):  # fmt: skip
    """The ids of rows r0 + ``rows`` of block ``blk`` of the slice (``rows``: arange(COPY_ROWS)
    in layout ``lay``; −1 past k_lim): from ``idx_s`` (IDX_SMEM) or global memory."""
    if IDX_SMEM:
        return idx_s.index(blk).slice(r0, COPY_ROWS).load(lay)
    else:
        kk = blk * BLOCK_N + r0 + rows
        return gl.load(idx_row + kk, mask=kk < k_lim, other=-1)


@gluon.jit
def _seesaw_consumer(
    q_nope_s, q_rope_s, kv_s, kr_s, ready, empty, xbar, m0buf, m1buf, l0buf, l1buf,
    idx_ptr, out_ptr, lse_ptr, t, split, scale_log2, num_heads, topk, k_per_split,
    stride_it, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, qbar, idx_s,
    ROLE: gl.constexpr, Q_ASYNC: gl.constexpr, IDX_SMEM: gl.constexpr,
):  # fmt: skip
    """One of the two consumer warpgroups (``ROLE`` 0 or 1).

    Blocks come in pairs (2j in stage 0, 2j+1 in stage 1). Warpgroup r computes the full scores
    of block 2j+r (N = 64 per wgmma, Q read once per block), and owns value columns
    [256·r, 256·r + 256) of the output. Per pair, with m the running row max:
      0: S0 = Q·K0ᵀ; m0 = max(m, rowmax S0); P0 = exp2(S0 − m0) -> shared (K0's rope slot, free
         once S0 is done), m0 -> shared; O_L = O_L·2^(m−m0) + P0·V0_L; then, given m1 from 1,
         O_L = O_L·2^(m0−m1) + P1·V1_L.
      1: S1 = Q·K1ᵀ; given m0: m1 = max(m0, rowmax S1); P1 = exp2(S1 − m1) -> shared, m1 ->
         shared; O_R = (O_R·2^(m−m0) + P0·V0_R)·2^(m0−m1) + P1·V1_R.
    So each warpgroup's softmax runs while the other's wgmmas do, and the two exchange only the
    row maxima and P through shared memory (barriers ``xbar[r]``: "m_r and P_r are written")."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D_NOPE // 2, 16]
    )
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    n_pairs = k_per_split // 128
    k_lo = split * k_per_split
    idx_row = idx_ptr + t * stride_it + k_lo
    k_lim = gl.minimum(k_per_split, topk - k_lo)
    c0: gl.constexpr = ROLE * (D_NOPE // 2)

    acc = gl.zeros([BLOCK_H, D_NOPE // 2], gl.float32, o_layout)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_H], gl.float32, row_s)
    # the block's row ids are loaded one per thread and then spread to the score layout (a load
    # in that layout keeps 16 64-bit addresses per thread live across the loop: spills)
    il: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    ci = gl.arange(0, 64, layout=il)
    if Q_ASYNC:
        mbarrier.wait(qbar, 0)
    for j in range(n_pairs):
        ph = j & 1
        if IDX_SMEM:
            rid = idx_s.index(2 * j + ROLE).load(gl.SliceLayout(0, s_layout))
        else:
            kk = j * 128 + ROLE * 64 + ci
            rid = gl.load(idx_row + kk, mask=kk < k_lim, other=-1)
            rid = gl.convert_layout(rid, gl.SliceLayout(0, s_layout))
        mbarrier.wait(ready.index(ROLE), ph)
        # a stage index the compiler cannot hoist (j < 2^30): with a constant one, ptxas keeps
        # the 36 loop-invariant wgmma descriptors of this block's QK across the loop and spills
        # them (604 instead of 176 bytes of spill stores)
        z = j >> 30
        own = ROLE + z
        s = gl.zeros([BLOCK_H, 64], gl.float32, s_layout)
        s = warpgroup_mma(
            q_nope_s, kv_s.index(own).permute((1, 0)), s, use_acc=False, is_async=True
        )
        s = warpgroup_mma(q_rope_s, kr_s.index(own).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        s = gl.where((rid >= 0)[None, :], s * scale_log2, float("-inf"))
        if ROLE == 0:
            m0 = gl.maximum(m_i, gl.max(s, axis=1))
            m0_safe = gl.where(m0 == float("-inf"), 0.0, m0)
            p = gl.exp2(s - m0_safe[:, None])
            sc0 = gl.exp2(m_i - m0_safe)
            l_i = l_i * sc0 + gl.sum(p, axis=1)
        else:
            mbarrier.wait(xbar.index(0), ph)
            m0 = m0buf.load(row_s)
            m0_safe = gl.where(m0 == float("-inf"), 0.0, m0)
            sc0 = gl.exp2(m_i - m0_safe)
            m1 = gl.maximum(m0, gl.max(s, axis=1))
            m1_safe = gl.where(m1 == float("-inf"), 0.0, m1)
            sc1 = gl.exp2(m0 - m1_safe)
            p = gl.exp2(s - m1_safe[:, None])
            l_i = l_i * (sc0 * sc1) + gl.sum(p, axis=1)
            m1buf.store(m1)
        # P_r into block 2j+r's rope slot (its scores are done), then tell the other warpgroup
        kr_s.index(ROLE).store(p.to(gl.bfloat16))
        if ROLE == 0:
            m0buf.store(m0)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(xbar.index(ROLE))
        acc = acc * gl.convert_layout(sc0, row_o)[:, None]
        if ROLE == 0:
            # O_L += P0·V0_L, then (once m1 and P1 are there) rescale and O_L += P1·V1_L
            acc = warpgroup_mma(kr_s.index(z), kv_s.index(z).slice(c0, D_NOPE // 2, dim=1), acc,
                                is_async=True)  # fmt: skip
            mbarrier.wait(xbar.index(1), ph)
            m1 = m1buf.load(row_s)
            m1_safe = gl.where(m1 == float("-inf"), 0.0, m1)
            sc1 = gl.exp2(m0 - m1_safe)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()
            mbarrier.arrive(empty.index(0))
            l_i = l_i * sc1
            acc = acc * gl.convert_layout(sc1, row_o)[:, None]
            acc = warpgroup_mma(kr_s.index(1 + z), kv_s.index(1 + z).slice(c0, D_NOPE // 2, dim=1),
                                acc, is_async=True)  # fmt: skip
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()
            mbarrier.arrive(empty.index(1))
            m_i = m1
        else:
            # O_R = (O_R·sc0 + P0·V0_R)·sc1 + P1·V1_R (P0 was written before xbar[0] completed)
            acc = warpgroup_mma(kr_s.index(z), kv_s.index(z).slice(c0, D_NOPE // 2, dim=1), acc,
                                is_async=True)  # fmt: skip
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()
            mbarrier.arrive(empty.index(0))
            acc = acc * gl.convert_layout(sc1, row_o)[:, None]
            acc = warpgroup_mma(kr_s.index(1 + z), kv_s.index(1 + z).slice(c0, D_NOPE // 2, dim=1),
                                acc, is_async=True)  # fmt: skip
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()
            mbarrier.arrive(empty.index(1))
            m_i = m1

    # the row sums: each warpgroup has those of its own blocks, relative to the same final max
    if ROLE == 0:
        l0buf.store(l_i)
    else:
        l1buf.store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(xbar.index(2 + ROLE))
    mbarrier.wait(xbar.index(3 - ROLE), 0)
    if ROLE == 0:
        l_tot = l_i + l1buf.load(row_s)
    else:
        l_tot = l_i + l0buf.load(row_s)
    has = l_tot > 0.0
    l_safe = gl.where(has, l_tot, 1.0)
    out = acc / gl.convert_layout(l_safe, row_o)[:, None]
    heads_o = gl.arange(0, BLOCK_H, layout=row_o)
    dn = c0 + gl.arange(0, D_NOPE // 2, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = (
        out_ptr + split * stride_os + t * stride_ot + heads_o[:, None] * stride_oh + dn[None, :]
    )
    gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(heads_o < num_heads)[:, None])
    if ROLE == 0:
        lse = gl.where(has, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        heads_s = gl.arange(0, BLOCK_H, layout=row_s)
        gl.store(
            lse_ptr + split * stride_ls + t * stride_lt + heads_s, lse, mask=heads_s < num_heads
        )


# one entry per role: a partition's arguments reach it as run-time values, and the role must be a
# constexpr (it selects code paths and the value columns' slice)
@gluon.jit
def _seesaw_wg0(q_nope_s, q_rope_s, kv_s, kr_s, ready, empty, xbar, m0buf, m1buf, l0buf, l1buf,
                idx_ptr, out_ptr, lse_ptr, t, split, scale_log2, num_heads, topk, k_per_split,
                stride_it, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, qbar, idx_s,
                Q_ASYNC: gl.constexpr, IDX_SMEM: gl.constexpr):  # fmt: skip
    _seesaw_consumer(q_nope_s, q_rope_s, kv_s, kr_s, ready, empty, xbar, m0buf, m1buf, l0buf,
                     l1buf, idx_ptr, out_ptr, lse_ptr, t, split, scale_log2, num_heads, topk,
                     k_per_split, stride_it, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                     qbar, idx_s, 0, Q_ASYNC, IDX_SMEM)  # fmt: skip


@gluon.jit
def _seesaw_wg1(q_nope_s, q_rope_s, kv_s, kr_s, ready, empty, xbar, m0buf, m1buf, l0buf, l1buf,
                idx_ptr, out_ptr, lse_ptr, t, split, scale_log2, num_heads, topk, k_per_split,
                stride_it, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, qbar, idx_s,
                Q_ASYNC: gl.constexpr, IDX_SMEM: gl.constexpr):  # fmt: skip
    _seesaw_consumer(q_nope_s, q_rope_s, kv_s, kr_s, ready, empty, xbar, m0buf, m1buf, l0buf,
                     l1buf, idx_ptr, out_ptr, lse_ptr, t, split, scale_log2, num_heads, topk,
                     k_per_split, stride_it, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                     qbar, idx_s, 1, Q_ASYNC, IDX_SMEM)  # fmt: skip


@gluon.jit
def _sparse_mla_seesaw_kernel(
    q_ptr,  # [T, H, D_NOPE + D_ROPE]
    kv_ptr,  # bf16 [num_rows, row_stride]
    idx_ptr,  # int32 [T, topk], −1 = no row
    out_ptr,  # [splits, T, H, D_NOPE]
    lse_ptr,  # fp32 [splits, T, H]
    scale_log2, num_heads, topk, k_per_split,
    stride_qt, stride_qh, stride_it, row_stride, stride_os, stride_ot, stride_oh, stride_ls,
    stride_lt, Q_ASYNC: gl.constexpr, IDX_SMEM: gl.constexpr,
):  # fmt: skip
    """Program (t, split): token t's heads over top-k slice ``split``. Default partition = the
    producer, workers = the two consumer warpgroups. Each pair of blocks' P lives in the rope
    slots of its two stages, so shared memory is Q + 2 stages (216 KB) + the ids (8 KB)."""
    t = gl.program_id(0).to(gl.int64)
    split = gl.program_id(1)
    big: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_nope_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_NOPE], big)
    q_rope_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_ROPE], big)
    kv_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_N, D_NOPE], big)
    kr_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_N, D_ROPE], big)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    m0buf = gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat)
    m1buf = gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat)
    l0buf = gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat)
    l1buf = gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    # xbar[r]: warpgroup r's row max and P are written; xbar[2 + r]: its row sums are
    xbar = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(4):
        mbarrier.init(xbar.index(s), count=1)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=PRODUCER_WARPS * 32)  # each producer thread's copies
        mbarrier.init(empty.index(s), count=2)  # both consumer warpgroups
    qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    _query(q_ptr, t, stride_qt, stride_qh, num_heads, q_nope_s, q_rope_s, qbar, Q_ASYNC)
    idx_s = _stage_ids(idx_ptr, t, stride_it, split, k_per_split, topk, IDX_SMEM)

    # the argument tuples are written out: a tuple bound to a name first holds its constexprs
    # as run-time values (the partitions would then branch on the flags)
    gl.warp_specialize(
        [
            (_producer, (
                kv_ptr, idx_ptr, kv_s, kr_s, ready, empty, t, split, topk, k_per_split, stride_it,
                row_stride, idx_s, IDX_SMEM,
            )),
            (_seesaw_wg0, (
                q_nope_s, q_rope_s, kv_s, kr_s, ready, empty, xbar, m0buf, m1buf, l0buf, l1buf,
                idx_ptr, out_ptr, lse_ptr, t, split, scale_log2, num_heads, topk, k_per_split,
                stride_it, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, qbar, idx_s,
                Q_ASYNC, IDX_SMEM,
            )),
            (_seesaw_wg1, (
                q_nope_s, q_rope_s, kv_s, kr_s, ready, empty, xbar, m0buf, m1buf, l0buf, l1buf,
                idx_ptr, out_ptr, lse_ptr, t, split, scale_log2, num_heads, topk, k_per_split,
                stride_it, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, qbar, idx_s,
                Q_ASYNC, IDX_SMEM,
            )),
        ],
        [4, 4],
        [CONSUMER_REGS, CONSUMER_REGS],
    )  # fmt: skip


@functools.lru_cache(maxsize=4)
def is_supported_device(device_index: int) -> bool:
    """Hopper (sm_90) only: the kernel issues wgmma."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def launch_config(q_async: bool = True, idx_smem: bool = True) -> tuple:
    """(kernel, launch metadata): the constexprs, ``num_warps`` and ``maxnreg`` the launcher
    passes. The launcher clears ``q_async`` when the query cannot go by cp.async and
    ``idx_smem`` when a top-k slice is longer than ``IDX_CAP``; ``tools/aot_sm90.py``
    and the build test compile exactly this."""
    meta = dict(
        Q_ASYNC=q_async, IDX_SMEM=idx_smem, num_warps=PRODUCER_WARPS.value, maxnreg=LAUNCH_REGS
    )
    return _sparse_mla_seesaw_kernel, meta


def _query_copyable(q: torch.Tensor) -> bool:
    """cp.async moves aligned 16-byte pieces of bf16."""
    return (
        q.dtype == torch.bfloat16 and q.stride(2) == 1 and q.data_ptr() % 16 == 0
        and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0
    )  # fmt: skip


def sparse_mla_ws(
    q: torch.Tensor,
    kv_rows: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    out_dtype: torch.dtype,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over bf16 rows, split-K partials.

    q [T, H <= 64, 576] (512 latent + 64 rope; last dim contiguous; bf16, or any float that the
    kernel then loads and rounds to bf16); kv_rows bf16 [num_rows, row_stride >= 576], last dim
    contiguous, rows 16-byte aligned; indices [T, K] int32 row numbers, last dim contiguous,
    −1 = no row. The top-k list is cut into ``num_splits`` slices (each a multiple of 128 rows,
    so fewer slices when K is short). Returns part_o [splits, T, H, 512] (``out_dtype`` for one
    slice, fp32 otherwise) and part_l [splits, T, H] fp32: each slice's normalised output and
    natural-log LSE (−inf, zeros where a slice has no valid row), merged like the Triton
    kernel's partials."""
    t, h, d = q.shape
    if d != D_QK or h > BLOCK_H.value or q.stride(2) != 1:
        raise ValueError(f"q must be [T, <= 64, {D_QK}], last dim contiguous, got {tuple(q.shape)}")
    if (
        kv_rows.dtype != torch.bfloat16 or kv_rows.dim() != 2 or kv_rows.shape[1] < D_QK
        or kv_rows.stride(1) != 1 or kv_rows.data_ptr() % 16 or kv_rows.stride(0) % 8
    ):  # fmt: skip
        raise ValueError(f"kv_rows must be bf16 [num_rows, >= {D_QK}] with 16-byte aligned rows")
    if indices.dtype != torch.int32 or indices.dim() != 2 or indices.shape[0] != t:
        raise ValueError(f"indices must be int32 [{t}, K], got {indices.dtype} {indices.shape}")
    if indices.stride(1) != 1:
        raise ValueError("indices must have a contiguous last dim")
    k = indices.shape[1]
    k_per_split = triton.cdiv(triton.cdiv(max(k, 1), num_splits), PAIR_ROWS) * PAIR_ROWS
    kernel, meta = launch_config(q_async=_query_copyable(q), idx_smem=k_per_split <= IDX_CAP.value)
    splits = max(1, triton.cdiv(k, k_per_split))
    odt = torch.float32 if splits > 1 else out_dtype
    part_o = torch.empty(splits, t, h, D_NOPE.value, dtype=odt, device=q.device)
    part_l = torch.empty(splits, t, h, dtype=torch.float32, device=q.device)
    kernel[(t, splits)](
        q, kv_rows, indices, part_o, part_l, sm_scale * 1.4426950408889634, h, k, k_per_split,
        q.stride(0), q.stride(1), indices.stride(0), kv_rows.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l.stride(0), part_l.stride(1),
        **meta,
    )  # fmt: skip
    return part_o, part_l
