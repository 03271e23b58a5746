"""The MoE's pairs sorted by local expert on the device, with no host synchronisation: a stable
counting sort in three Triton launches (:func:`sort_pairs`: the sorted order, each pair's row and
the experts' row offsets, as the grouped GEMM over expert-sorted rows takes them,
``vllm/kernels/moe_cutlass.py``), and from it the layout padded to whole row blocks per expert
that the Triton grouped GEMMs take (:func:`padded_blocks`,
:func:`vllm.kernels.triton.moe_grouped.sort_pairs_by_expert`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.triton.utils import check_cuda_or_interpreter, next_pow2

__all__ = ["sort_pairs", "padded_blocks", "SORT_MAX_BINS"]

# pairs a program of the sort ranks (one bitonic sort of that many keys in registers)
SORT_BLOCK = 1024
# rows of the [blocks, bins] count table the scan program holds at once
SCAN_ROWS = 8
# bins (local experts + 2) a program's histogram and scan hold in registers, at most
SORT_MAX_BINS = 1024


@triton.jit(do_not_specialize=("num_pairs", "expert_offset", "e_loc"))
def _pair_count_kernel(
    ids_ptr,  # [P] global expert ids (any integer dtype)
    count_ptr,  # int32 [NB, E_PAD]: block b's pairs per bin
    num_pairs,
    expert_offset,
    e_loc,
    BLOCK: tl.constexpr,
    E_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    p = b * BLOCK + tl.arange(0, BLOCK)
    pm = p < num_pairs
    local = tl.load(ids_ptr + p, mask=pm, other=0).to(tl.int32) - expert_offset
    key = tl.where((local >= 0) & (local < e_loc), local, e_loc)
    key = tl.where(pm, key, e_loc + 1)  # lanes past P: a bin after every real one
    tl.store(count_ptr + b * E_PAD + tl.arange(0, E_PAD), tl.histogram(key, E_PAD))


@triton.jit(do_not_specialize=("nb", "e_loc"))
def _pair_scan_kernel(
    count_ptr,  # int32 [NB, E_PAD]
    base_ptr,  # int32 [NB, E_PAD]: the first sorted row of block b's pairs of bin e
    off_ptr,  # int32 [E_loc + 1]
    nb,
    e_loc,
    E_PAD: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Bin e's rows start after every earlier bin's pairs; within bin e, block b's pairs after
    those of blocks < b (the pair order, so the sort is stable)."""
    e = tl.arange(0, E_PAD)
    total = tl.zeros([E_PAD], tl.int32)
    for b0 in range(0, nb, ROWS):
        r = b0 + tl.arange(0, ROWS)
        c = tl.load(count_ptr + r[:, None] * E_PAD + e[None, :], mask=r[:, None] < nb, other=0)
        total += tl.sum(c, axis=0)
    run = tl.cumsum(total, axis=0) - total
    tl.store(off_ptr + e, run, mask=e <= e_loc)
    for b0 in range(0, nb, ROWS):
        r = b0 + tl.arange(0, ROWS)
        m = r[:, None] < nb
        c = tl.load(count_ptr + r[:, None] * E_PAD + e[None, :], mask=m, other=0)
        base = tl.cumsum(c, axis=0) - c + run[None, :]
        tl.store(base_ptr + r[:, None] * E_PAD + e[None, :], base, mask=m)
        run += tl.sum(c, axis=0)


@triton.jit(do_not_specialize=("num_pairs", "expert_offset", "e_loc"))
def _pair_place_kernel(
    ids_ptr,
    count_ptr,  # int32 [NB, E_PAD]
    base_ptr,  # int32 [NB, E_PAD]
    order_ptr,  # int64 [P]: sorted row -> pair
    pos_ptr,  # int64 [P]: pair -> sorted row
    grp_ptr,  # int64 [P]: sorted row -> bin
    num_pairs,
    expert_offset,
    e_loc,
    BLOCK: tl.constexpr,
    E_PAD: tl.constexpr,
):
    """Block b's pairs sorted by (bin, pair) in registers; a pair's row = its bin's base for
    this block + its rank among the block's pairs of that bin."""
    b = tl.program_id(0)
    lane = tl.arange(0, BLOCK)
    p = b * BLOCK + lane
    pm = p < num_pairs
    local = tl.load(ids_ptr + p, mask=pm, other=0).to(tl.int32) - expert_offset
    key = tl.where((local >= 0) & (local < e_loc), local, e_loc)
    key = tl.where(pm, key, e_loc + 1)
    s = tl.sort(key * BLOCK + lane)  # unique keys: by bin, then by pair
    s_bin = s // BLOCK
    s_pair = b.to(tl.int64) * BLOCK + s % BLOCK
    e = tl.arange(0, E_PAD)
    c = tl.load(count_ptr + b * E_PAD + e)
    first = tl.cumsum(c, axis=0) - c  # the block's first sorted lane of each bin
    row = tl.gather(tl.load(base_ptr + b * E_PAD + e), s_bin, 0) + lane - tl.gather(first, s_bin, 0)
    ok = s_bin <= e_loc
    row = row.to(tl.int64)
    tl.store(order_ptr + row, s_pair, mask=ok)
    tl.store(grp_ptr + row, s_bin.to(tl.int64), mask=ok)
    tl.store(pos_ptr + s_pair, row, mask=ok)


@triton.jit(do_not_specialize=("num_pairs", "e_loc"))
def _padded_blocks_kernel(
    order_ptr,  # int64 [P]: sorted row -> pair (sort_pairs)
    off_ptr,  # int32 [E_loc + 1]: expert e's sorted rows are [off[e], off[e + 1])
    pairs_ptr,  # int32 [NB · BLOCK_M]
    block_expert_ptr,  # int32 [NB]
    num_pairs,
    e_loc,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
):
    """Block b of the padded layout: each expert's run rounded up to whole blocks (the runs'
    ends a prefix sum over the experts, recomputed by every program: E_PAD adds), block b's
    expert = the runs ending at or before its first slot, its slots the expert's sorted pairs
    from that rank on, then P."""
    b = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    em = e < e_loc
    lo = tl.load(off_ptr + e, mask=em, other=0)
    cnt = tl.load(off_ptr + e + 1, mask=em, other=0) - lo
    padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    slot0 = b * BLOCK_M
    mine_idx = tl.sum((tl.where(em, end, 2147483647) <= slot0).to(tl.int32), 0)  # e_loc: past all
    mine = e == mine_idx
    start = tl.sum(tl.where(mine, end - padded, 0), 0)
    first = tl.sum(tl.where(mine, lo, 0), 0)
    n = tl.sum(tl.where(mine, cnt, 0), 0)  # 0 past the last expert: every slot empty
    r = slot0 - start + tl.arange(0, BLOCK_M)
    q = tl.load(order_ptr + first + r, mask=r < n, other=num_pairs)
    tl.store(pairs_ptr + slot0 + tl.arange(0, BLOCK_M), q.to(tl.int32))
    tl.store(block_expert_ptr + b, tl.where(mine_idx < e_loc, mine_idx, -1))


def sort_pairs(
    ids: torch.Tensor, expert_offset: int, e_loc: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`vllm.kernels.moe_cutlass.sort_pairs_ref`'s (order, pos, offsets, grp), the same
    values, by a stable counting sort in three launches (blocks' counts per expert, their scan,
    each block's pairs placed) instead of torch's radix sort, scatter and count kernels. Up to
    ``SORT_MAX_BINS - 2`` local experts."""
    check_cuda_or_interpreter(ids)
    e_pad = max(16, next_pow2(e_loc + 2))
    if e_pad > SORT_MAX_BINS:
        raise ValueError(f"{e_loc} local experts: the counting sort holds {SORT_MAX_BINS - 2}")
    flat = ids.reshape(-1)
    p = flat.numel()
    nb = triton.cdiv(p, SORT_BLOCK)
    dev = ids.device
    order = torch.empty(p, dtype=torch.int64, device=dev)
    pos = torch.empty(p, dtype=torch.int64, device=dev)
    grp = torch.empty(p, dtype=torch.int64, device=dev)
    offsets = torch.zeros(e_loc + 1, dtype=torch.int32, device=dev)
    if p:
        counts = torch.empty(nb, e_pad, dtype=torch.int32, device=dev)
        base = torch.empty_like(counts)
        _pair_count_kernel[(nb,)](
            flat, counts, p, expert_offset, e_loc, BLOCK=SORT_BLOCK, E_PAD=e_pad, num_warps=4
        )
        _pair_scan_kernel[(1,)](
            counts, base, offsets, nb, e_loc, E_PAD=e_pad, ROWS=SCAN_ROWS, num_warps=4
        )
        _pair_place_kernel[(nb,)](
            flat, counts, base, order, pos, grp, p, expert_offset, e_loc, BLOCK=SORT_BLOCK,
            E_PAD=e_pad, num_warps=8,
        )  # fmt: skip
    return order, pos, offsets, grp


def padded_blocks(
    ids: torch.Tensor, expert_offset: int, e_loc: int, block_m: int, nb: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`vllm.kernels.triton.moe_grouped.sort_pairs_by_expert`'s (sorted_pairs int32
    [nb · block_m], block_expert int32 [nb]) from :func:`sort_pairs`' order and offsets: its
    three launches and one program per block. Up to ``SORT_MAX_BINS - 2`` local experts;
    nb >= the padded runs' blocks (the caller's worst case)."""
    order, _, offsets, _ = sort_pairs(ids, expert_offset, e_loc)
    dev = ids.device
    sorted_pairs = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
    if nb:
        _padded_blocks_kernel[(nb,)](
            order, offsets, sorted_pairs, block_expert, ids.numel(), e_loc, BLOCK_M=block_m,
            E_PAD=max(16, next_pow2(e_loc + 1)), num_warps=4,
        )  # fmt: skip
    return sorted_pairs, block_expert
