"""Expert parallelism: routed experts split across the EP group, tokens moved by all-to-all.

Each rank routes its own tokens; every (token, expert) pair is sent to the expert's owner, computed
there (× its routing weight) and sent back, and the pairs are summed per token in fp32. Under TP the
ranks of a TP group hold the same tokens, so each dispatches a 1/TP slice and the results are
all-gathered back over TP. The split sizes are exchanged first (one small all-to-all), which costs
a host read of the counts per MoE layer.
"""

from __future__ import annotations

import torch

from vllm.distributed.parallel_state import ParallelContext


def ep_moe(
    pc: ParallelContext, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts
) -> torch.Tensor:
    """x [T, H], weights/ids [T, k] -> routed-expert output [T, H] in x.dtype (complete, not partial)."""
    ep, tp = pc.ep, pc.tp
    t = x.shape[0]
    per = -(-t // tp.world_size)
    lo, hi = min(t, tp.rank_in_group * per), min(t, (tp.rank_in_group + 1) * per)
    xs, ws, ids_s = x[lo:hi], weights[lo:hi], ids[lo:hi]
    k = ids_s.shape[1]
    tok = torch.arange(hi - lo, device=x.device).repeat_interleave(k)
    flat_ids, flat_w = ids_s.flatten(), ws.flatten().float()
    dest = flat_ids // experts.num_local
    order = torch.sort(dest, stable=True).indices
    send_counts = torch.bincount(dest, minlength=ep.world_size)
    recv_counts = ep.all_to_all(send_counts.to(torch.int64))
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    recv_x = ep.all_to_all(xs[tok[order]], rc, sc)
    meta = torch.stack([flat_ids[order].double(), flat_w[order].double()], dim=1)
    recv_meta = ep.all_to_all(meta, rc, sc)
    r_ids = recv_meta[:, 0].long().unsqueeze(1)
    r_w = recv_meta[:, 1].float().unsqueeze(1)
    y = experts.run_local(recv_x, r_w, r_ids)
    back = ep.all_to_all(y, sc, rc)
    out = torch.zeros((hi - lo, x.shape[1]), dtype=torch.float32, device=x.device)
    out.index_add_(0, tok[order], back.float())
    out = out.to(x.dtype)
    if tp.world_size == 1:
        return out
    buf = out.new_zeros((per, x.shape[1]))
    buf[: hi - lo] = out
    return tp.all_gather(buf)[:t]
