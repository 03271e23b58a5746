"""The HiSparse resolver: selected positions -> cache slots, and the misses to fetch from host memory.

For each decode token t and each selected position p:
  * resident: the page of p still has a GPU block  -> slot = block·64 + p % 64 (read in place);
  * hit:      p is in the request's hot buffer      -> that hot row's slot; its LRU stamp refreshes;
  * miss:     neither                               -> the least recently used hot row not hit by
              this token is overwritten with p's row, copied from the host pool (every layer of
              the IndexShare group at once), and becomes p's slot.
Several decode tokens of one request (a speculative-decoding verify row, 1 + k tokens sharing one
hot buffer) resolve one after another, in row order, as consecutive calls at the same step would:
a later token hits the rows an earlier one fetched, and, the earlier tokens' rows carrying this
step's stamp, takes its victims among older rows — none while the buffer holds at least
(tokens per request) × K rows, which the config enforces ((num_speculative_tokens + 1) × topk).
Everything is tensor ops on the device: no host decision, no sync, fixed shapes (misses are masked,
their no-op copies go to a trash slot), so it can run inside a CUDA graph. CUDA tensors run the
fused Triton kernel (``vllm/kernels/triton/hisparse_resolve.py``), identical to ``resolve_ref``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.kernels import kernel_module


def hisparse_resolve(
    positions, req_slot, page_table, host_page_table, hot_slots, hot_pos, hot_lru, step,
    trash_slot: int, block_size: int, tokens_per_req: int = 1,
) -> ResolveResult:  # fmt: skip
    """Selected positions -> cache slots for HiSparse decode (contract: :func:`resolve_ref`); one
    fused kernel launch on CUDA per token of a request (``tokens_per_req``). `step` is an int or
    a 1-element int64 device tensor."""
    fast = kernel_module("triton.hisparse_resolve", positions)
    if fast is not None:
        one = fast.resolve_fused
    else:
        if isinstance(step, torch.Tensor):
            step = int(step.reshape(-1)[0])
        one = _resolve_one
    return _in_request_order(
        one, positions, req_slot, tokens_per_req,
        page_table, host_page_table, hot_slots, hot_pos, hot_lru, step, trash_slot, block_size,
    )  # fmt: skip


@dataclass
class ResolveResult:
    slots: torch.Tensor  # [T, K] GPU slots to read (−1 = no position)
    src: torch.Tensor  # [T, K] host slots of rows to copy (valid where `miss`)
    dest: torch.Tensor  # [T, K] GPU slots they go to (trash slot where not `miss`)
    miss: torch.Tensor  # [T, K] bool
    hits: torch.Tensor  # [] int64 hot-buffer hits
    num_miss: torch.Tensor  # [] int64
    num_resident: torch.Tensor  # [] int64


def resolve_ref(
    positions: torch.Tensor,
    req_slot: torch.Tensor,
    page_table: torch.Tensor,
    host_page_table: torch.Tensor,
    hot_slots: torch.Tensor,
    hot_pos: torch.Tensor,
    hot_lru: torch.Tensor,
    step: int,
    trash_slot: int,
    block_size: int = 64,
    tokens_per_req: int = 1,
) -> ResolveResult:
    """positions [T, K] (−1 = none; distinct within a row); req_slot [T]: the tokens of one
    request are consecutive rows, at most ``tokens_per_req`` of them, resolved in row order;
    page_table/host_page_table [R, P] GPU / host block of each page (−1 = none);
    hot_slots [R, H] GPU slot of each hot row; hot_pos / hot_lru [R, H + 1] (updated in place;
    column H is a trash column that absorbs masked writes)."""
    return _in_request_order(
        _resolve_one, positions, req_slot, tokens_per_req,
        page_table, host_page_table, hot_slots, hot_pos, hot_lru, step, trash_slot, block_size,
    )  # fmt: skip


def _in_request_order(resolve_one, positions, req_slot, tokens_per_req: int, *args):
    """``resolve_one`` (one token per request) applied to the j-th tokens of every request for
    j = 0 .. tokens_per_req − 1 in turn, the other tokens' positions masked to −1 (a row with no
    position reads and writes no hot-buffer state); the results merged per token."""
    if tokens_per_req == 1:
        return resolve_one(positions, req_slot, *args)
    t = req_slot.shape[0]
    idx = torch.arange(t, device=req_slot.device)
    first = torch.ones(t, dtype=torch.bool, device=req_slot.device)
    first[1:] = req_slot[1:] != req_slot[:-1]
    rank = idx - torch.cummax(torch.where(first, idx, 0), dim=0).values  # [T] token of its request
    out = None
    for j in range(tokens_per_req):
        mine = (rank == j).unsqueeze(1)
        res = resolve_one(torch.where(mine, positions, -1), req_slot, *args)
        if out is None:  # every token of rank > 0 masked here: no slots, no copies
            out = res
            continue
        out = ResolveResult(
            *(torch.where(mine, a, b) for a, b in ((res.slots, out.slots), (res.src, out.src),
                                                  (res.dest, out.dest), (res.miss, out.miss))),
            out.hits + res.hits,
            out.num_miss + res.num_miss,
            out.num_resident + res.num_resident,
        )  # fmt: skip
    return out


def _resolve_one(
    positions, req_slot, page_table, host_page_table, hot_slots, hot_pos, hot_lru, step: int,
    trash_slot: int, block_size: int,
) -> ResolveResult:  # fmt: skip
    """:func:`resolve_ref` for one token per request (distinct ``req_slot`` among the rows that
    select a position)."""
    valid = positions >= 0
    p = positions.clamp_min(0).long()
    page, off = p // block_size, p % block_size
    s = req_slot.long()
    gblk = page_table[s.unsqueeze(1), page].long()
    resident = valid & (gblk >= 0)
    need = valid & ~resident
    h_rows = hot_slots.shape[1]
    hp = hot_pos[s, :h_rows]  # [T, H]
    sorted_hp, order = torch.sort(hp, dim=1)
    idx = torch.searchsorted(sorted_hp, p).clamp_max(hp.shape[1] - 1)
    hit = need & (sorted_hp.gather(1, idx) == p)
    hit_row = order.gather(1, idx)  # meaningful where hit
    miss = need & ~hit
    # victims: least recently used rows, never one this token hits
    hit_count = torch.zeros_like(hp).scatter_add_(1, torch.where(hit, hit_row, 0), hit.long())
    lru = hot_lru[s, :h_rows].masked_fill(hit_count > 0, torch.iinfo(hot_lru.dtype).max)
    cand = torch.argsort(lru, dim=1, stable=True)
    rank = (torch.cumsum(miss.long(), dim=1) - 1).clamp_min(0)
    victim = cand.gather(1, rank)
    hs = hot_slots[s]
    dest = torch.where(miss, hs.gather(1, victim), trash_slot)
    src = host_page_table[s.unsqueeze(1), page].long() * block_size + off
    slots = torch.where(
        resident, gblk * block_size + off, torch.where(hit, hs.gather(1, hit_row), dest)
    )
    slots = torch.where(valid, slots, -1)
    # bookkeeping: new rows hold their positions; every used row gets this step's stamp. Unused
    # entries write to the trash column H (no boolean indexing: no host sync, fixed shapes).
    trash_col = hot_pos.shape[1] - 1
    rows = torch.where(miss, victim, torch.where(hit, hit_row, trash_col))
    r_idx = s.unsqueeze(1).expand_as(rows)
    hot_pos[r_idx, torch.where(miss, victim, trash_col)] = torch.where(miss, p, -1)
    hot_lru[r_idx, rows] = step
    return ResolveResult(
        slots, torch.where(miss, src, 0), dest, miss, hit.sum(), miss.sum(), resident.sum()
    )


def resolve_cost(num_tokens: int, topk: int = 2048, hot_rows: int = 4096) -> tuple[int, int]:
    """(flops, bytes): no arithmetic to speak of; positions, page-table and hot-slot gathers,
    the hot rows' positions and stamps read, outputs and bookkeeping written (int64)."""
    per_col = 8 + 4 + 8 + 8 + 8 * 3 + 1 + 16  # pos, gblk, host blk, hot slot, outputs, updates
    return 0, num_tokens * (topk * per_col + hot_rows * 16)
