"""HiSparse row fetches: copy the resolver's missing rows from the pinned host pool into the GPU
cache, on the current stream or ahead of time on a side stream (``prefetch``)."""

from __future__ import annotations

import torch

from vllm.kernels.hisparse_resolve import ResolveResult
from vllm.kernels.row_copy import masked_row_copy


def apply_copies(
    res: ResolveResult, gpu_caches: list[torch.Tensor], host_pools: list[torch.Tensor]
) -> None:
    """Copy missed rows host -> GPU for every layer of the group (masked: non-misses copy host
    row 0 into the trash slot, keeping shapes fixed). `host_pools` must be addressable from the
    caches' device (on CUDA: device views of pinned memory, see worker.device_view)."""
    for gpu, host in zip(gpu_caches, host_pools, strict=True):
        # on CUDA `host` is a device view of pinned memory: only missing rows cross PCIe
        masked_row_copy(gpu, host, res.dest, res.src, res.miss)


def prefetch(
    res: ResolveResult,
    gpu_caches: list[torch.Tensor],
    host_pools: list[torch.Tensor],
    stream: torch.cuda.Stream | None,
) -> list:
    """Start the copies of `res`'s missing rows for the given layers on `stream` (after the work
    queued so far on the current stream) and return one event per layer, recorded when that
    layer's rows have landed: the caller makes the current stream wait on it just before the
    layer reads its cache. Without a stream (CPU) the copies run now and the events are None."""
    if stream is None:
        apply_copies(res, gpu_caches, host_pools)
        return [None] * len(gpu_caches)
    cur = torch.cuda.current_stream(stream.device)
    stream.wait_stream(cur)
    if not torch.cuda.is_current_stream_capturing():  # a graph's pool outlives its replays
        for t in (res.src, res.dest, res.miss):
            t.record_stream(stream)  # keep them alive for the allocator until the copies finish
    events = []
    with torch.cuda.stream(stream):
        for gpu, host in zip(gpu_caches, host_pools, strict=True):
            apply_copies(res, [gpu], [host])
            ev = torch.cuda.Event()
            ev.record(stream)
            events.append(ev)
    return events
