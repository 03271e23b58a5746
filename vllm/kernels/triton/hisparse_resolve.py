"""HiSparse resolver in one Triton launch: selected positions -> cache slots, hot-buffer LRU update.

Same contract as :func:`vllm.kernels.hisparse_resolve.resolve_ref` (the torch reference, ~40 small ops: two
sorts, searchsorted, argsort, cumsum, gathers, scatters), results identical. One program per
decode token t (request slot s):

  1. columns (K selected positions): page-table gather -> resident / need (valid, page dropped);
     the need columns become int keys ``pos << LOG_KP | col`` (32-bit when every key fits),
     sorted with ``tl.sort`` (not-needed columns sort last) into a per-token scratch (L2/L1);
  2. rows (H hot rows): each row binary-searches its position among the n_need sorted keys
     (LOG_KP probes); a match is a hit: the row is marked and scattered to its column's scratch
     slot. Searching the K keys from the H rows sorts K keys instead of H;
  3. victims (only if this token misses): keys ``lru << LOG_HP | row``, hit rows (and padding)
     at the maximum stamp — the reference's masked_fill + stable argsort; the KP smallest
     (``tl.topk`` on the negated keys when H > K) go to scratch in LRU order. The keys are int32
     (stamps relative to the oldest, later ones clamped) when the misses all fall within 2^19 - 2
     steps of the oldest stamp (H = 4096), which is the steady state; else exact int64;
  4. columns: hit row from scratch, miss rank = exclusive ``tl.cumsum`` of the misses in column
     order, victim = victims[rank]; slots/src/dest/miss and the hot_pos / hot_lru updates are
     masked stores. Per-token counts are summed by one tiny torch reduction (no atomics).

Phases that read scratch written by other threads are separated by ``tl.debug_barrier``. No host
sync, fixed shapes, and ``step`` may be a device tensor: capturable in a CUDA graph.

Differences from the reference: column H of hot_pos / hot_lru (the trash column that absorbs the
reference's masked writes) is never written. Assumptions (true of the resolver's own state): the
valid positions of a hot buffer are distinct, the selected positions of a row are distinct,
req_slot values are distinct among the rows that select a position (a row of −1s uses no hot
state and writes none, so the wrapper resolves a request's several tokens one at a time, the
others masked), K <= H, positions < P·block_size (the reference's page-table index bound),
stamps satisfy |lru| < 2^(62 - log2(HP)) (2^50 at H = 4096).

Cost (sm_90 SASS, K = 2048, H = 4096, 8 warps): ~14K instructions per thread on the usual path,
about half of them the victim sort; 226 registers, 32 KB shared memory, one program per SM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.hisparse_resolve import ResolveResult
from vllm.kernels.triton.utils import check_cuda_or_interpreter, next_pow2, record

__all__ = ["resolve_fused"]


@triton.jit
def _lower_bound(keys_row, target, n, active, LOG_KP: tl.constexpr, KP: tl.constexpr):
    """Per lane: index of the first of the n sorted keys >= target, by binary lifting over KP
    (an index whose key is < target, or >= n, when there is none: the caller re-checks)."""
    lo = tl.zeros(target.shape, tl.int32)
    for b in tl.static_range(LOG_KP):
        probe = lo + ((KP >> (b + 1)) - 1)
        ok = active & (probe < n)
        k = tl.load(keys_row + probe, mask=ok, other=0).to(tl.int64)
        lo = tl.where(ok & (k < target), lo + (KP >> (b + 1)), lo)
    return lo


@triton.jit
def _smallest(x, KP: tl.constexpr, HP: tl.constexpr):
    """The KP smallest of the HP (distinct) keys x, ascending."""
    if KP < HP:
        return -tl.topk(-x, KP)
    else:
        return tl.sort(x)


# the step changes every call: not specialised on (a compiled variant per class of it — 1, a
# multiple of 16, other — would compile inside the first steps of a server)
@triton.jit(do_not_specialize=("step",))
def _resolve_kernel(
    pos_ptr,  # [T, K] int32/int64 selected positions (−1 = none)
    req_ptr,  # [T] int64 request slot of each token
    pt_ptr,  # [R, P] int32 GPU block of each page (−1 = dropped)
    hpt_ptr,  # [R, P] int64 host block of each page
    hs_ptr,  # [R, H] int64 GPU slot of each hot row
    hpos_ptr,  # [R, H + 1] int64 position held by each hot row (−1 = empty); updated
    hlru_ptr,  # [R, H + 1] int64 last step each hot row was used; updated
    step_ptr,  # [1] int step (STEP_PTR), else unused
    step,  # int step (not STEP_PTR)
    slots_ptr,  # [T, K] int64 out
    src_ptr,  # [T, K] int64 out
    dest_ptr,  # [T, K] int64 out
    miss_ptr,  # [T, K] uint8 out
    count_ptr,  # [T, 4] int64 out: hits, misses, resident, (pad)
    keys_ptr,  # [T, KP] int32 (KEY32) / int64 scratch: sorted position keys
    aux_ptr,  # [T, 2 * KP] int32 scratch: hit row per column, then victim rows in LRU order
    trash_slot,
    max_pos,  # P * BLOCK_SIZE
    s_pos_t, s_pos_k, s_pt_r, s_pt_p, s_hpt_r, s_hpt_p,
    s_hs_r, s_hs_h, s_hp_r, s_hp_h, s_hl_r, s_hl_h,
    K: tl.constexpr,
    H: tl.constexpr,
    KP: tl.constexpr,  # next power of two >= K
    HP: tl.constexpr,  # next power of two >= H (>= KP)
    LOG_KP: tl.constexpr,
    LOG_HP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KEY32: tl.constexpr,  # max_pos * KP <= 2^31: position keys fit int32
    STEP_PTR: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    s = tl.load(req_ptr + t).to(tl.int64)
    keys_row = keys_ptr + t * KP
    hrow_row = aux_ptr + t * (2 * KP)
    vict_row = hrow_row + KP
    cols = tl.arange(0, KP)
    rows = tl.arange(0, HP)

    # ---- 1. columns: residency; sorted keys of the columns that need the hot buffer -----------
    p = tl.load(pos_ptr + t * s_pos_t + cols * s_pos_k, mask=cols < K, other=-1).to(tl.int64)
    valid = p >= 0
    p = tl.maximum(p, 0)
    page = p // BLOCK_SIZE
    off = p % BLOCK_SIZE
    gblk = tl.load(pt_ptr + s * s_pt_r + page * s_pt_p, mask=valid, other=-1).to(tl.int64)
    resident = valid & (gblk >= 0)
    need = valid & (gblk < 0)
    n_need = tl.sum(need.to(tl.int32))
    tl.store(hrow_row + cols, tl.full((KP,), -1, tl.int32), mask=need)
    tl.debug_barrier()  # the −1 fill lands before any thread's hit scatter below

    # ---- 2. rows: binary search of each hot position among the need keys -> hits -------------
    hp = tl.load(hpos_ptr + s * s_hp_r + rows * s_hp_h, mask=rows < H, other=-1)
    match = rows < 0
    n_hit = tl.zeros((), tl.int32)
    if n_need > 0:
        if KEY32:
            key = tl.where(need, (p << LOG_KP) | cols, 2147483647).to(tl.int32)
        else:
            key = tl.where(need, (p << LOG_KP) | cols, 9223372036854775807)
        tl.store(keys_row + cols, tl.sort(key))  # not-needed columns sort past n_need
        tl.debug_barrier()  # every thread searches the whole sorted list
        active = (rows < H) & (hp >= 0) & (hp < max_pos)
        target = hp << LOG_KP
        j = _lower_bound(keys_row, target, n_need, active, LOG_KP, KP)
        ok = active & (j < n_need)
        kj = tl.load(keys_row + j, mask=ok, other=0).to(tl.int64)
        match = ok & ((kj >> LOG_KP) == hp)
        tl.store(hrow_row + (kj & (KP - 1)), rows.to(tl.int32), mask=match)
        n_hit = tl.sum(match.to(tl.int32))

    # ---- 3. victims: non-hit rows by (lru, row), the KP least recent in order -----------------
    n_miss = n_need - n_hit
    if n_miss > 0:
        lru = tl.load(hlru_ptr + s * s_hl_r + rows * s_hl_h, mask=rows < H, other=0)
        cand = (rows < H) & ~match
        rel = lru - tl.min(tl.where(cand, lru, 9223372036854775807))
        # 32-bit keys when the misses are all taken from stamps within 2^(31 - LOG_HP) - 2 of the
        # oldest (later ones clamp together: never reached), else exact 64-bit keys
        clamp: tl.constexpr = (1 << (31 - LOG_HP)) - 2
        if tl.sum((cand & (rel < clamp)).to(tl.int32)) >= n_miss:
            v32 = (tl.where(cand, tl.minimum(rel, clamp), clamp + 1) << LOG_HP) | rows
            order = _smallest(v32.to(tl.int32), KP, HP).to(tl.int64)
        else:
            top: tl.constexpr = (1 << (63 - LOG_HP)) - 1  # the reference's INT64_MAX
            order = _smallest((tl.where(cand, lru, top) << LOG_HP) | rows, KP, HP)
        tl.store(vict_row + cols, (order & (HP - 1)).to(tl.int32))
    tl.debug_barrier()  # hit scatter and victim list are read by other threads below

    # ---- 4. columns: hit row / miss rank -> slots, copies, hot-buffer bookkeeping --------------
    hr = tl.load(hrow_row + cols, mask=need, other=-1).to(tl.int64)
    hit = need & (hr >= 0)
    miss = need & (hr < 0)
    mi = miss.to(tl.int32)
    rank = tl.cumsum(mi, 0) - mi
    victim = tl.load(vict_row + rank, mask=miss, other=0).to(tl.int64)
    hs_row = hs_ptr + s * s_hs_r
    dest = tl.where(miss, tl.load(hs_row + victim * s_hs_h, mask=miss, other=0), trash_slot)
    hit_slot = tl.load(hs_row + hr * s_hs_h, mask=hit, other=0)
    hblk = tl.load(hpt_ptr + s * s_hpt_r + page * s_hpt_p, mask=miss, other=0).to(tl.int64)
    slots = tl.where(resident, gblk * BLOCK_SIZE + off, tl.where(hit, hit_slot, dest))
    slots = tl.where(valid, slots, -1)
    out = t * K + cols
    cmask = cols < K
    tl.store(slots_ptr + out, slots, mask=cmask)
    tl.store(src_ptr + out, tl.where(miss, hblk * BLOCK_SIZE + off, 0), mask=cmask)
    tl.store(dest_ptr + out, dest, mask=cmask)
    tl.store(miss_ptr + out, mi.to(tl.uint8), mask=cmask)
    if STEP_PTR:
        stamp = tl.load(step_ptr).to(tl.int64)
    else:
        stamp = tl.zeros((), tl.int64) + step  # (a literal 1 arrives as a constexpr)
    stamps = tl.zeros((KP,), tl.int64) + stamp
    tl.store(hpos_ptr + s * s_hp_r + victim * s_hp_h, p, mask=miss)
    tl.store(hlru_ptr + s * s_hl_r + victim * s_hl_h, stamps, mask=miss)
    tl.store(hlru_ptr + s * s_hl_r + hr * s_hl_h, stamps, mask=hit)
    ci = tl.arange(0, 4)
    n_res = tl.sum(resident.to(tl.int32))
    cv = tl.where(ci == 0, n_hit, tl.where(ci == 1, n_miss, n_res)).to(tl.int64)
    tl.store(count_ptr + t * 4 + ci, cv, mask=ci < 3)


def resolve_fused(
    positions: torch.Tensor,
    req_slot: torch.Tensor,
    page_table: torch.Tensor,
    host_page_table: torch.Tensor,
    hot_slots: torch.Tensor,
    hot_pos: torch.Tensor,
    hot_lru: torch.Tensor,
    step: int | torch.Tensor,
    trash_slot: int,
    block_size: int = 64,
    num_warps: int = 8,
    wide_keys: bool | None = None,
) -> ResolveResult:
    """:func:`~vllm.kernels.hisparse_resolve.resolve_ref` in one kernel launch (plus a 3-element sum).

    positions [T, K] int32/int64 (−1 = none; distinct within a row); req_slot [T] int (distinct
    among the rows that select a position: one decode token per request); page_table [R, P] int (GPU block, −1 = dropped);
    host_page_table [R, P] int64; hot_slots [R, H] int64; hot_pos / hot_lru [R, H + 1] int64,
    updated in place (any strides, e.g. ``hot_pos[g]``); step: int, or a 1-element int device
    tensor read by the kernel (CUDA-graph capturable); K <= H. Returns the reference's result
    exactly — slots, src, dest [T, K] int64, miss [T, K] bool, counts 0-dim int64 device tensors —
    and the same hot_pos / hot_lru columns [:H]; column H (the reference's trash column) is
    left untouched. ``wide_keys`` forces 64-bit position keys (default: 32-bit when
    P·block_size·next_pow2(K) <= 2^31, e.g. 16K pages of 64 at K = 2048).
    """
    if positions.dim() != 2 or req_slot.shape != (positions.shape[0],):
        raise ValueError(f"positions {tuple(positions.shape)} must be [T, K], req_slot [T]")
    t, k = positions.shape
    r, h = hot_slots.shape
    if hot_pos.shape != (r, h + 1) or hot_lru.shape != (r, h + 1):
        raise ValueError(f"hot_pos/hot_lru must be [R, H + 1] = [{r}, {h + 1}]")
    if page_table.shape != host_page_table.shape or page_table.shape[0] != r:
        raise ValueError("page_table and host_page_table must both be [R, P]")
    if k > h:
        raise ValueError(f"K = {k} selected positions need K <= H = {h} hot rows")
    if hot_pos.dtype != torch.int64 or hot_lru.dtype != torch.int64:
        raise ValueError("hot_pos and hot_lru must be int64")
    check_cuda_or_interpreter(positions, req_slot, page_table, host_page_table, hot_slots)
    dev = positions.device
    slots = torch.empty(t, k, dtype=torch.int64, device=dev)
    src = torch.empty_like(slots)
    dest = torch.empty_like(slots)
    miss = torch.empty(t, k, dtype=torch.uint8, device=dev)
    if t == 0 or k == 0:
        counts = torch.zeros(3, dtype=torch.int64, device=dev)
        miss.zero_()
        slots.fill_(-1)
        src.zero_()
        dest.fill_(trash_slot)
        return ResolveResult(slots, src, dest, miss.view(torch.bool), *counts.unbind())
    kp, hp = next_pow2(k), next_pow2(h)
    max_pos = page_table.shape[1] * block_size
    key32 = not wide_keys and max_pos * kp <= 1 << 31
    keys = torch.empty(t, kp, dtype=torch.int32 if key32 else torch.int64, device=dev)
    aux = torch.empty(t, 2 * kp, dtype=torch.int32, device=dev)
    part = torch.empty(t, 4, dtype=torch.int64, device=dev)
    step_is_ptr = isinstance(step, torch.Tensor)
    if step_is_ptr and step.numel() != 1:
        raise ValueError(f"step tensor must have one element, got {tuple(step.shape)}")
    step_t = step.reshape(1) if step_is_ptr else part
    c = _resolve_kernel[(t,)](
        positions, req_slot, page_table, host_page_table, hot_slots, hot_pos, hot_lru,
        step_t, 0 if step_is_ptr else int(step),
        slots, src, dest, miss, part, keys, aux, int(trash_slot), max_pos,
        positions.stride(0), positions.stride(1), page_table.stride(0), page_table.stride(1),
        host_page_table.stride(0), host_page_table.stride(1), hot_slots.stride(0),
        hot_slots.stride(1), hot_pos.stride(0), hot_pos.stride(1), hot_lru.stride(0),
        hot_lru.stride(1),
        K=k, H=h, KP=kp, HP=hp, LOG_KP=kp.bit_length() - 1, LOG_HP=hp.bit_length() - 1,
        BLOCK_SIZE=block_size, KEY32=key32, STEP_PTR=step_is_ptr, num_warps=num_warps,
    )  # fmt: skip
    record("hisparse_resolve", c)
    counts = part[:, :3].sum(0)
    return ResolveResult(slots, src, dest, miss.view(torch.bool), *counts.unbind())
