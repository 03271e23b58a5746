"""Join the job's process group and build every process group of the [DP, PP, PCP, TP] rank
layout (TP fastest).

All ranks create all groups in the same order (torch.distributed requires it). DCP groups are
consecutive runs of `dcp` ranks inside one replica's PCP×TP block, as upstream forms them: with
DCP = TP·PCP that is the whole block, with PCP = 1 a slice of the TP group, with TP = 1 the PCP group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vllm.config import ParallelConfig
from vllm.distributed.parallel_state import GroupCoordinator, ParallelContext


def rank_grid(pc: ParallelConfig) -> torch.Tensor:
    """[DP, PP, PCP, TP] tensor of global ranks."""
    return torch.arange(pc.world_size_across_dp).view(
        pc.data_parallel_size,
        pc.pipeline_parallel_size,
        pc.prefill_context_parallel_size,
        pc.tensor_parallel_size,
    )


def group_ranks(pc: ParallelConfig) -> dict[str, list[list[int]]]:
    g = rank_grid(pc)
    dp, pp, pcp, tp = g.shape
    dcp = pc.decode_context_parallel_size

    def rows(t: torch.Tensor, size: int) -> list[list[int]]:
        return t.reshape(-1, size).tolist()

    return {
        "tp": rows(g, tp),
        "pcp": rows(g.transpose(2, 3), pcp),
        "dcp": rows(g, dcp),
        "dp": rows(g.permute(1, 2, 3, 0), dp),
        "replica": rows(g, pp * pcp * tp),
        "ep": rows(g.permute(1, 0, 2, 3), dp * pcp * tp),
        "world": [g.flatten().tolist()],
    }


def build_groups(pc: ParallelConfig, global_rank: int, device: torch.device) -> ParallelContext:
    cuda = device.type == "cuda"
    mine: dict[str, GroupCoordinator] = {}
    for name, all_ranks in group_ranks(pc).items():
        for ranks in all_ranks:
            dev_group = dist.new_group(ranks, backend="nccl" if cuda else "gloo")
            cpu_group = dist.new_group(ranks, backend="gloo") if cuda else dev_group
            if global_rank in ranks:
                mine[name] = GroupCoordinator(name, ranks, global_rank, dev_group, cpu_group)
    return ParallelContext(
        tp=mine["tp"],
        pcp=mine["pcp"],
        dcp=mine["dcp"],
        ep=mine["ep"] if pc.enable_expert_parallel else None,
        dp=mine["dp"],
        replica=mine["replica"],
        world=mine["world"],
    )


def init_distributed(
    config, global_rank: int, init_method: str, device: torch.device
) -> ParallelContext:
    """Join the job's process group and build this rank's groups."""
    pc = config.parallel_config
    world = pc.world_size_across_dp
    if world == 1:
        return ParallelContext.single()
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = join_store(init_method, world)
    dist.init_process_group(backend, store=store, world_size=world, rank=global_rank)
    return build_groups(pc, global_rank, device)


def host_store() -> tuple[dist.TCPStore, str]:
    """A rendezvous store served by the calling process (the one that spawns the ranks).

    The OS picks its port while binding it, so no other process can take the port between
    choosing it and listening on it (a port probed free and handed to rank 0 could be, and was,
    taken by another server starting meanwhile). Keep the store alive while the ranks run.
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return store, f"tcp://127.0.0.1:{store.port}"


def join_store(init_method: str, world: int) -> dist.TCPStore:
    """Connect to the store `host_store` serves at `init_method` (every rank is a client)."""
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rendezvous address must be tcp://HOST:PORT, got {init_method!r}")
    return dist.TCPStore(host, int(port), world_size=world, is_master=False)
