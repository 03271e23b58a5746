"""Process groups: TP, DP, PP, PCP, DCP and EP, laid out as upstream lays them out.

Global rank layout is [DP, PP, PCP, TP] with TP varying fastest. DCP adds no ranks: it reuses
PCP and TP ranks (a DCP group is a set of consecutive ranks inside one DP×PP slice). EP spans
DP×PCP×TP (every rank of a PP stage).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


class GroupCoordinator:
    """A process group seen from one of its ranks. Collectives on a group of one are identities."""

    def __init__(self, name: str, ranks: list[int], global_rank: int, group=None, cpu_group=None):
        self.name = name
        self.ranks = list(ranks)
        self.world_size = len(ranks)
        self.rank_in_group = ranks.index(global_rank)
        self.group = group  # device collectives (NCCL on CUDA, gloo on CPU)
        self.cpu_group = cpu_group if cpu_group is not None else group  # host-side control

    def __repr__(self) -> str:
        return f"{self.name}(rank {self.rank_in_group} of {self.ranks})"

    @property
    def is_first(self) -> bool:
        return self.rank_in_group == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's equally-shaped tensor along ``dim`` (rank order)."""
        if self.world_size == 1:
            return x
        out = self.all_gather_stacked(x)
        return out.movedim(0, dim).flatten(dim, dim + 1) if dim != 0 else out.flatten(0, 1)

    def all_gather_stacked(self, x: torch.Tensor) -> torch.Tensor:
        """[...] on each rank -> [world, ...]."""
        if self.world_size == 1:
            return x.unsqueeze(0)
        x = x.contiguous()
        if x.dim() == 0:
            x = x.view(1)
        dtype = x.dtype
        if dtype.itemsize == 1 and dtype not in (torch.uint8, torch.int8):
            x = x.view(torch.uint8)  # FP8 / bool: gloo has no such types; bytes gather the same
        out = torch.empty(
            (self.world_size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device
        )
        dist.all_gather_into_tensor(out, x, group=self.group)
        return out.view((self.world_size,) + tuple(x.shape)).view(dtype)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks of x [world·n, ...] and keep this rank's [n, ...] slice."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        out = torch.empty(
            (x.shape[0] // self.world_size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device
        )
        dist.reduce_scatter_tensor(out, x, group=self.group)
        return out

    def all_to_all(
        self,
        x: torch.Tensor,
        out_splits: list[int] | None = None,
        in_splits: list[int] | None = None,
    ) -> torch.Tensor:
        """Send in_splits[j] rows of x to rank j; receive out_splits[j] rows from rank j."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        rows = x.shape[0] if out_splits is None else sum(out_splits)
        out = torch.empty((rows,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(out, x, out_splits, in_splits, group=self.group)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size == 1:
            return x
        dist.broadcast(x, src=self.ranks[src], group=self.group)
        return x

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


def single_rank_group(name: str) -> GroupCoordinator:
    return GroupCoordinator(name, [0], 0, None)


@dataclass
class ParallelContext:
    """What the model and attention layers need to know about parallelism."""

    tp: GroupCoordinator
    pcp: GroupCoordinator
    dcp: GroupCoordinator
    ep: GroupCoordinator | None = None  # set when --enable-expert-parallel
    dp: GroupCoordinator | None = None
    replica: GroupCoordinator | None = None  # every rank of this engine replica (PCP × TP)
    world: GroupCoordinator | None = None  # every rank of every replica

    @classmethod
    def single(cls) -> ParallelContext:
        g = single_rank_group
        return cls(
            tp=g("tp"),
            pcp=g("pcp"),
            dcp=g("dcp"),
            ep=None,
            dp=g("dp"),
            replica=g("replica"),
            world=g("world"),
        )

    def expert_shard(self, num_experts: int) -> tuple[int, int]:
        """(first expert, number of experts) of the routed experts this rank holds: all of them
        without EP, else a contiguous 1/EP share (the split is validated at start-up:
        ``ParallelConfig.validate_for_model``)."""
        if self.ep is None:
            return 0, num_experts
        num_local = num_experts // self.ep.world_size
        return self.ep.rank_in_group * num_local, num_local

    def min_over_world(self, n: int) -> int:
        """Smallest value of n over every rank (KV blocks: every rank must hold the same count)."""
        if self.world is None or self.world.world_size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.world.cpu_group)
        return int(t.item())

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
