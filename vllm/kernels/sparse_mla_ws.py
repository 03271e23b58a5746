"""Warp-specialised sparse-MLA attention for Hopper (sm_90), written in Gluon.

Same function as :func:`vllm.kernels.sparse_mla_fwd.sparse_mla_fwd` (one query token, all 64
heads of it, one slice of its top-k list per program), at GLM-5.3's fixed dims: kv_lora 512,
rope 64. What the Triton kernel cannot express and this one does:

- **A producer partition** (``PRODUCER_WARPS`` warps, few registers) gathers the selected rows
  into a ring of ``NUM_STAGES`` shared-memory stages while the consumers compute:
  - bf16 rows with ``cp.async`` (16-byte pieces, zero-filled for −1 slots), each thread's copies
    signalling the stage's ``ready`` barrier when they land;
  - fp8_ds_mla rows, by default *staged* (:func:`_produce_fp8_staged`): ``cp.async`` puts the
    raw bytes into the upper half of the stage's own bf16 buffer (a row's 512 bytes per warp
    instruction, ``WIDE_COPY``; the tile scales 4 bytes per thread, ``SCALE_BYTES``), and the
    rows are expanded in place to bf16 (e4m3 · the tile's fp32 scale, :func:`_expand_stage`) by
    the consumers while the previous block's PV runs (``FP8_CONSUMER_EXPAND``), or by the
    producer before it signals. Either way the producer holds no row in registers, so it runs
    in 40 registers and leaves the consumers 232. The older register path (rows loaded into
    registers, two chunks in flight, 120 registers) stays as ``fp8_staged=False``.
- **Two consumer warpgroups**, each owning 256 of the 512 value columns, in one of three schedules:
  - ``split`` (fp8_ds_mla rows): both warpgroups work on the same block, each scoring half of its
    columns; they issue PV of block i, wait for it and release block i's stage to the producer
    (``empty`` barrier), then wait for block i+1 and issue its QK (``EARLY_RELEASE``; holding the
    stage until block i+1 was ready serialised the FP8 producer's refill after it: 1.106 vs
    0.979 ms at T=1024, per-block cycle counts from ``trace=``). The softmax sums stay per
    column slot until the end, so the warpgroups exchange only the row max per block. (Issuing
    QK first measured 12-15 % slower: with two stages the consumer then waits for the refill of
    the stage it has just released.)
  - ``seesaw`` (bf16 rows; :func:`_seesaw_consumer`, after FlashMLA's dense decode kernel):
    blocks come in pairs and each warpgroup scores its own block of the pair (64-wide wgmmas,
    the query read once per block instead of twice), so one warpgroup's softmax runs while the
    other's matmuls do; they exchange row maxima and P through shared memory. With two stages the
    pair's second block is needed as soon as its stage is released, so the FP8 producer's load
    plus dequantisation is exposed there (1.156 vs 1.088 ms for ``split`` at T=1024), hence
    ``split`` for FP8 rows.
  - ``asym`` (FP8 rows, :func:`_asym_scorer` / :func:`_asym_expander`): one warpgroup scores
    block i (QK at N = 64, so Q is read once per block, not twice; full-row softmax, no row-max
    exchange), the other expands the FP8 rows; both do PV on their value columns. The
    expander's order per block (``ASYM_ORDER``): ``expand_first`` expands block i+1 while the
    scorer scores block i, but releases stage i only after both, so the stage's refill (copies
    issued ~1,460 cycles, landed, expanded ~1,620) is exposed: the expander waits ~2,750 cycles
    per block for copies, the scorer ~1,950 for expanded blocks. ``pv_first`` (the default) does
    PV_i and releases stage i first: the refill is hidden (~190 cycles of copy wait) but the
    expansion no longer overlaps the scorer's QK. Neither beats ``split`` at many waves (T=1024:
    0.934 / 0.965 vs 0.906 ms), but ``pv_first`` does on launches of at most one program per SM
    (T=64: 62.1 vs 64.6 µs), where it is the default (``FP8_ONE_WAVE_SCHEDULE``). ``ASYM_HALVES``
    signals the scorer once value columns 0-255 are expanded, so their part of S overlaps the
    rest of the expansion: level or slower (the expansion, sharing shared-memory bandwidth with
    that QK, took 2,774 cycles instead of ~1,625). In 32-row blocks and 4 stages
    (``ASYM_BLOCK_N``) the refill is hidden but QK is back at N = 32 and one warpgroup's
    expansion is the limit: slower (1.050 vs 0.951 ms at T=1024).
- **The top-k ids in shared memory** (``IDX_SMEM``): the slice's ids (up to ``IDX_CAP`` = 2048,
  8 KB) are loaded once before the fork; the producer's per-batch id reads were dependent global
  round trips (~2 µs to issue one 64-row block), which left the seesaw consumers waiting for
  rows: 6.60 → 4.86 µs per pair of blocks at 8192 × 32K (``trace_sparse_mla_ws.py``). The split
  schedule makes room by putting P in the block's rope slot (as the seesaw does); the FP8 seesaw
  has no room (233 KB) and reads ids from global memory.
- **The query by cp.async** (``Q_ASYNC``), arriving on its own barrier, so the first blocks'
  copies are in flight with it (the query load took 2.6 µs of each program before).
- **Partitions and registers**: the producer is the default partition and the consumers are
  worker partitions: in local sm_90a compiles (``benchmarks/kernels/aot_sm90.py``) ptxas held
  the default partition's code to the launch's register count (65536 / 384 threads = 168) while
  a worker got its ``setmaxnreg`` count (232 beside a 40-register producer): a consumer
  warpgroup in the default partition spilled 169 instructions' worth where the same code as a
  worker spilled 2.

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
BLOCK_H = gl.constexpr(64)


TRACE_SLOTS = gl.constexpr(16)


@gluon.jit
def _stamp(trace_ptr, row, slot: gl.constexpr, TRACE: gl.constexpr):
    """TRACE: the GPU's nanosecond timer (``%globaltimer``) into trace[row, slot]; slot 15 also
    gets the SM id. For the per-phase timeline of ``benchmarks/kernels/trace_sparse_mla_ws.py``."""
    if TRACE:
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        zero = gl.full([1], 0, gl.int32, lay)
        ts = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [zero], dtype=gl.int64,
                                       is_pure=False, pack=1)  # fmt: skip
        one = gl.arange(0, 1, layout=lay)
        gl.store(trace_ptr + row * TRACE_SLOTS + slot + one, ts)
        if slot == 0:
            sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [zero], dtype=gl.int32,
                                           is_pure=False, pack=1)  # fmt: skip
            gl.store(trace_ptr + row * TRACE_SLOTS + 15 + one, sm.to(gl.int64))


@gluon.jit
def _clk(TRACE: gl.constexpr):
    """TRACE: the SM's cycle counter (a [1] int64 tensor); else 0."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    zero = gl.full([1], 0, gl.int32, lay)
    if TRACE:
        return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [zero], dtype=gl.int64,
                                         is_pure=False, pack=1)  # fmt: skip
    else:
        return zero.to(gl.int64)


@gluon.jit
def _put(trace_ptr, row, slot: gl.constexpr, val, TRACE: gl.constexpr):
    if TRACE:
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        one = gl.arange(0, 1, layout=lay)
        gl.store(trace_ptr + row * TRACE_SLOTS + slot + one, val)


@gluon.jit
def _qk(q_nope_s, q_rope_s, kv_st, kr_st, s_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """Issue S = Q·Kᵀ (nope + rope) asynchronously; the caller waits."""
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q_nope_s, kv_st.permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma(q_rope_s, kr_st.permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _softmax(s, rid, m_i, l2, scale_log2):
    """Online base-2 softmax step: returns p (fp32), the new row max, the rescale and the running
    sums. The sums stay per column slot ([H, BLOCK_N], reduced once at the end) so the two
    warpgroups exchange only the row max per block, not the sum too."""
    s = gl.where((rid >= 0)[None, :], s * scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe[:, None])
    l2 = l2 * alpha[:, None] + p
    return p, m_new, l2, alpha


@gluon.jit
def _issue_pv(p, acc, p_s, kr_s, kv_s, st, IDX_SMEM: gl.constexpr):
    """P (bf16) to shared memory, then issue acc += P·V of stage st (async). With IDX_SMEM P goes
    to the stage's rope slot, once both warpgroups' QK (which read it) are done."""
    if IDX_SMEM:
        gl.thread_barrier()  # both warpgroups' S of this stage, which read the rope slot, are done
        kr_s.index(st).store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        return warpgroup_mma(kr_s.index(st), kv_s.index(st), acc, is_async=True)
    else:
        p_s.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        return warpgroup_mma(p_s, kv_s.index(st), acc, is_async=True)


@gluon.jit
def _consumer(
    q_nope_s, q_rope_s, kv_s, kr_s, p_s, ready, empty,
    idx_ptr, out_ptr, lse_ptr, t, split, scale_log2, num_heads, topk, k_per_split,
    stride_it, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, qbar, idx_s,
    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, Q_ASYNC: gl.constexpr, IDX_SMEM: gl.constexpr,
    trace_ptr, trace_row, TRACE: gl.constexpr, EARLY_RELEASE: gl.constexpr,
    sc_s, CONSUMER_EXPAND: gl.constexpr, DEQUANT: gl.constexpr,
):  # fmt: skip
    """The ``split`` schedule's two consumer warpgroups (one partition). With IDX_SMEM the ids
    come from ``idx_s`` and P_i goes to block i's rope slot (free once both warpgroups' S_i is
    done; ``p_s`` is then unused), which leaves the shared memory for the ids. With
    CONSUMER_EXPAND the stages hold raw FP8 rows: the consumers expand block i+1
    (:func:`_expand_stage`, all 256 threads) while PV_i runs on the tensor cores, then release
    stage i (the early-release order)."""
    # [64 rows, 64 bytes] over the 8 warps: 16 bytes per thread
    xl: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [8, 1], [1, 0])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D_NOPE // 2, 16]
    )
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    n_blocks = k_per_split // BLOCK_N
    k_lo = split * k_per_split
    idx_row = idx_ptr + t * stride_it + k_lo

    acc = gl.zeros([BLOCK_H, D_NOPE], gl.float32, o_layout)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_s)
    l2 = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
    k_lim = gl.minimum(k_per_split, topk - k_lo)  # valid top-k positions of this slice

    # prologue: S_0 and its softmax; the ids of block 1 are fetched a block ahead
    if IDX_SMEM:
        rid = idx_s.index(0).load(gl.SliceLayout(0, s_layout))
    else:
        rid = gl.load(idx_row + cols, mask=cols < k_lim, other=-1)
        rid_next = gl.load(idx_row + BLOCK_N + cols, mask=BLOCK_N + cols < k_lim, other=-1)
    if Q_ASYNC:
        mbarrier.wait(qbar, 0)
    mbarrier.wait(ready.index(0), 0)
    if CONSUMER_EXPAND:
        _expand_stage(kv_s.index(0), sc_s.index(0), xl, DEQUANT, BLOCK_N, True)
        gl.thread_barrier()  # both warpgroups' halves of block 0 are expanded
    _stamp(trace_ptr, trace_row, 4, TRACE)
    a_ready = _clk(False)
    a_expand = _clk(False)
    a_pv = _clk(False)
    a_qk = _clk(False)
    a_loop0 = _clk(TRACE)
    s = _qk(q_nope_s, q_rope_s, kv_s.index(0), kr_s.index(0), s_layout, BLOCK_N)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    p, m_i, l2, alpha = _softmax(s, rid, m_i, l2, scale_log2)

    for i in range(n_blocks - 1):
        st = i % NUM_STAGES
        nxt = i + 1
        s_nx = nxt % NUM_STAGES
        # PV_i, then S_{i+1}; the softmax does not overlap the MMAs
        acc = _issue_pv(p, acc, p_s, kr_s, kv_s, st, IDX_SMEM)
        if CONSUMER_EXPAND:
            # block i+1's rows are expanded while PV_i runs; then stage i is released
            w0 = _clk(TRACE)
            mbarrier.wait(ready.index(s_nx), (nxt // NUM_STAGES) & 1)
            w1 = _clk(TRACE)
            a_ready += w1 - w0
            _expand_stage(kv_s.index(s_nx), sc_s.index(s_nx), xl, DEQUANT, BLOCK_N, True)
            w2 = _clk(TRACE)
            a_expand += w2 - w1
            if EARLY_RELEASE:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                gl.thread_barrier()  # stage st and P_i are read; block i+1 is expanded (all of it)
                mbarrier.arrive(empty.index(st))
                a_pv += _clk(TRACE) - w2
            else:
                gl.thread_barrier()  # block i+1 is expanded (both halves): S_{i+1} follows PV_i
        elif EARLY_RELEASE:
            # release stage st as soon as PV_i lands, before waiting for block i+1: the
            # producer's refill of st (copies, then expansion) starts a block earlier
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()  # both warpgroups are done reading stage st and P_i
            mbarrier.arrive(empty.index(st))
        if not CONSUMER_EXPAND:
            w0 = _clk(TRACE)
            mbarrier.wait(ready.index(s_nx), (nxt // NUM_STAGES) & 1)
            a_ready += _clk(TRACE) - w0
        s_next = _qk(q_nope_s, q_rope_s, kv_s.index(s_nx), kr_s.index(s_nx), s_layout, BLOCK_N)
        if IDX_SMEM:
            rid = idx_s.index(nxt).load(gl.SliceLayout(0, s_layout))
        else:
            rid = rid_next
            k2 = (i + 2) * BLOCK_N
            rid_next = gl.load(idx_row + k2 + cols, mask=k2 + cols < k_lim, other=-1)
        w3 = _clk(TRACE)
        if not EARLY_RELEASE:
            # three commit groups are in flight (PV_i, then S's nope and rope wgmmas),
            # completing in order: leaving two outstanding means PV_i has landed
            acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))
            gl.thread_barrier()  # both warpgroups are done reading stage st and P_i
            mbarrier.arrive(empty.index(st))
        w4 = _clk(TRACE)
        s_next = warpgroup_mma_wait(num_outstanding=0, deps=(s_next,))
        a_pv += w4 - w3
        a_qk += _clk(TRACE) - w4
        p, m_i, l2, alpha = _softmax(s_next, rid, m_i, l2, scale_log2)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    _put(trace_ptr, trace_row, 14, a_ready, TRACE)
    _put(trace_ptr, trace_row, 6, a_expand, TRACE)
    _put(trace_ptr, trace_row, 8, a_pv, TRACE)
    _put(trace_ptr, trace_row, 9, a_qk, TRACE)
    _put(trace_ptr, trace_row, 5, _clk(TRACE) - a_loop0, TRACE)
    # the last block: PV only
    acc = _issue_pv(p, acc, p_s, kr_s, kv_s, (n_blocks - 1) % NUM_STAGES, IDX_SMEM)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    l_i = gl.sum(l2, axis=1)

    has = l_i > 0.0
    l_safe = gl.where(has, l_i, 1.0)
    out = acc / gl.convert_layout(l_safe, row_o)[:, None]
    lse = gl.where(has, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    heads_o = gl.arange(0, BLOCK_H, layout=row_o)
    dn = gl.arange(0, D_NOPE, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = (
        out_ptr + split * stride_os + t * stride_ot + heads_o[:, None] * stride_oh + dn[None, :]
    )
    gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(heads_o < num_heads)[:, None])
    heads_s = gl.arange(0, BLOCK_H, layout=row_s)
    gl.store(lse_ptr + split * stride_ls + t * stride_lt + heads_s, lse, mask=heads_s < num_heads)
    _stamp(trace_ptr, trace_row, 7, TRACE)


@gluon.jit
def _fp8_chunk_load(kv_ptr, idx_row, k0, k_lim, rows, c128, rows_r, c64, ROW_BYTES: gl.constexpr):
    """Issue the loads of FP8 rows k0 .. k0+len(rows) of the slice (masked past k_lim / −1)."""
    rid = gl.load(idx_row + k0 + rows, mask=k0 + rows < k_lim, other=-1)
    m = (rid >= 0)[:, None]
    row = kv_ptr + rid.to(gl.int64) * ROW_BYTES
    r0 = gl.load(row[:, None] + c128[None, :], mask=m, other=0)
    r1 = gl.load(row[:, None] + (128 + c128)[None, :], mask=m, other=0)
    r2 = gl.load(row[:, None] + (256 + c128)[None, :], mask=m, other=0)
    r3 = gl.load(row[:, None] + (384 + c128)[None, :], mask=m, other=0)
    scp = (row + D_NOPE).to(gl.pointer_type(gl.float32))
    s0 = gl.load(scp, mask=rid >= 0, other=0.0)
    s1 = gl.load(scp + 1, mask=rid >= 0, other=0.0)
    s2 = gl.load(scp + 2, mask=rid >= 0, other=0.0)
    s3 = gl.load(scp + 3, mask=rid >= 0, other=0.0)
    rid_r = gl.load(idx_row + k0 + rows_r, mask=k0 + rows_r < k_lim, other=-1)
    rope = (kv_ptr + rid_r.to(gl.int64) * ROW_BYTES + D_NOPE + 4 * (D_NOPE // 128)).to(
        gl.pointer_type(gl.bfloat16)
    )
    kr = gl.load(rope[:, None] + c64[None, :], mask=(rid_r >= 0)[:, None], other=0.0)
    return r0, r1, r2, r3, s0, s1, s2, s3, kr


# e4m3 -> bf16 by integer bit moves, 4 values per instance, no conversion instructions: prmt
# sign-extends each byte into a 16-bit lane, a shift by 4 and a mask leave the sign at bit 15 and
# exponent|mantissa at bits 4-10, i.e. the bf16 of e4m3 · 2^-120 (exact, subnormals included:
# bias 7 vs 127); then one bf16x2 fma with the tile scale · 2^120 split in two bf16 (hi + lo)
# rounds once, as the fp32 product rounded to bf16 would. $3 / $7: the (hi, hi) / (lo, lo) pairs.
_DEQUANT_ASM = gl.constexpr("""{
.reg .b32 a, b, la, lb;
prmt.b32 a, $2, 0, 0x9180;
prmt.b32 b, $2, 0, 0xB3A2;
shl.b32 a, a, 4;
shl.b32 b, b, 4;
and.b32 a, a, 0x87F087F0;
and.b32 b, b, 0x87F087F0;
mul.rn.bf16x2 la, a, $7;
mul.rn.bf16x2 lb, b, $7;
fma.rn.bf16x2 $0, a, $3, la;
fma.rn.bf16x2 $1, b, $3, lb;
}""")


@gluon.jit
def _bf16_pair(x):
    """fp32 -> the int32 holding two copies of its bf16."""
    h = x.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return h | (h << 16)


@gluon.jit
def _dequant(raw, sc, DEQUANT: gl.constexpr):
    """e4m3 bytes [rows, 128] times the rows' fp32 tile scale [rows] -> bf16."""
    return _dequant_2d(raw, sc[:, None], DEQUANT)


@gluon.jit
def _fp8_chunk_store(chunk, kv_rows, kr_rows, DEQUANT: gl.constexpr):
    """Dequantise a loaded chunk (e4m3 · tile scale -> bf16) into its rows of the stage."""
    r0, r1, r2, r3, s0, s1, s2, s3, kr = chunk
    kv_rows.slice(0, 128, dim=1).store(_dequant(r0, s0, DEQUANT))
    kv_rows.slice(128, 128, dim=1).store(_dequant(r1, s1, DEQUANT))
    kv_rows.slice(256, 128, dim=1).store(_dequant(r2, s2, DEQUANT))
    kv_rows.slice(384, 128, dim=1).store(_dequant(r3, s3, DEQUANT))
    kr_rows.store(kr)


@gluon.jit
def _dequant_2d(raw, sc, DEQUANT: gl.constexpr):
    """e4m3 bytes [rows, n] times a [rows, 1] fp32 scale (same layout) -> bf16."""
    if DEQUANT == 1:
        s32 = sc * 1.329227995784916e36
        s_hi = s32.to(gl.bfloat16).to(gl.float32)
        _, hi2 = gl.broadcast(raw, _bf16_pair(s_hi))
        _, lo2 = gl.broadcast(raw, _bf16_pair(s32 - s_hi))
        return gl.inline_asm_elementwise(_DEQUANT_ASM, "=r,=r,r,r,r,r,r,r,r,r,r", [raw, hi2, lo2],
                                         dtype=gl.bfloat16, is_pure=True, pack=4)  # fmt: skip
    else:
        return (raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * sc).to(gl.bfloat16)


@gluon.jit
def _fp8_group_dequant(raw_v, sc_v, kv_st, g: gl.constexpr, dl: gl.constexpr, DEQUANT: gl.constexpr,
                       BLOCK_N: gl.constexpr):  # fmt: skip
    """Raw group g (e4m3 columns 64g..64g+63 of the block's rows) -> bf16 column group g."""
    raw = raw_v.slice((8 + g) * BLOCK_N, BLOCK_N, dim=0).load(dl)
    sc = sc_v.slice(g // 2, 1, dim=1).load(dl)
    kv_st.slice(64 * g, 64, dim=1).store(_dequant_2d(raw, sc, DEQUANT))


@gluon.jit
def _expand_stage(kv_st, sc_st, dl: gl.constexpr, DEQUANT: gl.constexpr, BLOCK_N: gl.constexpr,
                  PHASED: gl.constexpr = False):  # fmt: skip
    """Expand a stage's staged e4m3 rows in place to bf16, by the calling partition's threads
    (``dl``: a [rows, 64 bytes] layout over them): the raw bytes sit in the upper half of the
    stage's bf16 buffer, group-major (group g = e4m3 columns 64g..64g+63 of every row, 4 KB), the
    tile scales in ``sc_st``. bf16 groups 4-7 overwrite raw groups 0-7, so a barrier separates each
    overwrite from the loads of what it overwrites: groups 0-3 (no overlap), barrier, 4-5 (over
    raw 0-3), raw 6-7 into registers, barrier, 6-7 (over raw 4-7). ``PHASED`` (for a partition
    with registers to spare): raw groups 0-3 into registers, bf16 0-3; raw 4-7 into registers,
    barrier, bf16 4-7. The compiler's shared-memory hazard analysis puts a barrier between any
    two accesses of one buffer (it does not see that the slices are disjoint), so the phased
    order has 9 barriers per expansion where the group-by-group order has 14 (sm_90a PTX of the
    consumers' build), and measured 0.93-0.97 vs 1.01 ms at T=1024. Ends with the
    fence that publishes the stores to wgmma; the caller's barrier then publishes them across
    warps."""
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    raw_v = kv_st._reinterpret(gl.uint8, [16 * BLOCK_N, 64], plain)
    if PHASED:
        for h in gl.static_range(2):
            r0 = raw_v.slice((8 + 4 * h) * BLOCK_N, BLOCK_N, dim=0).load(dl)
            r1 = raw_v.slice((9 + 4 * h) * BLOCK_N, BLOCK_N, dim=0).load(dl)
            r2 = raw_v.slice((10 + 4 * h) * BLOCK_N, BLOCK_N, dim=0).load(dl)
            r3 = raw_v.slice((11 + 4 * h) * BLOCK_N, BLOCK_N, dim=0).load(dl)
            s0 = sc_st.slice(2 * h, 1, dim=1).load(dl)
            s1 = sc_st.slice(2 * h + 1, 1, dim=1).load(dl)
            if h == 1:
                gl.thread_barrier()  # raw groups 4-7 are read: bf16 groups 4-7 may overwrite them
            kv_st.slice((4 * h) * 64, 64, dim=1).store(_dequant_2d(r0, s0, DEQUANT))
            kv_st.slice((4 * h + 1) * 64, 64, dim=1).store(_dequant_2d(r1, s0, DEQUANT))
            kv_st.slice((4 * h + 2) * 64, 64, dim=1).store(_dequant_2d(r2, s1, DEQUANT))
            kv_st.slice((4 * h + 3) * 64, 64, dim=1).store(_dequant_2d(r3, s1, DEQUANT))
        fence_async_shared()
    else:
        _expand_by_group(raw_v, kv_st, sc_st, dl, DEQUANT, BLOCK_N)


@gluon.jit
def _expand_by_group(raw_v, kv_st, sc_st, dl: gl.constexpr, DEQUANT: gl.constexpr,
                     BLOCK_N: gl.constexpr):  # fmt: skip
    for g in gl.static_range(4):
        _fp8_group_dequant(raw_v, sc_st, kv_st, g, dl, DEQUANT, BLOCK_N)
    gl.thread_barrier()  # raw groups 0-3 are read: bf16 groups 4-5 may overwrite them
    _fp8_group_dequant(raw_v, sc_st, kv_st, 4, dl, DEQUANT, BLOCK_N)
    _fp8_group_dequant(raw_v, sc_st, kv_st, 5, dl, DEQUANT, BLOCK_N)
    raw6 = raw_v.slice(14 * BLOCK_N, BLOCK_N, dim=0).load(dl)
    raw7 = raw_v.slice(15 * BLOCK_N, BLOCK_N, dim=0).load(dl)
    sc3 = sc_st.slice(3, 1, dim=1).load(dl)
    gl.thread_barrier()  # raw groups 4-7 are read: bf16 groups 6-7 may overwrite them
    kv_st.slice(6 * 64, 64, dim=1).store(_dequant_2d(raw6, sc3, DEQUANT))
    kv_st.slice(7 * 64, 64, dim=1).store(_dequant_2d(raw7, sc3, DEQUANT))
    fence_async_shared()


@gluon.jit
def _produce_fp8_staged(
    kv_ptr, idx_row, kv_s, kr_s, sc_s, ready, empty, k_lim, n_blocks,
    ROW_BYTES: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr, FP8_ROWS: gl.constexpr, DEQUANT: gl.constexpr,
    idx_s, IDX_SMEM: gl.constexpr, trace_ptr, trace_row, TRACE: gl.constexpr,
    CONSUMER_EXPAND: gl.constexpr, SCALE_BYTES: gl.constexpr, WIDE_COPY: gl.constexpr,
):  # fmt: skip
    """fp8_ds_mla rows staged through shared memory, so no row is held in registers in flight:
    per block, ``cp.async`` puts the raw e4m3 bytes in the upper half of the stage's own bf16
    buffer (group-major: group g = e4m3 columns 64g..64g+63 of every row, 4 KB), the tile scales
    in ``sc_s`` and the bf16 rope straight into its slot; then the producer expands the groups in
    place, g = 0..7, to the bf16 column groups (8 KB each, lower half first). bf16 groups 4-7
    overwrite raw groups 0-7, so a barrier separates each overwrite from the loads of what it
    overwrites: groups 0-3 (no overlap), barrier, 4-5 (over raw 0-3), raw 6-7 into registers,
    barrier, 6-7 (over raw 4-7). With CONSUMER_EXPAND the producer only issues the copies (each
    thread's arriving on ``ready`` when they land) and the consumers expand the block
    (:func:`_expand_stage`) while the previous block's PV runs."""
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    # [rows, 64 bytes] tiles, 16 bytes per thread: each group's cp.async copies (FP8_ROWS rows)
    # and its dequantisation (the block's rows)
    tl64: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [PRODUCER_WARPS, 1], [1, 0])
    r2 = gl.arange(0, FP8_ROWS, layout=gl.SliceLayout(1, tl64))
    b2 = gl.arange(0, 64, layout=gl.SliceLayout(0, tl64))
    # the tile scales (4 fp32 per row): 16 bytes per thread (one thread per row, so the rows repeat
    # across the warps) or 4 (one scale per thread)
    if SCALE_BYTES == 16:
        sl: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [PRODUCER_WARPS, 1], [1, 0])
    else:
        sl: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [PRODUCER_WARPS, 1], [1, 0])
    rs = gl.arange(0, FP8_ROWS, layout=gl.SliceLayout(1, sl))
    cs = gl.arange(0, 4, layout=gl.SliceLayout(0, sl))
    VR: gl.constexpr = FP8_ROWS * 64 // (PRODUCER_WARPS * 32)
    rl: gl.constexpr = gl.BlockedLayout([1, VR], [VR // 2, 64 // VR], [PRODUCER_WARPS, 1], [1, 0])
    rr = gl.arange(0, FP8_ROWS, layout=gl.SliceLayout(1, rl))
    cr = gl.arange(0, 64, layout=gl.SliceLayout(0, rl))
    # WIDE_COPY: the raw bytes as [8 groups, rows, 64 bytes], a warp's copy covering one row's
    # 512 contiguous bytes (else [rows, 64 bytes] per group: 8 rows' 64 bytes per warp copy)
    wl: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8, 1, 4], [1, PRODUCER_WARPS, 1], [2, 0, 1])
    wg = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, wl)))
    wr = gl.arange(0, FP8_ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, wl)))
    wb = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, wl)))
    plain3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    a_empty = _clk(False)
    a_issue = _clk(False)
    a_wait = _clk(False)
    a_deq = _clk(False)
    for i in range(n_blocks):
        st = i % NUM_STAGES
        kv_st = kv_s.index(st)
        kr_st = kr_s.index(st)
        sc_st = sc_s.index(st)
        # the stage's 64 KB as [16 · BLOCK_N, 64] bytes: raw group g is rows (8 + g) · BLOCK_N + r
        raw_v = kv_st._reinterpret(gl.uint8, [16 * BLOCK_N, 64], plain)
        c0 = _clk(TRACE)
        mbarrier.wait(empty.index(st), ((i // NUM_STAGES) & 1) ^ 1)
        c1 = _clk(TRACE)
        for r0 in gl.static_range(0, BLOCK_N, FP8_ROWS):
            if WIDE_COPY:
                rid = _batch_ids(idx_row, idx_s, i, r0, wr, k_lim, FP8_ROWS,
                    gl.SliceLayout(0, gl.SliceLayout(2, wl)), BLOCK_N, IDX_SMEM)  # fmt: skip
                row = (kv_ptr + rid.to(gl.int64) * ROW_BYTES)[None, :, None]
                src = row + (64 * wg)[:, None, None] + wb[None, None, :]
                raw3 = kv_st._reinterpret(gl.uint8, [16, BLOCK_N, 64], plain3)
                async_copy.async_copy_global_to_shared(
                    raw3.slice(8, 8, dim=0).slice(r0, FP8_ROWS, dim=1),
                    src,
                    mask=(rid >= 0)[None, :, None],
                )
            else:
                rid = _batch_ids(idx_row, idx_s, i, r0, r2, k_lim, FP8_ROWS,
                    gl.SliceLayout(1, tl64), BLOCK_N, IDX_SMEM)  # fmt: skip
                row = (kv_ptr + rid.to(gl.int64) * ROW_BYTES)[:, None] + b2[None, :]
                for g in gl.static_range(8):
                    async_copy.async_copy_global_to_shared(
                        raw_v.slice((8 + g) * BLOCK_N + r0, FP8_ROWS, dim=0),
                        row + 64 * g,
                        mask=(rid >= 0)[:, None],
                    )
            rid_s = _batch_ids(idx_row, idx_s, i, r0, rs, k_lim, FP8_ROWS,
                gl.SliceLayout(1, sl), BLOCK_N, IDX_SMEM)  # fmt: skip
            scp = (kv_ptr + rid_s.to(gl.int64) * ROW_BYTES + D_NOPE).to(gl.pointer_type(gl.float32))
            async_copy.async_copy_global_to_shared(
                sc_st.slice(r0, FP8_ROWS, dim=0),
                scp[:, None] + cs[None, :],
                mask=(rid_s >= 0)[:, None],
            )
            rid_r = _batch_ids(idx_row, idx_s, i, r0, rr, k_lim, FP8_ROWS,
                gl.SliceLayout(1, rl), BLOCK_N, IDX_SMEM)  # fmt: skip
            rope = (kv_ptr + rid_r.to(gl.int64) * ROW_BYTES + D_NOPE + 4 * (D_NOPE // 128)).to(
                gl.pointer_type(gl.bfloat16)
            )
            async_copy.async_copy_global_to_shared(
                kr_st.slice(r0, FP8_ROWS, dim=0),
                rope[:, None] + cr[None, :],
                mask=(rid_r >= 0)[:, None],
            )
        if CONSUMER_EXPAND:
            async_copy.mbarrier_arrive(ready.index(st), increment_count=False)
            c2 = _clk(TRACE)
            c3 = c2
            c4 = c2
        else:
            async_copy.commit_group()
            c2 = _clk(TRACE)
            async_copy.wait_group(0)
            gl.thread_barrier()  # every producer thread's copies of this block have landed
            c3 = _clk(TRACE)
            _expand_stage(kv_st, sc_st, tl64, DEQUANT, BLOCK_N)
            gl.thread_barrier()
            mbarrier.arrive(ready.index(st))
            c4 = _clk(TRACE)
        a_empty += c1 - c0
        a_issue += c2 - c1
        a_wait += c3 - c2
        a_deq += c4 - c3
    _put(trace_ptr, trace_row, 10, a_empty, TRACE)
    _put(trace_ptr, trace_row, 11, a_issue, TRACE)
    _put(trace_ptr, trace_row, 12, a_wait, TRACE)
    _put(trace_ptr, trace_row, 13, a_deq, TRACE)


@gluon.jit
def _producer(
    kv_ptr, idx_ptr, kv_s, kr_s, sc_s, ready, empty, t, split, topk, k_per_split, stride_it,
    row_stride, IS_FP8: gl.constexpr, ROW_BYTES: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr, FP8_ROWS: gl.constexpr,
    DEQUANT: gl.constexpr, FP8_STAGED: gl.constexpr, trace_ptr, trace_row, TRACE: gl.constexpr,
    idx_s, IDX_SMEM: gl.constexpr, CONSUMER_EXPAND: gl.constexpr, SCALE_BYTES: gl.constexpr,
    WIDE_COPY: gl.constexpr,
):  # fmt: skip
    n_blocks = k_per_split // BLOCK_N
    k_lo = split * k_per_split
    idx_row = idx_ptr + t * stride_it + k_lo
    k_lim = gl.minimum(k_per_split, topk - k_lo)
    if IS_FP8 and FP8_STAGED:
        _produce_fp8_staged(kv_ptr, idx_row, kv_s, kr_s, sc_s, ready, empty, k_lim, n_blocks,
                            ROW_BYTES, BLOCK_N, NUM_STAGES, PRODUCER_WARPS, FP8_ROWS, DEQUANT,
                            idx_s, IDX_SMEM, trace_ptr, trace_row, TRACE, CONSUMER_EXPAND,
                            SCALE_BYTES, WIDE_COPY)  # fmt: skip
    elif IS_FP8:
        # FP8_ROWS rows per chunk: 4 tiles of [rows, 128] e4m3 (16 bytes per thread and load),
        # their fp32 scales and the bf16 rope; the next chunk's loads are in flight while this one
        # is dequantised and stored
        # each thread holds V consecutive bytes of one row per 128-byte tile (16 at 4 warps)
        V: gl.constexpr = FP8_ROWS * 128 // (PRODUCER_WARPS * 32)
        VR: gl.constexpr = FP8_ROWS * 64 // (PRODUCER_WARPS * 32)
        fl: gl.constexpr = gl.BlockedLayout([1, V], [V // 4, 128 // V], [PRODUCER_WARPS, 1], [1, 0])
        rl: gl.constexpr = gl.BlockedLayout(
            [1, VR], [VR // 2, 64 // VR], [PRODUCER_WARPS, 1], [1, 0]
        )
        rows = gl.arange(0, FP8_ROWS, layout=gl.SliceLayout(1, fl))
        c128 = gl.arange(0, 128, layout=gl.SliceLayout(0, fl))
        rows_r = gl.arange(0, FP8_ROWS, layout=gl.SliceLayout(1, rl))
        c64 = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, rl))
        cur = _fp8_chunk_load(kv_ptr, idx_row, 0, k_lim, rows, c128, rows_r, c64, ROW_BYTES)
        for i in range(n_blocks):
            st = i % NUM_STAGES
            kv_st = kv_s.index(st)
            kr_st = kr_s.index(st)
            mbarrier.wait(empty.index(st), ((i // NUM_STAGES) & 1) ^ 1)
            for j in gl.static_range(BLOCK_N // FP8_ROWS):
                k_next = i * BLOCK_N + (j + 1) * FP8_ROWS
                nxt = _fp8_chunk_load(
                    kv_ptr, idx_row, k_next, k_lim, rows, c128, rows_r, c64, ROW_BYTES
                )
                _fp8_chunk_store(cur, kv_st.slice(j * FP8_ROWS, FP8_ROWS, dim=0),
                                 kr_st.slice(j * FP8_ROWS, FP8_ROWS, dim=0), DEQUANT)  # fmt: skip
                cur = nxt
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(ready.index(st))
    else:
        # FP8_ROWS rows per cp.async batch keeps the 64-bit addresses of one batch in registers
        VR: gl.constexpr = FP8_ROWS * 64 // (PRODUCER_WARPS * 32)
        nl: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [PRODUCER_WARPS, 1], [1, 0])
        rl: gl.constexpr = gl.BlockedLayout(
            [1, VR], [VR // 2, 64 // VR], [PRODUCER_WARPS, 1], [1, 0]
        )
        rows = gl.arange(0, FP8_ROWS, layout=gl.SliceLayout(1, nl))
        dn = gl.arange(0, D_NOPE, layout=gl.SliceLayout(0, nl))
        rows_r = gl.arange(0, FP8_ROWS, layout=gl.SliceLayout(1, rl))
        dr = gl.arange(0, D_ROPE, layout=gl.SliceLayout(0, rl))
        for i in range(n_blocks):
            st = i % NUM_STAGES
            kv_st = kv_s.index(st)
            kr_st = kr_s.index(st)
            mbarrier.wait(empty.index(st), ((i // NUM_STAGES) & 1) ^ 1)
            for r0 in gl.static_range(0, BLOCK_N, FP8_ROWS):
                rid = _batch_ids(idx_row, idx_s, i, r0, rows, k_lim, FP8_ROWS,
                    gl.SliceLayout(1, nl), BLOCK_N, IDX_SMEM)  # fmt: skip
                row = kv_ptr + rid.to(gl.int64) * row_stride
                async_copy.async_copy_global_to_shared(
                    kv_st.slice(r0, FP8_ROWS, dim=0),
                    row[:, None] + dn[None, :],
                    mask=(rid >= 0)[:, None],
                )
                rid_r = _batch_ids(idx_row, idx_s, i, r0, rows_r, k_lim, FP8_ROWS,
                    gl.SliceLayout(1, rl), BLOCK_N, IDX_SMEM)  # fmt: skip
                row_r = kv_ptr + rid_r.to(gl.int64) * row_stride + D_NOPE
                async_copy.async_copy_global_to_shared(
                    kr_st.slice(r0, FP8_ROWS, dim=0),
                    row_r[:, None] + dr[None, :],
                    mask=(rid_r >= 0)[:, None],
                )
            async_copy.mbarrier_arrive(ready.index(st), increment_count=False)
            if i == 0:
                _stamp(trace_ptr, trace_row, 2, TRACE)
        _stamp(trace_ptr, trace_row, 3, TRACE)


@gluon.jit
def _alloc_rows_and_query(IS_FP8: gl.constexpr, FP8_STAGED: gl.constexpr, BLOCK_N: gl.constexpr,
                          NUM_STAGES: gl.constexpr):  # fmt: skip
    """Shared memory both kernels share: the query (nope, rope), the stages' bf16 rows (nope,
    rope) and the staged FP8 producer's tile scales (4 fp32 per row; a dummy otherwise)."""
    big: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_nope_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_NOPE], big)
    q_rope_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_ROPE], big)
    kv_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_N, D_NOPE], big)
    kr_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_N, D_ROPE], big)
    sc_rows: gl.constexpr = BLOCK_N if (IS_FP8 and FP8_STAGED) else 1
    sc_s = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, sc_rows, 4],
                                     gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))  # fmt: skip
    return q_nope_s, q_rope_s, kv_s, kr_s, sc_s


@gluon.jit
def _init_stage_barriers(ready, empty, ONE_ARRIVAL: gl.constexpr, NUM_STAGES: gl.constexpr,
                         PRODUCER_WARPS: gl.constexpr, CONSUMERS: gl.constexpr):  # fmt: skip
    """``ready``: one arrival per block when the producer expands FP8 rows itself (its arrival
    after its barrier: ``ONE_ARRIVAL``), else one per producer thread (each thread's cp.async
    copies); ``empty``: one per consumer partition that reads the stage."""
    for s in gl.static_range(NUM_STAGES):
        if ONE_ARRIVAL:
            mbarrier.init(ready.index(s), count=1)
        else:
            mbarrier.init(ready.index(s), count=PRODUCER_WARPS * 32)
        mbarrier.init(empty.index(s), count=CONSUMERS)


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


IDX_CAP = gl.constexpr(2048)  # top-k ids of one slice staged in shared memory (8 KB)


@gluon.jit
def _stage_ids(idx_ptr, t, stride_it, split, k_per_split, topk, IDX_SMEM: gl.constexpr,
               BLOCK_N: gl.constexpr = 64):  # fmt: skip
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
def _batch_ids(idx_row, idx_s, blk, r0: gl.constexpr, rows, k_lim, N: gl.constexpr, lay: gl.constexpr,
               BLOCK_N: gl.constexpr, IDX_SMEM: gl.constexpr):  # fmt: skip
    """The ids of rows r0 + ``rows`` of block ``blk`` of the slice (``rows``: arange(N) in layout
    ``lay``; −1 past k_lim): from ``idx_s`` (IDX_SMEM) or global memory."""
    if IDX_SMEM:
        return idx_s.index(blk).slice(r0, N).load(lay)
    else:
        kk = blk * BLOCK_N + r0 + rows
        return gl.load(idx_row + kk, mask=kk < k_lim, other=-1)


@gluon.jit
def _sparse_mla_ws_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, scale_log2, num_heads, topk, k_per_split,
    stride_qt, stride_qh, stride_it, row_stride, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    trace_ptr, IS_FP8: gl.constexpr, ROW_BYTES: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, FP8_ROWS: gl.constexpr,
    DEQUANT: gl.constexpr, CONSUMER_REGS: gl.constexpr, FP8_STAGED: gl.constexpr,
    TRACE: gl.constexpr, Q_ASYNC: gl.constexpr, IDX_SMEM: gl.constexpr, EARLY_RELEASE: gl.constexpr,
    CONSUMER_EXPAND: gl.constexpr, SCALE_BYTES: gl.constexpr, WIDE_COPY: gl.constexpr,
):  # fmt: skip
    t = gl.program_id(0).to(gl.int64)
    split = gl.program_id(1)
    trace_row = t * gl.num_programs(1) + split
    _stamp(trace_ptr, trace_row, 0, TRACE)
    q_nope_s, q_rope_s, kv_s, kr_s, sc_s = _alloc_rows_and_query(
        IS_FP8, FP8_STAGED, BLOCK_N, NUM_STAGES
    )
    if IDX_SMEM:
        p_s = kr_s  # P goes to the rope slots (see _consumer); unused
    else:
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N],
                                                                      gl.bfloat16)  # fmt: skip
        p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], p_layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    one_arrival: gl.constexpr = IS_FP8 and not CONSUMER_EXPAND  # the producer expands: one arrival
    _init_stage_barriers(ready, empty, one_arrival, NUM_STAGES, PRODUCER_WARPS, 1)
    qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    _query(q_ptr, t, stride_qt, stride_qh, num_heads, q_nope_s, q_rope_s, qbar, Q_ASYNC)
    idx_s = _stage_ids(idx_ptr, t, stride_it, split, k_per_split, topk, IDX_SMEM)
    _stamp(trace_ptr, trace_row, 1, TRACE)

    # the producer is the default partition (see the seesaw kernel), the consumers a worker
    gl.warp_specialize(
        [
            (
                _producer,
                (kv_ptr, idx_ptr, kv_s, kr_s, sc_s, ready, empty, t, split, topk, k_per_split,
                 stride_it, row_stride, IS_FP8, ROW_BYTES, BLOCK_N, NUM_STAGES, PRODUCER_WARPS,
                 FP8_ROWS, DEQUANT, FP8_STAGED, trace_ptr, trace_row, TRACE, idx_s, IDX_SMEM,
                 CONSUMER_EXPAND, SCALE_BYTES, WIDE_COPY),
            ),
            (
                _consumer,
                (q_nope_s, q_rope_s, kv_s, kr_s, p_s, ready, empty, idx_ptr, out_ptr, lse_ptr, t,
                 split, scale_log2, num_heads, topk, k_per_split, stride_it, stride_os, stride_ot,
                 stride_oh, stride_ls, stride_lt, qbar, idx_s, BLOCK_N, NUM_STAGES, Q_ASYNC, IDX_SMEM,
                 trace_ptr, trace_row, TRACE, EARLY_RELEASE, sc_s, CONSUMER_EXPAND, DEQUANT),
            ),
        ],
        [8],
        [CONSUMER_REGS],
    )  # fmt: skip


@gluon.jit
def _seesaw_consumer(
    q_nope_s, q_rope_s, kv_s, kr_s, ready, empty, xbar, m0buf, m1buf, l0buf, l1buf,
    idx_ptr, out_ptr, lse_ptr, t, split, scale_log2, num_heads, topk, k_per_split,
    stride_it, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, trace_ptr, trace_row, qbar,
    idx_s, ROLE: gl.constexpr, TRACE: gl.constexpr, Q_ASYNC: gl.constexpr, IDX_SMEM: gl.constexpr,
):  # fmt: skip
    """One of the two consumer warpgroups of the seesaw schedule (``ROLE`` 0 or 1).

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
        if j == 0:
            _stamp(trace_ptr, trace_row, 4 + 4 * ROLE, TRACE)
        # a stage index the compiler cannot hoist (j < 2^30): with a constant one, ptxas keeps
        # the 36 loop-invariant wgmma descriptors of this block's QK across the loop (spilled)
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
            acc = warpgroup_mma(kr_s.index(1 + z), kv_s.index(1 + z).slice(c0, D_NOPE // 2, dim=1), acc,
                                is_async=True)  # fmt: skip
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()
            mbarrier.arrive(empty.index(1))
            m_i = m1
            if j == 0:
                _stamp(trace_ptr, trace_row, 5, TRACE)
        else:
            # O_R = (O_R·sc0 + P0·V0_R)·sc1 + P1·V1_R (P0 was written before xbar[0] completed)
            acc = warpgroup_mma(kr_s.index(z), kv_s.index(z).slice(c0, D_NOPE // 2, dim=1), acc,
                                is_async=True)  # fmt: skip
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()
            mbarrier.arrive(empty.index(0))
            acc = acc * gl.convert_layout(sc1, row_o)[:, None]
            acc = warpgroup_mma(kr_s.index(1 + z), kv_s.index(1 + z).slice(c0, D_NOPE // 2, dim=1), acc,
                                is_async=True)  # fmt: skip
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()
            mbarrier.arrive(empty.index(1))
            m_i = m1

    if ROLE == 0:
        _stamp(trace_ptr, trace_row, 6, TRACE)
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
    _stamp(trace_ptr, trace_row, 7 + 2 * ROLE, TRACE)


# one entry per role: a partition's arguments reach it as run-time values, and the role must be a
# constexpr (it selects code paths and the value columns' slice)
@gluon.jit
def _seesaw_wg0(q_nope_s, q_rope_s, kv_s, kr_s, ready, empty, xbar, m0buf, m1buf, l0buf, l1buf, idx_ptr,
                out_ptr, lse_ptr, t, split, scale_log2, num_heads, topk, k_per_split, stride_it,
                stride_os, stride_ot, stride_oh, stride_ls, stride_lt, trace_ptr, trace_row, qbar,
                idx_s, TRACE: gl.constexpr, Q_ASYNC: gl.constexpr, IDX_SMEM: gl.constexpr):  # fmt: skip
    _seesaw_consumer(q_nope_s, q_rope_s, kv_s, kr_s, ready, empty, xbar, m0buf, m1buf, l0buf, l1buf, idx_ptr,
                out_ptr, lse_ptr, t, split, scale_log2, num_heads, topk, k_per_split, stride_it,
                stride_os, stride_ot, stride_oh, stride_ls, stride_lt, trace_ptr, trace_row, qbar,
                idx_s, 0, TRACE, Q_ASYNC, IDX_SMEM)  # fmt: skip


@gluon.jit
def _seesaw_wg1(q_nope_s, q_rope_s, kv_s, kr_s, ready, empty, xbar, m0buf, m1buf, l0buf, l1buf, idx_ptr,
                out_ptr, lse_ptr, t, split, scale_log2, num_heads, topk, k_per_split, stride_it,
                stride_os, stride_ot, stride_oh, stride_ls, stride_lt, trace_ptr, trace_row, qbar,
                idx_s, TRACE: gl.constexpr, Q_ASYNC: gl.constexpr, IDX_SMEM: gl.constexpr):  # fmt: skip
    _seesaw_consumer(q_nope_s, q_rope_s, kv_s, kr_s, ready, empty, xbar, m0buf, m1buf, l0buf, l1buf, idx_ptr,
                out_ptr, lse_ptr, t, split, scale_log2, num_heads, topk, k_per_split, stride_it,
                stride_os, stride_ot, stride_oh, stride_ls, stride_lt, trace_ptr, trace_row, qbar,
                idx_s, 1, TRACE, Q_ASYNC, IDX_SMEM)  # fmt: skip


@gluon.jit
def _sparse_mla_seesaw_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, scale_log2, num_heads, topk, k_per_split,
    stride_qt, stride_qh, stride_it, row_stride, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    trace_ptr, IS_FP8: gl.constexpr, ROW_BYTES: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, FP8_ROWS: gl.constexpr,
    DEQUANT: gl.constexpr, CONSUMER_REGS: gl.constexpr, FP8_STAGED: gl.constexpr,
    TRACE: gl.constexpr, Q_ASYNC: gl.constexpr, IDX_SMEM: gl.constexpr, EARLY_RELEASE: gl.constexpr,
    CONSUMER_EXPAND: gl.constexpr, SCALE_BYTES: gl.constexpr, WIDE_COPY: gl.constexpr,
):  # fmt: skip
    """The seesaw-schedule kernel: default partition = the producer (as in
    :func:`_sparse_mla_ws_kernel`), workers = the two consumer warpgroups. Each pair of blocks' P
    lives in the rope slots of its two stages, so shared memory is Q + 2 stages (217.6 KB)."""
    t = gl.program_id(0).to(gl.int64)
    split = gl.program_id(1)
    trace_row = t * gl.num_programs(1) + split
    _stamp(trace_ptr, trace_row, 0, TRACE)
    q_nope_s, q_rope_s, kv_s, kr_s, sc_s = _alloc_rows_and_query(
        IS_FP8, FP8_STAGED, BLOCK_N, NUM_STAGES
    )
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    m0buf = gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat)
    m1buf = gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat)
    l0buf = gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat)
    l1buf = gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    xbar = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(4):
        mbarrier.init(xbar.index(s), count=1)
    one_arrival: gl.constexpr = IS_FP8 and not CONSUMER_EXPAND
    _init_stage_barriers(ready, empty, one_arrival, NUM_STAGES, PRODUCER_WARPS, 2)
    qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    _query(q_ptr, t, stride_qt, stride_qh, num_heads, q_nope_s, q_rope_s, qbar, Q_ASYNC)
    idx_s = _stage_ids(idx_ptr, t, stride_it, split, k_per_split, topk, IDX_SMEM)
    _stamp(trace_ptr, trace_row, 1, TRACE)

    # the producer is the default partition: ptxas holds the default partition's code to the
    # launch's register count (168) but gives worker partitions their setmaxnreg count (232)
    gl.warp_specialize(
        [
            (
                _producer,
                (kv_ptr, idx_ptr, kv_s, kr_s, sc_s, ready, empty, t, split, topk, k_per_split,
                 stride_it, row_stride, IS_FP8, ROW_BYTES, BLOCK_N, NUM_STAGES, PRODUCER_WARPS,
                 FP8_ROWS, DEQUANT, FP8_STAGED, trace_ptr, trace_row, TRACE, idx_s, IDX_SMEM,
                 CONSUMER_EXPAND, SCALE_BYTES, WIDE_COPY),
            ),
            # the argument tuples are written out: a tuple bound to a name first holds its
            # constexprs as run-time values (the partitions would then branch on the flags)
            (_seesaw_wg0, (
                q_nope_s, q_rope_s, kv_s, kr_s, ready, empty, xbar, m0buf, m1buf, l0buf, l1buf,
                idx_ptr, out_ptr, lse_ptr, t, split, scale_log2, num_heads, topk, k_per_split,
                stride_it, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, trace_ptr,
                trace_row, qbar, idx_s, TRACE, Q_ASYNC, IDX_SMEM,
            )),
            (_seesaw_wg1, (
                q_nope_s, q_rope_s, kv_s, kr_s, ready, empty, xbar, m0buf, m1buf, l0buf, l1buf,
                idx_ptr, out_ptr, lse_ptr, t, split, scale_log2, num_heads, topk, k_per_split,
                stride_it, stride_os, stride_ot, stride_oh, stride_ls, stride_lt, trace_ptr,
                trace_row, qbar, idx_s, TRACE, Q_ASYNC, IDX_SMEM,
            )),
        ],
        [4, 4],
        [CONSUMER_REGS, CONSUMER_REGS],
    )  # fmt: skip


@gluon.jit
def _asym_scorer(
    q_nope_s, q_rope_s, kv_s, kr_s, sc_s, ready, empty, xbar, abuf, lbuf, idx_ptr, out_ptr, lse_ptr,
    t, split, scale_log2, num_heads, topk, k_per_split, stride_it, stride_os, stride_ot, stride_oh,
    stride_ls, stride_lt, trace_ptr, trace_row, qbar, idx_s, DEQUANT: gl.constexpr,
    TRACE: gl.constexpr, Q_ASYNC: gl.constexpr, IDX_SMEM: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr, HALVES: gl.constexpr,
):  # fmt: skip
    """The ``asym`` schedule's scoring warpgroup: per block, once the expander has expanded it
    (``xbar[st]``), the whole S = Q·Kᵀ (N = BLOCK_N: Q read once per block), the online softmax
    of full rows (no row-max exchange), P into the block's rope slot and the rescale factor into
    the tile-scale buffer (signalled on ``xbar[NUM_STAGES + st]``), then O_L = O_L·α + P·V_L
    over value columns 0-255 and its release of the stage. Writes the row sums to ``lbuf``
    (``xbar[2 · NUM_STAGES]``) and the LSE at the end."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D_NOPE // 2, 16]
    )
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    n_blocks = k_per_split // BLOCK_N
    RPS: gl.constexpr = BLOCK_N // 16  # rows of the [·, 64] fp32 view per stage of tile scales
    # P_i [heads, BLOCK_N] in block i's rope slot ([BLOCK_N, 64]: the same bytes)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
    k_lo = split * k_per_split
    idx_row = idx_ptr + t * stride_it + k_lo
    k_lim = gl.minimum(k_per_split, topk - k_lo)
    acc = gl.zeros([BLOCK_H, D_NOPE // 2], gl.float32, o_layout)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_H], gl.float32, row_s)
    il: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    ci = gl.arange(0, BLOCK_N, layout=il)
    if Q_ASYNC:
        mbarrier.wait(qbar, 0)
    a_wait = _clk(False)
    a_loop0 = _clk(TRACE)
    for i in range(n_blocks):
        st = i % NUM_STAGES
        ph = (i // NUM_STAGES) & 1
        if IDX_SMEM:
            rid = idx_s.index(i).load(gl.SliceLayout(0, s_layout))
        else:
            kk = i * BLOCK_N + ci
            rid = gl.load(idx_row + kk, mask=kk < k_lim, other=-1)
            rid = gl.convert_layout(rid, gl.SliceLayout(0, s_layout))
        w0 = _clk(TRACE)
        if HALVES:
            # value columns 0-255 (and the rope, copied as is) are expanded: their part of S
            # runs while the expander does columns 256-511
            mbarrier.wait(xbar.index(2 * NUM_STAGES + 1 + st), ph)
            a_wait += _clk(TRACE) - w0
            s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
            s = warpgroup_mma(q_nope_s.slice(0, D_NOPE // 2, dim=1),
                              kv_s.index(st).slice(0, D_NOPE // 2, dim=1).permute((1, 0)), s,
                              use_acc=False, is_async=True)  # fmt: skip
            s = warpgroup_mma(q_rope_s, kr_s.index(st).permute((1, 0)), s, is_async=True)
            w0 = _clk(TRACE)
            mbarrier.wait(xbar.index(st), ph)  # block i is expanded
            a_wait += _clk(TRACE) - w0
            s = warpgroup_mma(q_nope_s.slice(D_NOPE // 2, D_NOPE // 2, dim=1),
                              kv_s.index(st).slice(D_NOPE // 2, D_NOPE // 2, dim=1).permute((1, 0)),
                              s, is_async=True)  # fmt: skip
        else:
            mbarrier.wait(xbar.index(st), ph)  # block i is expanded
            a_wait += _clk(TRACE) - w0
            s = _qk(q_nope_s, q_rope_s, kv_s.index(st), kr_s.index(st), s_layout, BLOCK_N)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        s = gl.where((rid >= 0)[None, :], s * scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        # P_i into block i's rope slot (only this warpgroup's QK read it), α_i beside it
        p_s = kr_s.index(st)._reinterpret(gl.bfloat16, [BLOCK_H, BLOCK_N], p_layout)
        p_s.store(p.to(gl.bfloat16))
        abuf.index(RPS * st).store(alpha)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(xbar.index(NUM_STAGES + st))
        # α back from shared memory in the accumulator's row layout (a layout conversion would
        # need scratch shared memory, and there is none left)
        acc = acc * abuf.index(RPS * st).load(row_o)[:, None]
        acc = warpgroup_mma(p_s, kv_s.index(st).slice(0, D_NOPE // 2, dim=1), acc,
                            is_async=True)  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(empty.index(st))
    _put(trace_ptr, trace_row, 14, a_wait, TRACE)
    _put(trace_ptr, trace_row, 5, _clk(TRACE) - a_loop0, TRACE)
    lbuf.store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(xbar.index(2 * NUM_STAGES))
    has = l_i > 0.0
    l_safe = gl.where(has, l_i, 1.0)
    l_o = lbuf.load(row_o)
    out = acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
    heads_o = gl.arange(0, BLOCK_H, layout=row_o)
    dn = gl.arange(0, D_NOPE // 2, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = (
        out_ptr + split * stride_os + t * stride_ot + heads_o[:, None] * stride_oh + dn[None, :]
    )
    gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(heads_o < num_heads)[:, None])
    lse = gl.where(has, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    heads_s = gl.arange(0, BLOCK_H, layout=row_s)
    gl.store(lse_ptr + split * stride_ls + t * stride_lt + heads_s, lse, mask=heads_s < num_heads)
    _stamp(trace_ptr, trace_row, 7, TRACE)


@gluon.jit
def _expand_stage_halves(kv_st, sc_st, dl: gl.constexpr, DEQUANT: gl.constexpr,
                         BLOCK_N: gl.constexpr, bar_lo):  # fmt: skip
    """:func:`_expand_stage` in its phased order, arriving on ``bar_lo`` once bf16 column groups
    0-3 are written and published (they overwrite no raw bytes), so their part of S can start
    while groups 4-7 are expanded. Ends with the fence; the caller's barrier follows."""
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    raw_v = kv_st._reinterpret(gl.uint8, [16 * BLOCK_N, 64], plain)
    for h in gl.static_range(2):
        r0 = raw_v.slice((8 + 4 * h) * BLOCK_N, BLOCK_N, dim=0).load(dl)
        r1 = raw_v.slice((9 + 4 * h) * BLOCK_N, BLOCK_N, dim=0).load(dl)
        r2 = raw_v.slice((10 + 4 * h) * BLOCK_N, BLOCK_N, dim=0).load(dl)
        r3 = raw_v.slice((11 + 4 * h) * BLOCK_N, BLOCK_N, dim=0).load(dl)
        s0 = sc_st.slice(2 * h, 1, dim=1).load(dl)
        s1 = sc_st.slice(2 * h + 1, 1, dim=1).load(dl)
        if h == 1:
            gl.thread_barrier()  # raw groups 4-7 are read: bf16 groups 4-7 may overwrite them
        kv_st.slice((4 * h) * 64, 64, dim=1).store(_dequant_2d(r0, s0, DEQUANT))
        kv_st.slice((4 * h + 1) * 64, 64, dim=1).store(_dequant_2d(r1, s0, DEQUANT))
        kv_st.slice((4 * h + 2) * 64, 64, dim=1).store(_dequant_2d(r2, s1, DEQUANT))
        kv_st.slice((4 * h + 3) * 64, 64, dim=1).store(_dequant_2d(r3, s1, DEQUANT))
        fence_async_shared()
        if h == 0:
            gl.thread_barrier()  # every thread's groups 0-3 are written
            mbarrier.arrive(bar_lo)


@gluon.jit
def _asym_expand_next(kv_s, sc_s, ready, xbar, xl: gl.constexpr, nx, a_ready, a_exp,
                      DEQUANT: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                      TRACE: gl.constexpr, HALVES: gl.constexpr):  # fmt: skip
    """The expander's step for block ``nx``: wait for its copies, expand it, signal the scorer
    (``xbar[stage]``; with HALVES also ``xbar[2 · NUM_STAGES + 1 + stage]`` once value columns
    0-255 are done). Returns the traced wait and expansion cycles, accumulated."""
    s_nx = nx % NUM_STAGES
    w0 = _clk(TRACE)
    mbarrier.wait(ready.index(s_nx), (nx // NUM_STAGES) & 1)
    w1 = _clk(TRACE)
    if HALVES:
        _expand_stage_halves(kv_s.index(s_nx), sc_s.index(s_nx), xl, DEQUANT, BLOCK_N,
                             xbar.index(2 * NUM_STAGES + 1 + s_nx))  # fmt: skip
    else:
        _expand_stage(kv_s.index(s_nx), sc_s.index(s_nx), xl, DEQUANT, BLOCK_N, True)
    gl.thread_barrier()
    mbarrier.arrive(xbar.index(s_nx))
    w2 = _clk(TRACE)
    return a_ready + (w1 - w0), a_exp + (w2 - w1)


@gluon.jit
def _asym_expander(
    q_nope_s, q_rope_s, kv_s, kr_s, sc_s, ready, empty, xbar, abuf, lbuf, idx_ptr, out_ptr, lse_ptr,
    t, split, scale_log2, num_heads, topk, k_per_split, stride_it, stride_os, stride_ot, stride_oh,
    stride_ls, stride_lt, trace_ptr, trace_row, qbar, idx_s, DEQUANT: gl.constexpr,
    TRACE: gl.constexpr, Q_ASYNC: gl.constexpr, IDX_SMEM: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr, PV_FIRST: gl.constexpr, HALVES: gl.constexpr,
):  # fmt: skip
    """The ``asym`` schedule's expanding warpgroup: expands block i+1's staged FP8 rows to bf16
    (:func:`_expand_stage`; signalled on ``xbar[st]``) while the scorer works on block i, then,
    given P_i and α_i, O_R = O_R·α_i + P_i·V_R over value columns 256-511 and its release of the
    stage. Divides by the scorer's row sums at the end."""
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D_NOPE // 2, 16]
    )
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    # [rows, 64 bytes] over the 4 warps, 16 bytes per thread
    xl: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    n_blocks = k_per_split // BLOCK_N
    RPS: gl.constexpr = BLOCK_N // 16
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], gl.bfloat16)
    acc = gl.zeros([BLOCK_H, D_NOPE // 2], gl.float32, o_layout)
    a_ready = _clk(False)
    a_exp = _clk(False)
    a_p = _clk(False)
    if HALVES:
        a_ready, a_exp = _asym_expand_next(kv_s, sc_s, ready, xbar, xl, 0, a_ready, a_exp, DEQUANT,
                                           BLOCK_N, NUM_STAGES, TRACE, HALVES)  # fmt: skip
    else:
        mbarrier.wait(ready.index(0), 0)
        _expand_stage(kv_s.index(0), sc_s.index(0), xl, DEQUANT, BLOCK_N, True)
        gl.thread_barrier()
        mbarrier.arrive(xbar.index(0))
    for i in range(n_blocks):
        st = i % NUM_STAGES
        nx = i + 1
        if not PV_FIRST:
            if nx < n_blocks:
                a_ready, a_exp = _asym_expand_next(kv_s, sc_s, ready, xbar, xl, nx, a_ready, a_exp,
                                                   DEQUANT, BLOCK_N, NUM_STAGES, TRACE, HALVES)  # fmt: skip
        w3 = _clk(TRACE)
        mbarrier.wait(xbar.index(NUM_STAGES + st), (i // NUM_STAGES) & 1)  # P_i, α_i written
        a_p += _clk(TRACE) - w3
        alpha = abuf.index(RPS * st).load(row_o)
        acc = acc * alpha[:, None]
        p_s = kr_s.index(st)._reinterpret(gl.bfloat16, [BLOCK_H, BLOCK_N], p_layout)
        acc = warpgroup_mma(p_s, kv_s.index(st).slice(D_NOPE // 2, D_NOPE // 2, dim=1), acc,
                            is_async=True)  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(empty.index(st))
        if PV_FIRST:
            if nx < n_blocks:
                a_ready, a_exp = _asym_expand_next(kv_s, sc_s, ready, xbar, xl, nx, a_ready, a_exp,
                                                   DEQUANT, BLOCK_N, NUM_STAGES, TRACE, HALVES)  # fmt: skip
    _put(trace_ptr, trace_row, 9, a_ready, TRACE)
    _put(trace_ptr, trace_row, 6, a_exp, TRACE)
    _put(trace_ptr, trace_row, 8, a_p, TRACE)
    mbarrier.wait(xbar.index(2 * NUM_STAGES), 0)
    l_i = lbuf.load(row_o)
    l_safe = gl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    heads_o = gl.arange(0, BLOCK_H, layout=row_o)
    dn = D_NOPE // 2 + gl.arange(0, D_NOPE // 2, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = (
        out_ptr + split * stride_os + t * stride_ot + heads_o[:, None] * stride_oh + dn[None, :]
    )
    gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(heads_o < num_heads)[:, None])


@gluon.jit
def _sparse_mla_asym_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, scale_log2, num_heads, topk, k_per_split,
    stride_qt, stride_qh, stride_it, row_stride, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    trace_ptr, IS_FP8: gl.constexpr, ROW_BYTES: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
    PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr, FP8_ROWS: gl.constexpr,
    DEQUANT: gl.constexpr, CONSUMER_REGS: gl.constexpr, FP8_STAGED: gl.constexpr,
    TRACE: gl.constexpr, Q_ASYNC: gl.constexpr, IDX_SMEM: gl.constexpr, EARLY_RELEASE: gl.constexpr,
    CONSUMER_EXPAND: gl.constexpr, SCALE_BYTES: gl.constexpr, WIDE_COPY: gl.constexpr,
    ASYM_PV_FIRST: gl.constexpr, ASYM_HALVES: gl.constexpr,
):  # fmt: skip
    """The ``asym`` schedule (staged fp8_ds_mla rows; 64-row blocks in 2 stages, or 32 in 4):
    the producer only issues the copies; one consumer warpgroup expands the FP8 rows, the other
    scores."""
    t = gl.program_id(0).to(gl.int64)
    split = gl.program_id(1)
    trace_row = t * gl.num_programs(1) + split
    _stamp(trace_ptr, trace_row, 0, TRACE)
    q_nope_s, q_rope_s, kv_s, kr_s, sc_s = _alloc_rows_and_query(
        IS_FP8, FP8_STAGED, BLOCK_N, NUM_STAGES
    )
    # α_i and the row sums live in the tile-scale buffer (no shared memory is left): as
    # [NUM_STAGES · BLOCK_N / 16, 64] fp32, stage st's scales are the BLOCK_N / 16 rows from
    # (BLOCK_N / 16)·st. α_i goes to the first of them once block i is expanded (its scales
    # read) and is read before the stage is released (and refilled); the row sums go to row 1
    # after every block is expanded
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    abuf = sc_s._reinterpret(gl.float32, [NUM_STAGES * BLOCK_N // 16, BLOCK_H], flat)
    lbuf = abuf.index(1)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    # xbar[st]: block expanded; xbar[NUM_STAGES + st]: P and α written; xbar[2 · NUM_STAGES]:
    # row sums written; xbar[2 · NUM_STAGES + 1 + st]: value columns 0-255 expanded (ASYM_HALVES)
    xbar = gl.allocate_shared_memory(gl.int64, [3 * NUM_STAGES + 1, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(3 * NUM_STAGES + 1):
        mbarrier.init(xbar.index(s), count=1)
    _init_stage_barriers(ready, empty, False, NUM_STAGES, PRODUCER_WARPS, 2)
    qbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    _query(q_ptr, t, stride_qt, stride_qh, num_heads, q_nope_s, q_rope_s, qbar, Q_ASYNC)
    idx_s = _stage_ids(idx_ptr, t, stride_it, split, k_per_split, topk, IDX_SMEM, BLOCK_N)
    _stamp(trace_ptr, trace_row, 1, TRACE)
    gl.warp_specialize(
        [
            (
                _producer,
                (kv_ptr, idx_ptr, kv_s, kr_s, sc_s, ready, empty, t, split, topk, k_per_split,
                 stride_it, row_stride, IS_FP8, ROW_BYTES, BLOCK_N, NUM_STAGES, PRODUCER_WARPS,
                 FP8_ROWS, DEQUANT, FP8_STAGED, trace_ptr, trace_row, TRACE, idx_s, IDX_SMEM,
                 True, SCALE_BYTES, WIDE_COPY),
            ),
            # the argument tuples are written out: a tuple bound to a name first holds its
            # constexprs as run-time values (the partitions would then branch on the flags)
            (_asym_scorer, (
                q_nope_s, q_rope_s, kv_s, kr_s, sc_s, ready, empty, xbar, abuf, lbuf, idx_ptr,
                out_ptr, lse_ptr, t, split, scale_log2, num_heads, topk, k_per_split, stride_it,
                stride_os, stride_ot, stride_oh, stride_ls, stride_lt, trace_ptr, trace_row, qbar,
                idx_s, DEQUANT, TRACE, Q_ASYNC, IDX_SMEM, BLOCK_N, NUM_STAGES, ASYM_HALVES,
            )),
            (_asym_expander, (
                q_nope_s, q_rope_s, kv_s, kr_s, sc_s, ready, empty, xbar, abuf, lbuf, idx_ptr,
                out_ptr, lse_ptr, t, split, scale_log2, num_heads, topk, k_per_split, stride_it,
                stride_os, stride_ot, stride_oh, stride_ls, stride_lt, trace_ptr, trace_row, qbar,
                idx_s, DEQUANT, TRACE, Q_ASYNC, IDX_SMEM, BLOCK_N, NUM_STAGES, ASYM_PV_FIRST, ASYM_HALVES,
            )),
        ],
        [4, 4],
        [CONSUMER_REGS, CONSUMER_REGS],
    )  # fmt: skip


PRODUCER_WARPS = 4  # the default partition: the launch's num_warps
FP8_DEQUANT = 0
# consumer schedule: None = "seesaw" for bf16 rows, "split" for fp8_ds_mla rows (with two stages
# the seesaw pair's second block is needed as soon as its stage is released, which exposes the
# FP8 producer's load + dequantisation: 1.156 vs 1.088 ms staged); or force one
SCHEDULE = None
# the default schedule for fp8_ds_mla rows (when SCHEDULE is None): "split" or "asym"
FP8_SCHEDULE = "split"
# the default for fp8_ds_mla rows when the launch has at most one program per SM (decode batches
# up to ~the SM count, split-K included): asym with ASYM_ORDER measured 62.1 vs 64.6 µs at T=64,
# 37.0 vs 38.9 at T=32, 117.7 vs 119.1 at T=128; at two waves and more split is ahead (0.229 vs
# 0.231 ms at T=256, 0.906 vs 0.965 at T=1024; BENCHMARKS.md, tenth session)
FP8_ONE_WAVE_SCHEDULE = "asym"
# the asym schedule's blocks: 64 rows in 2 stages or 32 rows in 4
ASYM_BLOCK_N = 64
# the asym expander's order per block: "expand_first" (expand block i+1, then PV_i: the expansion
# overlaps the scorer's QK, but stage i is released only after it, so its refill is exposed) or
# "pv_first" (PV_i and the release of stage i, then expand block i+1: the refill has a whole block
# to land, but the expansion no longer overlaps the scorer's QK)
ASYM_ORDER = "pv_first"
# the asym expander signals when value columns 0-255 are expanded, and the scorer issues their
# part of S (and the rope's) before waiting for columns 256-511
ASYM_HALVES = False
# FP8 rows through shared memory (:func:`_produce_fp8_staged`), not registers: 1.088 vs 1.276 ms
# at T=1024 on the H200 (BENCHMARKS.md, sixth session)
FP8_STAGED = True
# rows per cp.async batch of the staged FP8 producer
STAGED_FP8_ROWS = 32
# a slice's top-k ids (up to IDX_CAP) staged in shared memory, in both kernels except the FP8
# seesaw (no room); longer slices read them from global memory
IDX_SMEM = True
# split schedule: release a stage when its PV lands, before waiting for the next block (False: after
# issuing the next block's QK, which overlaps the two but holds the stage until the next is ready)
EARLY_RELEASE = True
# the query by cp.async, in flight with the first blocks (False: loaded and stored before the fork)
Q_ASYNC = True
# staged FP8 rows in the split schedule: the consumers expand them (during the previous block's
# PV) instead of the producer, which then only issues copies; with WIDE_COPY and SCALE_BYTES
# 0.931-0.965 vs 0.974-0.988 ms at T=1024, 0.065 vs 0.072 ms at T=64 (BENCHMARKS.md, ninth
# session). The compiler puts a barrier between any two shared-memory accesses of one buffer
# (it does not see disjoint slices), so fewer, wider copies and stores mean fewer barriers
FP8_CONSUMER_EXPAND = True
# bytes per cp.async of the staged FP8 tile scales: 4 (one scale per thread) or 16 (a row's 4
# scales per thread: 32 rows per warp instruction, repeated across the warps)
SCALE_BYTES = 4
# staged FP8 raw bytes copied a row (512 bytes) per warp instruction, in one copy op per batch of
# rows, not 8 rows' 64 bytes in one op per column group. This and SCALE_BYTES apply where the
# consumers expand the rows; the producer-expanded path was slower with them (1.050 vs 0.975 ms)
# and keeps 64-byte copies and 16-byte scale copies unless a launch asks (``wide_copy=``)
WIDE_COPY = True


def launch_maxnreg() -> int:
    """Registers per thread at launch: the register file (64K) over the 12 warps (4 producer, 8
    consumer), rounded down to a multiple of 8 (168); setmaxnreg then rebalances."""
    return 65536 // (32 * (8 + PRODUCER_WARPS)) // 8 * 8


def consumer_regs(producer_regs: int) -> int:
    """Per-thread registers of the 8 consumer warps (in one or two worker partitions): what the
    producer leaves of the launch's register file (232 beside 40)."""
    total = launch_maxnreg() * 32 * (8 + PRODUCER_WARPS)
    return min(240, (total - 32 * PRODUCER_WARPS * producer_regs) // 256 // 8 * 8)


def default_producer_regs(register_fp8: bool) -> int:
    """The producer partition's setmaxnreg: 40 when it only issues cp.async and expands staged
    rows (bf16 rows, staged FP8 rows); 120 for the register FP8 path, which holds two chunks of
    rows in flight."""
    return 120 if register_fp8 else 40


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=4)
def is_supported_device(device_index: int) -> bool:
    """Hopper (sm_90) only: the kernel issues wgmma."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def launch_config(
    is_fp8, row_bytes, producer_regs=None, fp8_rows=None, dequant=None, schedule=None,
    fp8_staged=None, trace=False, q_async=None, idx_smem=None, early_release=None,
    consumer_expand=None, scale_bytes=None, wide_copy=None, asym_block_n=None, asym_order=None,
    asym_halves=None, one_wave=False,
):  # fmt: skip
    """(kernel, launch metadata, block step) of one configuration: the constexprs, ``num_warps``
    and ``maxnreg`` the launcher passes, and the multiple of rows a top-k slice is rounded to.
    ``one_wave``: the launch has at most one program per SM (picks the FP8 default schedule).
    ``benchmarks/kernels/aot_sm90.py`` and the build test compile exactly this."""
    fp8_staged = bool(is_fp8 and (FP8_STAGED if fp8_staged is None else fp8_staged))
    fp8_rows = fp8_rows or (STAGED_FP8_ROWS if fp8_staged else 16)
    dequant = FP8_DEQUANT if dequant is None else dequant
    if producer_regs is None:
        producer_regs = default_producer_regs(is_fp8 and not fp8_staged)
    fp8_default = FP8_ONE_WAVE_SCHEDULE if one_wave and fp8_staged else FP8_SCHEDULE
    schedule = schedule or SCHEDULE or (fp8_default if is_fp8 else "seesaw")
    if schedule not in ("split", "seesaw", "asym"):
        raise ValueError(f"schedule must be 'split', 'seesaw' or 'asym', got {schedule!r}")
    if schedule == "asym" and not fp8_staged:
        raise ValueError("the asym schedule needs staged fp8_ds_mla rows")
    if consumer_expand and not (fp8_staged and schedule in ("split", "asym")):
        raise ValueError(
            "consumer_expand needs staged fp8_ds_mla rows and the split or asym schedule"
        )
    consumer_expand = schedule == "asym" or (
        (FP8_CONSUMER_EXPAND if consumer_expand is None else bool(consumer_expand))
        and fp8_staged
        and schedule == "split"
    )
    # the wide raw copies and 4-byte scale copies pay off when the consumers expand the rows; the
    # producer-expanded path keeps its copies unless told otherwise (1.050 vs 0.975 ms at T=1024)
    scale_bytes = (SCALE_BYTES if consumer_expand else 16) if scale_bytes is None else scale_bytes
    wide_copy = (WIDE_COPY and consumer_expand) if wide_copy is None else bool(wide_copy)
    if scale_bytes not in (4, 16):
        raise ValueError(f"scale_bytes must be 4 or 16, got {scale_bytes!r}")
    # 64-row blocks in 2 stages fill the shared memory; the register file is split evenly at
    # launch and rebalanced by setmaxnreg
    block_n, num_stages = 64, 2
    if schedule == "asym" and (ASYM_BLOCK_N if asym_block_n is None else asym_block_n) == 32:
        block_n, num_stages = 32, 4  # the same shared memory in twice as many stages
    meta = dict(
        IS_FP8=is_fp8, ROW_BYTES=row_bytes, BLOCK_N=block_n, NUM_STAGES=num_stages,
        PRODUCER_WARPS=PRODUCER_WARPS, PRODUCER_REGS=producer_regs, FP8_ROWS=fp8_rows,
        DEQUANT=dequant, CONSUMER_REGS=consumer_regs(producer_regs), FP8_STAGED=fp8_staged,
        TRACE=trace, Q_ASYNC=Q_ASYNC if q_async is None else bool(q_async),
        # (no room beside the FP8 seesaw's tile scales: 233 KB)
        IDX_SMEM=not (is_fp8 and schedule == "seesaw")
        and (IDX_SMEM if idx_smem is None else bool(idx_smem)),
        EARLY_RELEASE=EARLY_RELEASE if early_release is None else bool(early_release),
        CONSUMER_EXPAND=consumer_expand, SCALE_BYTES=scale_bytes,
        WIDE_COPY=wide_copy,
        num_warps=PRODUCER_WARPS, maxnreg=launch_maxnreg(),
    )  # fmt: skip
    if schedule == "asym":
        asym_order = asym_order or ASYM_ORDER
        if asym_order not in ("expand_first", "pv_first"):
            raise ValueError(f"asym_order must be 'expand_first' or 'pv_first', got {asym_order!r}")
        meta["ASYM_PV_FIRST"] = asym_order == "pv_first"
        meta["ASYM_HALVES"] = bool(ASYM_HALVES if asym_halves is None else asym_halves)
    elif asym_order is not None or asym_halves is not None:
        raise ValueError("asym_order and asym_halves apply to the asym schedule only")
    kernel = dict(seesaw=_sparse_mla_seesaw_kernel, split=_sparse_mla_ws_kernel,
                  asym=_sparse_mla_asym_kernel)[schedule]  # fmt: skip
    step = 2 * block_n if schedule == "seesaw" else block_n  # seesaw: blocks in pairs
    return kernel, meta, step


def _query_copyable(q: torch.Tensor) -> bool:
    return (
        q.dtype == torch.bfloat16 and q.stride(2) == 1 and q.data_ptr() % 16 == 0
        and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0
    )  # fmt: skip


def sparse_mla_ws(
    q, kv_rows, is_fp8, row_bytes, indices, sm_scale, out_dtype, num_splits, **tuning
):
    """Launch on [T, 64-or-fewer heads, 576] queries; returns (part_o, part_l) with a leading
    split dim like the Triton kernel's partials (``num_splits`` slices of ``indices``).

    ``tuning`` (the result does not depend on it beyond bf16 rounding; see
    :func:`launch_config`): ``schedule`` ("split" / "seesaw" / "asym"), ``fp8_staged`` (FP8 rows
    through shared memory or registers), ``producer_regs`` (the producer's setmaxnreg),
    ``fp8_rows`` (rows per producer batch), ``dequant`` (0: e4m3 -> fp32 conversion
    instructions, scale, -> bf16; 1: integer bit moves and one bf16 fma), ``consumer_expand``,
    ``wide_copy``, ``scale_bytes``, ``asym_block_n``, ``asym_order``, ``asym_halves``,
    ``q_async``, ``idx_smem`` and ``early_release`` (module defaults: ``FP8_CONSUMER_EXPAND``,
    ``WIDE_COPY``, ``SCALE_BYTES``, ``ASYM_BLOCK_N``, ``ASYM_ORDER``, ``ASYM_HALVES``,
    ``Q_ASYNC``, ``IDX_SMEM``, ``EARLY_RELEASE``). Without ``schedule``, fp8_ds_mla rows take
    ``FP8_ONE_WAVE_SCHEDULE`` when ``T · num_splits`` programs fit the SMs at one each, else
    ``FP8_SCHEDULE``."""
    t, h, _ = q.shape
    k = indices.shape[1]
    trace = tuning.pop("trace", None)  # a [T·splits, TRACE_SLOTS] int64 tensor: see _stamp
    if not _query_copyable(q):  # cp.async moves aligned 16-byte pieces of bf16
        tuning["q_async"] = False
    one_wave = t * max(1, num_splits) <= _num_sms(q.device.index)
    kernel, meta, step = launch_config(is_fp8, row_bytes, trace=trace is not None, one_wave=one_wave,
                                       **tuning)  # fmt: skip
    k_per_split = triton.cdiv(triton.cdiv(max(k, 1), num_splits), step) * step
    if k_per_split > IDX_CAP:  # the slice's ids do not fit the shared-memory copy
        meta["IDX_SMEM"] = False
    splits = max(1, triton.cdiv(k, k_per_split))
    odt = torch.float32 if splits > 1 else out_dtype
    part_o = torch.empty(splits, t, h, D_NOPE, dtype=odt, device=q.device)
    part_l = torch.empty(splits, t, h, dtype=torch.float32, device=q.device)
    kernel[(t, splits)](
        q, kv_rows, indices, part_o, part_l, sm_scale * 1.4426950408889634, h, k, k_per_split,
        q.stride(0), q.stride(1), indices.stride(0), kv_rows.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l.stride(0), part_l.stride(1),
        trace if trace is not None else part_l, **meta,
    )  # fmt: skip
    return part_o, part_l
