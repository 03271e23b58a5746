"""Expert parallelism: routed experts split across the EP group, tokens moved by collectives.

Each rank routes its own tokens; every (token, expert) pair is computed by the expert's owner
(× its routing weight) and the contributions are summed per token in fp32 on the token's rank.
Under TP the ranks of a TP group hold the same tokens, so each dispatches a 1/TP slice and the
results are all-gathered back over TP. There are two dispatch paths, and every rank of the EP group
must take the same one in the same layer (their collectives must match). The choice depends only
on the forward's *bound* — the most tokens any EP rank runs in this forward — which the runner
agrees once per forward (:func:`max_tokens_across_ep`: one all-reduce of a host int over the EP
group) and sets around the forward (:func:`ep_forward`). Every EP rank must enter each forward with
the same bound, at least its own token count. Without a bound (a model called outside the runner)
every rank takes the counts path.

**Fixed capacity** (decode: C = ceil(bound / TP) <= EP_FIXED_MAX_TOKENS): no device→host read, shapes
fixed by C, so the layer is CUDA-graph capturable (DeepEP's low-latency mode, on NCCL collectives).

  1. pack (:func:`pack_tokens`): this rank's n <= C tokens, one row each, padded to C rows of bytes
     ``x [H] (x.dtype) ‖ ids [k] int32 ‖ weights [k] fp32``; padding rows: x 0, ids −1, weight 0.
  2. dispatch: all-gather over EP -> [EP·C] rows, every rank's tokens with their whole top-k.
  3. ``experts.run_local`` on all EP·C rows: pairs whose expert another rank owns (and ids −1)
     contribute 0, so each rank computes exactly its own pairs. Row s·C + i is token i of rank s
     summed over this rank's experts (x.dtype; 0 where the token chose none of them).
  4. combine (:func:`combine_partials`): all-to-all with equal splits (block s back to rank s) ->
     [EP, C, H]; summed over ranks in fp32, in rank order (deterministic); the first n rows kept.

One row per token rather than per (token, expert) pair: with fixed splits the bytes moved are the
capacity whatever the routing, and the tight capacity per destination is C rows for one row per
(token, destination) but C·min(k, E_loc) for one per pair. A C-row buffer then holds all of the
sender's tokens, so sorting rows by destination buys nothing: every destination gets the same
buffer, which is an all-gather. Per rank and layer: EP·C·(H·e + 8k) bytes in, EP·C·H·e bytes back
(e = x.dtype's size), whatever the routing (all pairs on one rank, the worst case, costs the same);
``run_local`` sees EP·C rows × k pairs, of which it computes its own.

**Counts** (no bound, or C > EP_FIXED_MAX_TOKENS: prefill): each (token, expert) pair goes to the
expert's owner only. The split sizes are exchanged first (one small all-to-all) and read on the host
(a device→host sync per MoE layer, acceptable at prefill sizes; not capturable); rows and their
metadata (global expert id, weight) go by all-to-all with those splits, results come back the same
way and are summed per token in fp32 with index_add.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from vllm.distributed.parallel_state import GroupCoordinator, ParallelContext

# Largest per-rank capacity C (tokens after the TP slice) of the fixed-capacity path. At GLM-5.3
# shapes (H 6144, bf16, top-8) and EP 8, C = 256 moves about 24 MiB each way per rank and layer (as
# much as the counts path's T·k pair rows when EP = k), and run_local's grouped form then holds
# fp32 partials for EP·C·k pairs (384 MiB) where the counts path holds its received pairs' only.
EP_FIXED_MAX_TOKENS = 256

# The forward's bound, set by the runner around each forward (:func:`ep_forward`); None: no bound.
_max_tokens: int | None = None
# Whether that forward is a decode CUDA graph's (captured, or its uncaptured stand-in on CPU): its
# bound is the size every EP rank agreed before the replay, so nothing in it may read the host.
_in_graph = False


def max_tokens_across_ep(pc: ParallelContext, num_tokens: int) -> int:
    """The most tokens any rank of this rank's EP group runs in this forward. Every EP rank calls
    it once before each forward (DP replicas' dummy steps included): one all-reduce of a host int
    over the EP group's CPU group, no device sync. Without EP: ``num_tokens``."""
    assert not _in_graph, "a host all-reduce inside a decode graph (its bound is its size)"
    if pc.ep is None or pc.ep.world_size == 1:
        return num_tokens
    t = torch.tensor([num_tokens], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pc.ep.cpu_group)
    return int(t.item())


@contextmanager
def ep_forward(max_tokens: int | None, graph: bool = False) -> Iterator[None]:
    """Run a forward with every MoE layer's dispatch shapes set by ``max_tokens`` (the value
    :func:`max_tokens_across_ep` agreed, or a CUDA graph's captured size agreed the same way).
    ``graph``: a decode graph's forward, which must take the fixed-capacity path in every MoE
    layer and run no host all-reduce — checked on CPU too, where the graph runs uncaptured."""
    global _max_tokens, _in_graph
    prev = _max_tokens, _in_graph
    _max_tokens, _in_graph = max_tokens, graph
    try:
        yield
    finally:
        _max_tokens, _in_graph = prev


def fixed_capacity(max_tokens: int, tp_size: int) -> int | None:
    """Rows C each rank sends on the fixed-capacity path when no EP rank runs more than
    ``max_tokens`` tokens (its TP slice), or None: too many, take the counts path."""
    c = max(1, -(-max_tokens // tp_size))
    return c if c <= EP_FIXED_MAX_TOKENS else None


def ep_moe(
    pc: ParallelContext, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts
) -> torch.Tensor:
    """x [T, H], weights/ids [T, k] -> routed-expert output [T, H] in x.dtype (complete, not partial).
    ``experts.run_local(x [N, H], weights [N, k], ids [N, k])`` computes this rank's experts
    (``all_local=True`` from the counts path, whose rows are all its own pairs)."""
    if _max_tokens is not None:
        assert x.shape[0] <= _max_tokens, f"{x.shape[0]} tokens over the bound {_max_tokens}"
        cap = fixed_capacity(_max_tokens, pc.tp.world_size)
        if cap is not None:
            return ep_moe_fixed(pc, x, weights, ids, experts, cap)
    assert not _in_graph, f"a decode graph's MoE over {_max_tokens} tokens takes the counts path"
    return ep_moe_counts(pc, x, weights, ids, experts)


def ep_moe_fixed(
    pc: ParallelContext,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts,
    capacity: int,
) -> torch.Tensor:
    """The fixed-capacity path (module docstring); every EP rank passes the same ``capacity``,
    at least its TP slice (T <= TP·capacity)."""
    ep, tp = pc.ep, pc.tp
    t, h = x.shape
    assert t <= tp.world_size * capacity, f"{t} tokens over TP × capacity {capacity}"
    lo, hi = tp_slice(t, tp, capacity)
    sent = pack_tokens(x[lo:hi], weights[lo:hi], ids[lo:hi], capacity)  # [C, row bytes]
    rx, rw, rids = unpack_tokens(ep.all_gather(sent), h, x.dtype, ids.shape[1])  # [EP·C, ...]
    y = experts.run_local(rx, rw, rids)  # [EP·C, H]: rank s's tokens over my experts
    out = combine_partials(ep.all_to_all(y), ep.world_size)  # [C, H] fp32
    return _tp_gather(tp, out.to(x.dtype), t)


def ep_moe_counts(
    pc: ParallelContext, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts
) -> torch.Tensor:
    """The counts path (module docstring): pairs sent to their owners with exchanged split sizes."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the EP counts path reads split sizes on the host and cannot be captured: capture "
            f"under ep_forward() with at most {EP_FIXED_MAX_TOKENS}·TP tokens per rank"
        )
    ep, tp = pc.ep, pc.tp
    t = x.shape[0]
    per = -(-t // tp.world_size)
    lo, hi = tp_slice(t, tp, per)
    xs, ws, ids_s = x[lo:hi], weights[lo:hi], ids[lo:hi]
    k = ids_s.shape[1]
    tok = torch.arange(hi - lo, device=x.device).repeat_interleave(k)
    flat_ids, flat_w = ids_s.flatten(), ws.flatten().float()
    dest = flat_ids // experts.num_local
    order = torch.sort(dest, stable=True).indices
    send_counts = torch.bincount(dest, minlength=ep.world_size)
    recv_counts = ep.all_to_all(send_counts.to(torch.int64))
    sc, rc = send_counts.tolist(), recv_counts.tolist()  # the host read
    recv_x = ep.all_to_all(xs[tok[order]], rc, sc)
    meta = torch.stack([flat_ids[order].double(), flat_w[order].double()], dim=1)
    recv_meta = ep.all_to_all(meta, rc, sc)
    r_ids = recv_meta[:, 0].long().unsqueeze(1)
    r_w = recv_meta[:, 1].float().unsqueeze(1)
    y = experts.run_local(recv_x, r_w, r_ids, all_local=True)  # every received pair is mine
    back = ep.all_to_all(y, sc, rc)
    out = torch.zeros((per, x.shape[1]), dtype=torch.float32, device=x.device)
    out.index_add_(0, tok[order], back.float())
    return _tp_gather(tp, out.to(x.dtype), t)


def tp_slice(num_tokens: int, tp: GroupCoordinator, per: int) -> tuple[int, int]:
    """Token range [lo, hi) this TP rank dispatches: the rank-th run of ``per`` tokens (may be
    empty); the TP ranks' runs, all-gathered in rank order, are the tokens in order."""
    r = tp.rank_in_group
    return min(num_tokens, r * per), min(num_tokens, (r + 1) * per)


def _tp_gather(tp: GroupCoordinator, out: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Every TP rank's [per, H] slice result (rows past its tokens zero) -> [T, H]."""
    return tp.all_gather(out)[:num_tokens]


def pack_tokens(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, capacity: int
) -> torch.Tensor:
    """x [n, H], weights [n, k], ids [n, k] (n <= capacity) -> uint8 [capacity, H·e + 8k], one
    row per token: x's bytes (e = x.dtype's size), ids as int32, weights as fp32; rows n.. are
    padding (x 0, ids −1, weight 0). Fixed shape, device ops only."""
    n, h = x.shape
    k = ids.shape[1]
    assert n <= capacity, f"{n} tokens over the capacity {capacity}"
    assert (h * x.dtype.itemsize) % 4 == 0, "row bytes must keep ids and weights 4-byte aligned"
    xb = x.new_zeros((capacity, h))  # [C, H]
    xb[:n] = x
    ib = torch.full((capacity, k), -1, dtype=torch.int32, device=x.device)  # [C, k]
    ib[:n] = ids
    wb = torch.zeros((capacity, k), dtype=torch.float32, device=x.device)  # [C, k]
    wb[:n] = weights
    parts = (xb.view(torch.uint8), ib.view(torch.uint8), wb.view(torch.uint8))
    return torch.cat(parts, dim=1)


def unpack_tokens(
    rows: torch.Tensor, hidden: int, dtype: torch.dtype, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`pack_tokens`' rows [N, H·e + 8k] -> (x [N, H] dtype, weights [N, k] fp32,
    ids [N, k] int64); x is a view into ``rows``."""
    xw = hidden * dtype.itemsize
    x = rows[:, :xw].view(dtype)
    ids = rows[:, xw : xw + 4 * top_k].view(torch.int32).long()
    weights = rows[:, xw + 4 * top_k :].view(torch.float32).contiguous()
    return x, weights, ids


def combine_partials(back: torch.Tensor, ep_size: int) -> torch.Tensor:
    """back [EP·C, H] (block r: rank r's experts' sums for this rank's C rows) -> [C, H] fp32,
    summed over ranks in rank order."""
    return back.view(ep_size, -1, back.shape[1]).float().sum(0)
