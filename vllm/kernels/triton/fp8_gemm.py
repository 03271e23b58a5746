"""FP8 block-scaled linear in Triton: per-token-group activation quantisation and the w8a8
block-scaled GEMM (spec and references: :mod:`vllm.kernels.fp8_gemm`).

    quant_per_token_group(x, group)        == per_token_group_quant_fp8_ref(x, group)   (bit-exact)
    fp8_block_gemm(x, weight, scale, block) ≈ fp8_block_linear_ref(...)   (fp32 sum order only)

Naive path and its traffic: dequantising the weight to bf16 and calling F.linear reads N·K fp8
bytes, writes and reads back 2·N·K bf16 bytes, then runs a bf16 GEMM: 5x the weight traffic of
this path at decode sizes, and half the tensor-core rate at prefill sizes.

GEMM: one program per (BLOCK_M × BLOCK_N) output tile and K split; BLOCK_K = bk, so each K step
is one scale group: acc += dot(xq_tile, wq_tileᵀ) · sx[:, kb] · sw[n // bn, kb] (e4m3 × e4m3 on
the tensor cores, fp32 accumulate; the scale multiply per K block, as DeepSeek-V3 does). Tiles
come from a fixed table by M (:func:`gemm_config`), not autotuned, so the serving path compiles a
handful of variants at warm-up and never times configurations. Decode sizes (M <= 64) use 16- to
64-row tiles; a grid of fewer than two programs per SM (decode, narrow N) splits K until it covers
the GPU twice. The GEMM can quantise x itself, per K block, with the quantiser's arithmetic (the
same e4m3 bytes and scales): one launch instead of two, slower on the H200 (``FUSED_QUANT_MAX_M``
= 0, off). Split K is
summed inside the kernel: each split stores its fp32 partial, bumps its tile's counter (acq_rel)
and the last to arrive adds the partials in the order 0..split-1, whatever the order of arrival
(deterministic), writes the output and resets the counter. Nothing reads a device value on the
host: CUDA-graph capturable.

Quantisation: one program per row and BLOCK_G groups; IEEE division for the scale and the
quotient (``div_rn``, as the reference's fp32 tensor-by-tensor ``/``), round to nearest even into
e4m3 (sm_90's cvt.rn.satfinite; inputs are clamped to ±448 first, so saturation never differs from
torch's cast). Scales are stored M-contiguous ([ng, M] storage, returned as the transposed view
[M, ng]): coalesced loads in the GEMM, and the layout cuBLAS's 1x128 block scaling wants, whose
rows the caller may pad (``row_multiple``). The CPU interpreter mis-rounds fp32 -> e4m3 and bf16
arithmetic, so there the encoder is the exact integer one and operands are fp32 after loading.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm.kernels.fp8_gemm import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, split_counter_set
from vllm.kernels.triton.utils import check_cuda_or_interpreter, e4m3_bits, interpreting, record

__all__ = ["quant_per_token_group", "fp8_block_gemm", "gemm_config"]

# decided once, when the kernels are defined (Triton binds to the interpreter at import)
_UPCAST = interpreting()


@triton.jit
def _quant_groups(x, FLOOR: tl.constexpr, QMAX: tl.constexpr, SOFT_FP8: tl.constexpr):
    """x fp32 [R, GROUP], one quantisation group per row (zeros where masked off) -> (e4m3 bits
    uint8 [R, GROUP], scale fp32 [R]): the reference's arithmetic, so the same bits."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), FLOOR), QMAX)
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    return e4m3_bits(q, SOFT_FP8), scale


@triton.jit
def _group_quant_kernel(
    x_ptr,  # [M, K] bf16/fp16/fp32, strides (stride_xm, 1)
    q_ptr,  # uint8 view of e4m3 [M_pad, K], strides (stride_qm, 1)
    s_ptr,  # fp32 [M_pad, ng], strides (stride_sm, stride_sg)
    M,  # rows of x; rows M..M_pad-1 of q and s are written as an all-zero row's
    K,
    num_groups,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sg,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    SOFT_FP8: tl.constexpr,  # interpreter: exact integer e4m3 encoder
):
    row = tl.program_id(0).to(tl.int64)
    offs_g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BLOCK_G]
    cols = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [BLOCK_G, GROUP]
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask & (row < M), other=0.0).to(tl.float32)
    q, scale = _quant_groups(x, FLOOR, QMAX, SOFT_FP8)  # [BLOCK_G, GROUP] uint8, [BLOCK_G]
    tl.store(q_ptr + row * stride_qm + cols, q, mask=mask)
    tl.store(s_ptr + row * stride_sm + offs_g * stride_sg, scale, mask=offs_g < num_groups)


def quant_per_token_group(
    x: torch.Tensor, group: int = 128, row_multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq e4m3 [M_pad, K], scale fp32 [M_pad, ceil(K/group)] as an M-contiguous view)
    with M_pad = M rounded up to ``row_multiple``; the padding rows are an all-zero row's (xq 0,
    scale AMAX_FLOOR / 448), for callers whose GEMM needs aligned rows (cuBLAS's 1x128 scales).

    Spec: :func:`vllm.kernels.fp8_gemm.per_token_group_quant_fp8`; ``group`` a power of two."""
    check_cuda_or_interpreter(x)
    m, k = x.shape
    m_pad = -(-m // row_multiple) * row_multiple
    ng = triton.cdiv(k, group)
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty(m_pad, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(ng, m_pad, dtype=torch.float32, device=x.device).t()  # [M_pad, ng], (1, M_pad)
    if m_pad == 0 or k == 0:
        return q, s
    block_g = min(8, triton.next_power_of_2(ng))
    grid = (m_pad, triton.cdiv(ng, block_g))
    _group_quant_kernel[grid](
        x, q.view(torch.uint8), s, m, k, ng, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
        GROUP=group, BLOCK_G=block_g, FLOOR=AMAX_FLOOR, QMAX=FP8_MAX, SOFT_FP8=_UPCAST, num_warps=4,
    )  # fmt: skip
    return q, s


@triton.jit
def _a_tile(
    a_ptrs,  # [BLOCK_M, BLOCK_K] into x (QUANT_A) or into e4m3 xq
    as_ptrs,  # [BLOCK_M] into xq's scales (not QUANT_A)
    mask,  # [BLOCK_M, BLOCK_K], or [BLOCK_M, 1] when K needs no mask
    mmask,  # [BLOCK_M]
    QUANT_A: tl.constexpr,
    SOFT_FP8: tl.constexpr,
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
):
    """The e4m3 activation tile of one K block (= one quantisation group) and its scales: loaded,
    or quantised here from x with the quantiser's arithmetic (the same bytes as its output)."""
    if QUANT_A:
        x = tl.load(a_ptrs, mask=mask, other=0.0).to(tl.float32)
        bits, sa = _quant_groups(x, FLOOR, QMAX, SOFT_FP8)
        return bits.to(tl.float8e4nv, bitcast=True), sa
    else:
        return tl.load(a_ptrs, mask=mask, other=0.0), tl.load(as_ptrs, mask=mmask, other=0.0)


@triton.jit
def _store_tile(
    acc,  # fp32 [BLOCK_M, BLOCK_N], this program's sum over its K blocks
    o_ptrs,  # [BLOCK_M, BLOCK_N] into the output [M, N] (x.dtype)
    p_ptrs,  # [BLOCK_M, BLOCK_N] into slice 0 of the fp32 partials [SPLIT, M, N]
    cnt_ptr,  # int32 [>= tiles]: zero on entry, zero again on exit
    mask,
    stride_ps,  # elements per partials slice (M · N)
    PARTIALS: tl.constexpr,  # K is split: write the partial into its slice
    REDUCE: tl.constexpr,  # ...and the tile's last split sums the slices into the output
):
    if not PARTIALS:
        tl.store(o_ptrs, acc.to(o_ptrs.dtype.element_ty), mask=mask)
    else:
        split = tl.num_programs(1)
        # .cg (L2, the point of coherence): other SMs read these partials within this launch
        tl.store(p_ptrs + tl.program_id(1).to(tl.int64) * stride_ps, acc, mask=mask,
                 cache_modifier=".cg")  # fmt: skip
        if REDUCE:
            # all threads' partial stores precede thread 0's release (a scalar atomic is issued
            # by one thread and its result broadcast to the others through shared memory)
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
            if arrived == split - 1:  # the last split of this tile: every partial is visible
                total = tl.zeros_like(acc)
                for _ in range(0, split):  # slices 0..split-1, whatever the order of arrival
                    total += tl.load(p_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                    p_ptrs += stride_ps
                tl.store(o_ptrs, total.to(o_ptrs.dtype.element_ty), mask=mask)
                tl.store(cnt_ptr + tl.program_id(0), 0)  # clean for the next launch or replay


@triton.jit
def _block_gemm_kernel(
    a_ptr,  # QUANT_A: x [M, K] bf16/fp16/fp32; else e4m3 xq [M, K]; strides (stride_am, 1)
    as_ptr,  # fp32 [M, ceil(K/BLOCK_K)], strides (stride_asm, stride_ask); unread when QUANT_A
    w_ptr,  # e4m3 [N, K], strides (stride_wn, 1)
    ws_ptr,  # fp32 [ceil(N/group_n), ceil(K/BLOCK_K)], strides (stride_wsn, stride_wsk)
    out_ptr,  # [M, N] in x.dtype, strides (stride_om, 1)
    part_ptr,  # PARTIALS: fp32 [SPLIT, M, N] contiguous
    cnt_ptr,  # REDUCE: int32 [>= number of output tiles], all zero
    M,
    N,
    K,
    k_blocks_per_split,
    stride_am,
    stride_asm,
    stride_ask,
    stride_wn,
    stride_wsn,
    stride_wsk,
    stride_om,
    UPCAST: tl.constexpr,  # interpreter: fp32 operands (its fp8/bf16 arithmetic is wrong)
    QUANT_A: tl.constexpr,  # a is x: quantise each K block here (decode sizes)
    PARTIALS: tl.constexpr,
    REDUCE: tl.constexpr,
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # = the scale group along K
    GROUP_M: tl.constexpr,  # row tiles per L2 group (prefill: weight tiles reused from L2)
    GROUP_N: tl.constexpr,  # the weight scales' block along N
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask (every GLM-5.3 linear)
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    kb0 = pid_k * k_blocks_per_split
    kb1 = tl.minimum(kb0 + k_blocks_per_split, tl.cdiv(K, BLOCK_K))
    # [BLOCK_M, BLOCK_K] and [BLOCK_K, BLOCK_N] tiles, both K-contiguous (what fp8 wgmma takes)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + (kb0 * BLOCK_K + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + (kb0 * BLOCK_K + offs_k)[:, None]
    as_ptrs = as_ptr + offs_m * stride_asm + kb0 * stride_ask  # [BLOCK_M]
    ws_ptrs = ws_ptr + (offs_n // GROUP_N) * stride_wsn + kb0 * stride_wsk  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in range(kb0, kb1):
        if EVEN_K:
            amask = mmask[:, None]
            wmask = nmask[None, :]
        else:
            kmask = offs_k < K - kb * BLOCK_K
            amask = mmask[:, None] & kmask[None, :]
            wmask = kmask[:, None] & nmask[None, :]
        a, sa = _a_tile(a_ptrs, as_ptrs, amask, mmask, QUANT_A, UPCAST, FLOOR, QMAX)
        w = tl.load(w_ptrs, mask=wmask, other=0.0)
        sw = tl.load(ws_ptrs, mask=nmask, other=0.0)
        if UPCAST:
            part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, w)
        acc += part * sa[:, None] * sw[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        as_ptrs += stride_ask
        ws_ptrs += stride_wsk
    om = offs_m.to(tl.int64)[:, None]
    o_ptrs = out_ptr + om * stride_om + offs_n[None, :]  # [BLOCK_M, BLOCK_N]
    p_ptrs = part_ptr + om * N + offs_n[None, :]  # [BLOCK_M, BLOCK_N], slice 0
    _store_tile(acc, o_ptrs, p_ptrs, cnt_ptr, mmask[:, None] & nmask[None, :], M * N,
                PARTIALS, REDUCE)  # fmt: skip


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: as an H200
    return torch.cuda.get_device_properties(device).multi_processor_count


# Tiles by M (starting points after upstream vLLM's H200 block-FP8 tables, swept by
# benchmarks/kernels/bench_fp8_gemm.py --sweep): (max M, block_m, block_n, num_warps, num_stages).
# 64 rows: 3 stages beat 4 and 6 cold on every wide shape (H100, 2026-12-07: o_proj 48.6 against
# 55.7 µs, mlp down 39.6 / 43.5, q_b 16.4 / 18.3, stacked gate/up 59.5 / 61.6). 32 rows: 3 stages
# as fast as 4 or faster on every shape, cold (H100, 2026-12-07: o_proj 42.4 against 43.7 µs, down
# 33.9 / 34.4, q_a + kv_a 11.5 / 11.7); but a grid of 32-row tiles that needs no K split (a full
# second wave: q_b's 256 tiles, the stacked gate/up's 384) runs faster on the 64-row tile, half
# its rows empty (wgmma; q_b 15.8 against 18.4 µs, stacked gate/up 56.3 against 62.2): WIDE_TILE_ROWS
TILES = [
    (16, 16, 64, 4, 4),
    (32, 32, 64, 4, 3),
    (64, 64, 64, 4, 3),
    (256, 64, 128, 4, 4),
    (1 << 62, 128, 128, 8, 3),
]
# Split-K of the decode grids (gemm_config): a grid under SPLIT_PROGRAMS_PER_SM programs per SM
# splits K to fill it (at least 4 K blocks per split: kv_a's 9 tiles, q_a's 32); a grid under
# SPLIT_MAX_WAVES tiles per SM with a deep K goes on to SPLIT_DEEP_PROGRAMS_PER_SM (at least 16 K
# blocks per split). Decode GEMMs are weight reads: more programs keep more loads in flight, but
# short splits cost a pipeline fill each and their fp32 partials (split x M x N x 4 bytes) grow
# against the weight. H100, graph replays, M = 1 / 16 / 64 (bench_fp8_gemm.py --split, same
# call, 2026-12-06), 2 programs per SM against 4: o_proj 43.2 / 49.3 / 66.3 -> 40.8 / 42.9 /
# 64.7 µs, mlp gate/up (192 tiles, unsplit before) 33.6 / 37.4 / 48.4 -> 31.8 / 33.8 / 42.2,
# mlp_down 34.6 / 39.3 / 53.3 -> 32.5 / 34.0 / 51.6; but q_a+kv_a split 12 ways (4 K blocks each)
# 9.5 / 10.1 / 14.4 -> 10.1 / 10.7 / 20.3 and q_a 8.8 / 9.3 / 14.1 -> 9.3 / 9.8 / 15.3, hence the
# depth rule, which leaves those at their old split; q_b (256 tiles, ~2 waves) slower split.
SPLIT_PROGRAMS_PER_SM = 2
# rows (exclusive, inclusive) where an unsplit grid of the table's tile takes the 64-row tile
WIDE_TILE_ROWS = (16, 32)
SPLIT_DEEP_PROGRAMS_PER_SM = 4
SPLIT_MAX_WAVES = 1.5
# Rows up to which the GEMM quantises x itself in its K loop (one launch instead of two): 0, off.
# Each program quantises its own [BLOCK_M, 128] block of x per K step, so every N tile repeats
# the work (x read in 16 bits, two IEEE divisions per element, N / BLOCK_N times over), and the
# divisions sit between the loads and the dot, in the pipeline's way. On the H200 it lost at every
# size (bench_fp8_gemm.py, graph replays, 2026-12-05): M = 1 o_proj 232.6 µs against 38.0 µs with
# the separate quantiser, mlp gate/up 172.4 against 29.4, q_a 25.1 against 8.4; at M = 16 it is
# 1.1-2.0x slower except kv_a (8.9 against 7.7 µs separate). Kept switchable for the tests and the
# benchmark's comparison (docs/design/fp8.md).
FUSED_QUANT_MAX_M = 0
# Split-K arrival counters, one int32 per output tile, zero between launches (each tile's last
# split resets its own). One buffer per device, zeroed by an eager call and then kept for the
# process: captured graphs hold its address, so it is never freed or replaced. The table splits
# only grids of fewer than SPLIT_MAX_WAVES * num_sms tiles (gemm_config); a call needing more
# slots (forced configs), or one made inside a capture before any eager call (a zeroing memset
# would run only at replay), gets its own torch.zeros buffer: one memset more, correct everywhere, in graphs too. Launches
# that share a buffer must run one after another: those queued on the compute stream do; GEMMs
# queued on a side stream that runs beside it (the MoE's shared expert) take a second set
# (``vllm.kernels.fp8_gemm.own_split_counters``). Keyed by (device, set), not by stream: graph
# capture runs on a capture stream of its own, and its GEMMs should find the eager calls' buffer.
COUNTER_SLOTS = 1024
_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """All-zero int32 [>= tiles] counters for an in-kernel split-K reduction, of the current
    counter set; no host sync."""
    key = (device, split_counter_set())
    buf = _COUNTERS.get(key)
    if buf is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        buf = _COUNTERS[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    if buf is None or tiles > buf.numel():
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    return buf


def gemm_config(
    m: int, n: int, k: int, block_k: int, num_sms: int, tile: tuple | None = None
) -> dict:
    """The fixed config for an [M, K] x [N, K]ᵀ call: tile sizes from :data:`TILES` (or ``tile``
    = (block_m, block_n, num_warps, num_stages), the benchmark's sweep), the K split that fills
    the GPU when the output has few tiles (decode sizes; narrow N such as kv_a's 576), reduced
    inside the kernel, and whether the kernel quantises x itself (:data:`FUSED_QUANT_MAX_M`).
    ``reduce_in_kernel=False`` (partials summed by torch, as before issue 35) and ``fuse_quant``
    against the table are for the tests and the benchmark's comparison."""
    block_m, block_n, warps, stages = tile or next(t[1:] for t in TILES if m <= t[0])
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if tile is None and WIDE_TILE_ROWS[0] < m <= WIDE_TILE_ROWS[1]:
        if tiles >= SPLIT_MAX_WAVES * num_sms:  # unsplit: the 64-row tile (TILES' comment)
            block_m, block_n, warps, stages = next(t[1:] for t in TILES if t[0] >= 64)
            tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    nkb = triton.cdiv(k, block_k)
    split = max(1, min(nkb // 4, SPLIT_PROGRAMS_PER_SM * num_sms // tiles))
    if tiles < SPLIT_MAX_WAVES * num_sms:
        split = max(split, min(nkb // 16, SPLIT_DEEP_PROGRAMS_PER_SM * num_sms // tiles))
    per_split = triton.cdiv(nkb, split)
    return dict(
        block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
        split_k=triton.cdiv(nkb, per_split), k_blocks_per_split=per_split, group_m=8,
        fuse_quant=m <= FUSED_QUANT_MAX_M, reduce_in_kernel=True,
    )  # fmt: skip


def fp8_block_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    cfg: dict | None = None,
    x_quant: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`vllm.kernels.fp8_gemm.fp8_block_linear` on the GPU (spec there). ``cfg`` overrides
    :func:`gemm_config` (tests and the benchmark's sweep). ``x_quant``: x already quantised,
    :func:`quant_per_token_group`'s (xq, scale) of x (by a producer that fused it), so the GEMM
    runs alone; x then gives only the shape and dtype."""
    check_cuda_or_interpreter(x, weight, weight_scale_inv)
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return torch.empty(*lead, n, dtype=x.dtype, device=x.device)
    if k == 0:
        return torch.zeros(*lead, n, dtype=x.dtype, device=x.device)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    cfg = cfg or gemm_config(m, n, k, block[1], _num_sms(x.device))
    if x_quant is not None:
        cfg = cfg | dict(fuse_quant=False)
    return _gemm(x2, weight, weight_scale_inv, block, cfg, x_quant).reshape(*lead, n)


def _gemm(x2, weight, weight_scale_inv, block, cfg, x_quant=None) -> torch.Tensor:
    """x2 [M, K] (unit last stride) -> [M, N] in x2.dtype: one launch, or two with the separate
    quantisation pass, or three with torch's sum of the partials (cfg["reduce_in_kernel"] off)."""
    (m, k), n, (bn, bk) = x2.shape, weight.shape[0], block
    if x_quant is not None:
        a, sa = x_quant
    elif cfg["fuse_quant"]:
        a, sa = x2, x2  # sa: a placeholder, the kernel quantises a itself
    else:
        a, sa = quant_per_token_group(x2, bk)
    split, reduce = cfg["split_k"], cfg["reduce_in_kernel"]
    tiles = triton.cdiv(m, cfg["block_m"]) * triton.cdiv(n, cfg["block_n"])
    part = torch.empty(split, m, n, dtype=torch.float32, device=x2.device) if split > 1 else None
    out = part if split > 1 and not reduce else torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    cnt = _split_counters(x2.device, tiles) if split > 1 and reduce else out
    compiled = _block_gemm_kernel[(tiles, split)](
        a, sa, weight, weight_scale_inv, out, out if part is None else part, cnt,
        m, n, k, cfg["k_blocks_per_split"], a.stride(0), sa.stride(0), sa.stride(1),
        weight.stride(0), weight_scale_inv.stride(0), weight_scale_inv.stride(1), out.stride(-2),
        UPCAST=_UPCAST, QUANT_A=cfg["fuse_quant"], PARTIALS=split > 1, REDUCE=reduce,
        FLOOR=AMAX_FLOOR, QMAX=FP8_MAX, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
        BLOCK_K=bk, GROUP_M=cfg["group_m"], GROUP_N=bn, EVEN_K=k % bk == 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    record("fp8_gemm", compiled)
    return part.sum(0).to(x2.dtype) if split > 1 and not reduce else out
