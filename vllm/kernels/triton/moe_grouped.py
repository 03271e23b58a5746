"""Routed SwiGLU experts as two grouped GEMMs in Triton, with no host synchronisation (spec:
:mod:`vllm.kernels.moe`).

    experts_grouped(x, w13, w2, ids, weights, expert_offset) == experts_ref(...)

x [T, H]; w13 [E_loc, 2I, H] (gate rows first, then up); w2 [E_loc, H, I] (all one dtype);
ids [T, k] global expert ids; weights [T, k] fp32. A (token, slot) pair p = t·k + j whose expert
lies outside [expert_offset, expert_offset + E_loc) belongs to another rank and contributes 0.
Returns [T, H] in x.dtype:

    out[t] = Σ_j weights[t, j] · (silu(x[t]·gateᵀ) * (x[t]·upᵀ)) · w2ᵀ   (local experts; fp32 sum)

How: the P = T·k pairs are sorted by local expert (invalid pairs last) and each expert's run is
padded to a multiple of BLOCK_M, so every block of BLOCK_M sorted slots has one expert
(``block_expert``; −1 past the last expert's end) and empty slots hold P. Everything is sized by
the worst case, NB = min(cdiv(P, BLOCK_M) + E_loc, P) blocks, and built by Triton kernels (or, on
the CPU, torch ops) that never read a device value on the host (no .item(), nonzero, unique,
boolean indexing), so the whole
forward is one fixed sequence of launches, CUDA-graph capturable. GEMM 1 gathers token rows of x
and writes [P, 2I] rows at their pair index; SiLU·up in torch (x.dtype, as the reference rounds);
GEMM 2 scales each row by its routing weight and writes fp32 [P, H]; a last pass sums each
token's local slots in slot order and casts (deterministic, no atomics). Rows of invalid pairs are
never loaded, written or summed, so garbage there cannot reach the result (and no buffer needs a
zero fill).

Traffic: each chosen expert's weights are read once per BLOCK_M-row block of its pairs (once for
decode batches); the reference reads them once but syncs and launches six ops per chosen expert.
bf16 operands go to ``tl.dot`` as bf16 with fp32 accumulation; fp32 operands use IEEE dots. The
CPU interpreter's bf16 arithmetic is wrong, so there operands are converted to fp32 after loading.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.triton.moe_sort import SORT_MAX_BINS, padded_blocks
from vllm.kernels.triton.utils import check_cuda_or_interpreter, interpreting, record

__all__ = ["experts_grouped", "sort_pairs_by_expert", "TUNE"]

# decided once, when the kernel is defined (Triton binds to the interpreter at import)
_UPCAST = interpreting()

# Tiles of both GEMMs (untuned: to be swept on the H200). Decode-sized batches (a few pairs per
# expert) waste most of a 64-row block and may prefer block_m=16, the smallest tl.dot takes.
TUNE = {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3}


# Row blocks per group in the program order: a group's blocks sweep every column tile before the
# next group starts, so a group's A rows are re-read from L2 across the column tiles and each
# weight tile is read once for the group's blocks of its expert (adjacent in the sorted layout).
# With the row block fastest (one 2-D grid) every column tile swept all of A again: at an 8K-token
# prefill over 256 experts that was ~13 GB of A rows read from HBM against 9.7 GB of weights.
GROUP_M = tl.constexpr(8)


@triton.jit
def grouped_pids(num_m, num_n, GROUP: tl.constexpr):
    """(row block, column tile) of this program of a 1-D grid of num_m · num_n: GROUP row
    blocks at a time, each group through every column tile."""
    pid = tl.program_id(0)
    per_group = GROUP * num_n
    first_m = (pid // per_group) * GROUP
    rows = tl.minimum(num_m - first_m, GROUP)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K]: x (rows = tokens, GEMM 1) or h (rows = pairs, GEMM 2)
    w_ptr,  # [E_loc, N, K], strides (stride_we, stride_wn, stride_wk)
    out_ptr,  # [P, N], strides (stride_om, 1)
    sorted_pairs_ptr,  # int32 [NB · BLOCK_M]: pair ids grouped by expert, P = empty slot
    block_expert_ptr,  # int32 [NB]: local expert of each block, −1 = past the end
    route_w_ptr,  # fp32 [P] routing weights (read only when MUL_WEIGHT)
    num_pairs,
    num_m,  # NB
    N,
    K,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    PAIRS_PER_ROW: tl.constexpr,  # A row = pair // PAIRS_PER_ROW (top_k for GEMM 1, else 1)
    MUL_WEIGHT: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter: fp32 operands (its bf16 arithmetic is wrong)
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = grouped_pids(num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    pmask = pair < num_pairs
    pair = pair.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    # [BLOCK_M, BLOCK_K] and [BLOCK_K, BLOCK_N] tiles; int64 row offsets (P·N and E·N·K can
    # pass 2^31)
    a_ptrs = a_ptr + (pair // PAIRS_PER_ROW)[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = (
        w_ptr
        + expert.to(tl.int64) * stride_we
        + offs_n.to(tl.int64)[None, :] * stride_wn
        + offs_k[:, None] * stride_wk
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=pmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if MUL_WEIGHT:
        acc = acc * tl.load(route_w_ptr + pair, mask=pmask, other=0.0)[:, None]
    o_ptrs = out_ptr + pair[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=pmask[:, None] & nmask[None, :])


# the one-program layout's limits: pairs sorted in one program (a bitonic sort of packed
# (expert, pair) keys in registers), local experts + 1 histogram bins
ONE_PROGRAM_MAX_PAIRS = 4096
ONE_PROGRAM_MAX_EXPERTS = 511
# served by default up to this many pairs; past it the counting sort's four launches beat the one
# program's sort (bench_moe_sort.py)
ONE_PROGRAM_SERVED_PAIRS = 1024


@triton.jit
def _pair_layout_kernel(
    ids_ptr,  # [P] global expert ids (any integer dtype)
    sorted_pairs_ptr,  # int32 [NB · BLOCK_M]
    block_expert_ptr,  # int32 [NB]
    num_pairs,
    expert_offset,
    e_loc,
    num_blocks,  # NB
    BLOCK_M: tl.constexpr,
    PB: tl.constexpr,  # pairs, padded to a power of two
    E_PAD: tl.constexpr,  # local experts + 1, padded to a power of two
    FILL: tl.constexpr,
    BB: tl.constexpr,
):
    """:func:`sort_pairs_by_expert`'s layout in one program: a histogram of the experts, one
    sort of (expert · PB + pair) keys (unique: the sort is stable by construction), a pair's
    rank = its sorted position − its expert's first sorted position."""
    p = tl.arange(0, PB)
    pmask = p < num_pairs
    local = tl.load(ids_ptr + p, mask=pmask, other=0).to(tl.int32) - expert_offset
    expert = tl.where(pmask & (local >= 0) & (local < e_loc), local, e_loc)  # e_loc: not ours
    counts = tl.histogram(expert, E_PAD)  # [E_PAD]; padding rows land in bin e_loc
    e = tl.arange(0, E_PAD)
    first = tl.cumsum(counts, 0) - counts  # first sorted position of each expert
    padded = tl.where(e < e_loc, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    padded_end = tl.cumsum(padded, 0)
    padded_start = padded_end - padded
    key = tl.sort(expert * PB + p)  # [PB] ascending: by expert, then by pair
    s_expert = key // PB
    s_pair = key % PB
    pos = tl.arange(0, PB)
    rank = pos - tl.gather(first, s_expert, 0)
    dest = tl.gather(padded_start, s_expert, 0) + rank
    for f in range(0, num_blocks * BLOCK_M, FILL):  # every slot empty first
        offs = f + tl.arange(0, FILL)
        tl.store(sorted_pairs_ptr + offs, tl.zeros((FILL,), tl.int32) + num_pairs,
                 mask=offs < num_blocks * BLOCK_M)  # fmt: skip
    tl.debug_barrier()  # the fill's stores before the pairs' (other threads, same slots)
    tl.store(sorted_pairs_ptr + dest, s_pair, mask=s_expert < e_loc)
    # block b belongs to the expert whose padded run holds slot b · BLOCK_M: the number of
    # experts that end at or before it (searchsorted, right), −1 past the last
    ends = tl.where(e < e_loc, padded_end, 2147483647)
    for b0 in range(0, num_blocks, BB):
        b = b0 + tl.arange(0, BB)
        before = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(before < e_loc, before, -1), mask=b < num_blocks)


def _pair_layout_one_program(ids, expert_offset, e_loc, block_m, nb):
    p = ids.numel()
    sorted_pairs = torch.empty(nb * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=ids.device)
    compiled = _pair_layout_kernel[(1,)](
        ids.reshape(-1), sorted_pairs, block_expert, p, expert_offset, e_loc, nb,
        BLOCK_M=block_m, PB=max(16, triton.next_power_of_2(p)),
        E_PAD=max(16, triton.next_power_of_2(e_loc + 1)), FILL=1024, BB=32, num_warps=8,
    )  # fmt: skip
    record("moe_pair_layout", compiled)
    return sorted_pairs, block_expert


# up to here (pairs × (local experts + 1)) the layout ranks pairs by a one-hot prefix sum, past it
# by a stable sort; both give the same slots
SCAN_MAX_ELEMENTS = 1 << 21


LAYOUT_FORMS = ("one_program", "counting", "scan", "sort")


def sort_pairs_by_expert(
    ids: torch.Tensor,
    expert_offset: int,
    num_local_experts: int,
    block_m: int,
    form: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] global expert ids -> (sorted_pairs int32 [NB · block_m], block_expert int32
    [NB]), NB = min(cdiv(P, block_m) + E_loc, P), P = T·k (P >= 1).

    Each local expert e owns the slots [padded_start[e], padded_start[e] + cdiv(count_e, block_m)
    · block_m): its pairs in ascending pair order, then P (empty). block_expert[b] = e for the
    blocks of e, −1 past the last expert's end. Every form is sync-free on CUDA (the torch forms
    count by scatter_add: CUDA bincount reads the maximum on the host).

    ``form`` (all give the same layout):

    - ``"one_program"``: one Triton program (:func:`_pair_layout_kernel`), up to
      :data:`ONE_PROGRAM_MAX_PAIRS` pairs and :data:`ONE_PROGRAM_MAX_EXPERTS` local experts;
    - ``"counting"``: :func:`vllm.kernels.triton.moe_sort.padded_blocks` (the counting sort's
      three launches, then one program per block), up to ``SORT_MAX_BINS - 2`` local experts;
    - ``"scan"``: torch, a pair's rank by a prefix sum over a one-hot [E_loc + 1, P] table;
    - ``"sort"``: torch, a stable argsort.

    Default: on CUDA the one program up to :data:`ONE_PROGRAM_SERVED_PAIRS` pairs, else the
    counting sort; the torch forms past both and on the CPU (scan up to
    :data:`SCAN_MAX_ELEMENTS` table elements, else sort)."""
    e_loc, dev = num_local_experts, ids.device
    p = ids.numel()
    # each block holds at least one pair, hence the P bound
    nb = min(triton.cdiv(p, block_m) + e_loc, p)
    if form is None:
        if ids.is_cuda and p <= ONE_PROGRAM_SERVED_PAIRS and e_loc <= ONE_PROGRAM_MAX_EXPERTS:
            form = "one_program"
        elif ids.is_cuda and e_loc + 2 <= SORT_MAX_BINS:
            form = "counting"
        else:
            form = "scan" if p * (e_loc + 1) <= SCAN_MAX_ELEMENTS else "sort"
    if form not in LAYOUT_FORMS:
        raise ValueError(f"form {form!r}: one of {LAYOUT_FORMS}")
    if form == "one_program":
        if p > ONE_PROGRAM_MAX_PAIRS or e_loc > ONE_PROGRAM_MAX_EXPERTS:
            raise ValueError(
                f"{p} pairs over {e_loc} local experts: the one-program layout holds "
                f"{ONE_PROGRAM_MAX_PAIRS} and {ONE_PROGRAM_MAX_EXPERTS}"
            )
        check_cuda_or_interpreter(ids)
        return _pair_layout_one_program(ids, expert_offset, e_loc, block_m, nb)
    if form == "counting":
        return padded_blocks(ids, expert_offset, e_loc, block_m, nb)
    local = ids.reshape(-1).long() - expert_offset
    expert = torch.where((local >= 0) & (local < e_loc), local, e_loc)  # [P], e_loc = other rank
    pair = torch.arange(p, device=dev)
    if form == "scan":
        onehot = expert.unsqueeze(0) == torch.arange(e_loc + 1, device=dev).unsqueeze(1)
        seen = onehot.to(torch.int32).cumsum(
            1, dtype=torch.int32
        )  # [E_loc + 1, P]: pairs of e up to and at q
        counts = seen[:, -1].long()
        rank = seen.gather(0, expert.unsqueeze(0)).squeeze(0).long() - 1
        src = pair
    else:
        order = torch.argsort(expert, stable=True)  # [P] pair ids by expert, invalid last
        counts = torch.zeros(e_loc + 1, dtype=torch.int64, device=dev)
        counts.scatter_add_(0, expert, torch.ones_like(expert))
        expert = expert[order]
        rank = pair - (counts.cumsum(0) - counts)[expert]
        src = order
    padded = (counts + block_m - 1) // block_m * block_m
    padded[e_loc:].zero_()  # a device fill: an indexed store of a host scalar is a copy
    padded_end = padded.cumsum(0)  # [E_loc + 1]
    padded_start = padded_end - padded
    # invalid pairs go to a spill slot past the end, dropped below
    dest = torch.where(expert < e_loc, padded_start[expert] + rank, nb * block_m)
    sorted_pairs = torch.full((nb * block_m + 1,), p, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, src.to(torch.int32))
    block_start = torch.arange(nb, device=dev) * block_m
    block_expert = torch.searchsorted(padded_end[:e_loc], block_start, right=True)
    block_expert = torch.where(block_expert < e_loc, block_expert, -1).to(torch.int32)
    return sorted_pairs[:-1], block_expert


def _grouped_gemm(a, w, out, sorted_pairs, block_expert, route_w, pairs_per_row, cfg) -> None:
    """out[p] = (A[p // pairs_per_row] · W[e_p]ᵀ) (· route_w[p]) for every valid pair p."""
    n, k = w.shape[1], w.shape[2]
    nb = block_expert.numel()
    compiled = _grouped_gemm_kernel[(nb * triton.cdiv(n, cfg["block_n"]),)](
        a, w, out, sorted_pairs, block_expert, route_w, out.shape[0], nb, n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        PAIRS_PER_ROW=pairs_per_row, MUL_WEIGHT=route_w is not None, UPCAST=_UPCAST,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    record("moe_grouped", compiled)


COMBINE_BLOCK = 1024


@triton.jit
def _combine_kernel(
    part_ptr,  # [rows, H]: the pairs' outputs; rows of other ranks' pairs unset
    ids_ptr,  # [T, k] global expert ids
    y_ptr,  # [T, H] x.dtype
    pos_ptr,  # int64 [T·k]: pair -> its row of part (unused unless SORTED)
    w_ptr,  # [T, k] routing weights, strides (stride_wt, stride_wk) (unused unless SORTED)
    expert_offset,
    e_loc,
    H,
    stride_pm,
    stride_it,
    stride_ik,
    stride_wt,
    stride_wk,
    stride_ym,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    SORTED: tl.constexpr,
):
    """y[t] = Σ_j part[row(t, j)] (· weights[t, j] if SORTED) over the token's local pairs, in
    slot order, in fp32, cast to y's dtype: the k-slot sum and the cast in one pass, the rows of
    pairs this rank does not own never read (so ``part`` needs no zero fill). row(t, j) = t·k + j
    (the pairs' own order, weights already applied), or pos[t·k + j] when SORTED (rows sorted by
    expert, weights applied here)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * stride_it + j * stride_ik) - expert_offset
        if (e >= 0) & (e < e_loc):
            if SORTED:
                r = tl.load(pos_ptr + t * TOP_K + j)
                wt = tl.load(w_ptr + t * stride_wt + j * stride_wk).to(tl.float32)
                v = tl.load(part_ptr + r * stride_pm + cols, mask=cmask, other=0.0)
                acc += wt * v.to(tl.float32)
            else:
                acc += tl.load(part_ptr + (t * TOP_K + j) * stride_pm + cols, mask=cmask, other=0.0)
    tl.store(y_ptr + t * stride_ym + cols, acc.to(y_ptr.dtype.element_ty), mask=cmask)


def combine_pairs(
    part: torch.Tensor,
    ids: torch.Tensor,
    expert_offset: int,
    e_loc: int,
    dtype: torch.dtype,
    pos: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """part [rows, H] (unit last stride), ids [T, k] -> [T, H] in ``dtype``: each token's local
    slots summed in slot order in fp32; other ranks' rows never read. Without ``pos``: part is
    fp32 [T·k, H] in pair order (pair t·k + j: token t's slot j), already weighted. With ``pos``
    (int64 [T·k], pair -> its row of part) and ``weights`` [T, k]: rows in another order (sorted
    by expert), each times its routing weight here."""
    t, top_k = ids.shape
    h = part.shape[1]
    y = torch.empty(t, h, dtype=dtype, device=part.device)
    if t == 0 or h == 0:
        return y
    sorted_rows = pos is not None
    w = weights if sorted_rows else ids  # (a placeholder pointer when unused)
    _combine_kernel[(t, triton.cdiv(h, COMBINE_BLOCK))](
        part, ids, y, pos if sorted_rows else ids, w, expert_offset, e_loc, h, part.stride(0),
        ids.stride(0), ids.stride(1), w.stride(0), w.stride(1), y.stride(0), TOP_K=top_k,
        BLOCK=COMBINE_BLOCK, SORTED=sorted_rows,
    )  # fmt: skip
    return y


def experts_grouped(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert_offset: int = 0,
) -> torch.Tensor:
    """:func:`experts_ref`'s result by two grouped GEMMs, without a host sync (module docstring).

    x [T, H]; w13 [E_loc, 2I, H]; w2 [E_loc, H, I] (x's dtype; any strides, a contiguous last
    dim is the fast case); ids [T, k] integer global expert ids; weights [T, k] float. Returns
    [T, H] in x.dtype. Scratch: gate/up [T·k, 2I] in x.dtype and fp32 partial sums [T·k, H]."""
    t, h = x.shape
    e_loc, two_i = w13.shape[0], w13.shape[1]
    inter = two_i // 2
    if w13.shape != (e_loc, 2 * inter, h) or w2.shape != (e_loc, h, inter):
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit x {(t, h)}")
    if ids.dim() != 2 or ids.shape[0] != t or weights.shape != ids.shape:
        raise ValueError(f"ids {tuple(ids.shape)} / weights {tuple(weights.shape)} mismatch")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}: one dtype expected")
    check_cuda_or_interpreter(x, w13, w2, ids, weights)
    top_k = ids.shape[1]
    p = t * top_k
    if p == 0 or e_loc == 0:
        return torch.zeros_like(x)
    cfg = dict(TUNE)
    sorted_pairs, block_expert = sort_pairs_by_expert(ids, expert_offset, e_loc, cfg["block_m"])
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_up = torch.empty(p, two_i, dtype=x.dtype, device=x.device)  # [P, 2I]; invalid rows unset
    _grouped_gemm(x, w13, gate_up, sorted_pairs, block_expert, None, top_k, cfg)
    act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [P, I]
    out = torch.empty(p, h, dtype=torch.float32, device=x.device)  # [P, H]; invalid rows unset
    route_w = weights.reshape(-1).float().contiguous()  # [P]
    _grouped_gemm(act, w2, out, sorted_pairs, block_expert, route_w, 1, cfg)
    return combine_pairs(out, ids, expert_offset, e_loc, x.dtype)
