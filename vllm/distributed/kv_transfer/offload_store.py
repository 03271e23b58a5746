"""The worker half of the CPU KV offload tier: a host copy of whole KV blocks, every layer of this
rank (MLA rows, indexer keys, the MTP layer's), filled and read back on one side stream.

The store is dumb on purpose: the scheduler half (``offloading_connector.py``) owns the index
(block hash → host slot, LRU) and tells every rank the same (device block, host slot) pairs each
step; each rank copies its own share of those blocks (under DCP a scheduler block id addresses one
physical block per rank, holding the rows that rank owns, so nothing crosses ranks).

Ordering, all on the device without a host wait:

  * stores (device → host) and loads (host → device) run on one side stream, stores first in
    each step, so a load of a slot always sees the store that filled it (even one issued in the
    same step); a slot a load reads is pinned by the scheduler, so no store refills it before
    that load finished;
  * a store waits for the compute stream's work issued before it (the rows it copies are final);
  * a block freed while its store is still running may be handed to another request at once: the
    compute stream waits for that store before a step that writes such a block (:meth:`guard`);
  * a load is reported finished only once its copies completed (an event query, no sync), and
    only then does the scheduler let its request compute on those blocks.

Copies: consecutive (block, slot) pairs coalesce into runs, one memcpy per run and tensor; past
``MAX_RUNS`` runs (a fragmented device pool), an indexed copy per tensor over a zero-copy device
view of the host slots instead (the PyTorch reference is the run path, the CPU's).

On the CPU every copy is synchronous, so the same code is exercised in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from vllm.distributed.kv_transfer.base import LayerKVCache

# above this many runs per tensor, copies go through the gather path (one indexed copy per
# tensor over a zero-copy view of the host slots) instead of one memcpy per run: on an H200 a
# 32K-token prefix in 512 scattered blocks took 51,712 memcpys and ran at 5 % of the link
MAX_RUNS = 8


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` [blocks, ...] as [blocks, words]: 8-byte (or 4-byte) elements where the block size
    allows, so an indexed copy moves words, not bytes."""
    from vllm.hisparse.worker import words

    return words(t.view(t.shape[0], -1).view(torch.uint8))


def coalesce(pairs: Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    """(device block, host slot) pairs → runs (first block, first slot, length) where both
    advance by one, in the given order: one copy per run and cache tensor."""
    runs: list[tuple[int, int, int]] = []
    for b, s in pairs:
        if runs:
            b0, s0, n = runs[-1]
            if b == b0 + n and s == s0 + n:
                runs[-1] = (b0, s0, n + 1)
                continue
        runs.append((int(b), int(s), 1))
    return runs


class HostKVStore:
    def __init__(self, num_slots: int, device: torch.device):
        self.num_slots, self.device = num_slots, device
        self.cuda = device.type == "cuda"
        self.dev: list[torch.Tensor] = []  # every cache tensor of this rank (block dim first)
        self.host: list[torch.Tensor] = []  # the same shapes with num_slots blocks, pinned
        # CUDA: the same bytes as [blocks, words], the host side as a device view (zero-copy)
        self._dev_rows: list[torch.Tensor] = []
        self._host_rows: list[torch.Tensor] = []
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # stores whose copies may still run: (event, device blocks they read)
        self._stores: list[tuple[torch.cuda.Event, set[int]]] = []
        self.bytes_per_block = 0

    def register(self, kv_caches: Iterable[LayerKVCache]) -> None:
        for mla, idx in kv_caches:
            for t in (mla, idx):
                if t is None:
                    continue
                self.dev.append(t)
                self.host.append(
                    torch.empty((self.num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=self.cuda)
                )
                self.bytes_per_block += t[0].numel() * t.element_size()

    @property
    def nbytes(self) -> int:
        return self.bytes_per_block * self.num_slots

    def _copy(self, pairs, runs: list[tuple[int, int, int]], to_host: bool) -> None:
        if self.cuda and len(runs) > MAX_RUNS:
            self._gather(pairs, to_host)
            return
        for dev, host in zip(self.dev, self.host, strict=True):
            for b, s, n in runs:
                if to_host:
                    host[s : s + n].copy_(dev[b : b + n], non_blocking=self.cuda)
                else:
                    dev[b : b + n].copy_(host[s : s + n], non_blocking=self.cuda)

    def _gather(self, pairs, to_host: bool) -> None:
        """Scattered blocks: per tensor, one indexed read and one indexed write, the host side
        reached through its zero-copy device view (the indices go up from pinned memory without
        a host wait)."""
        idx = torch.tensor(pairs, dtype=torch.int64).pin_memory()
        idx = idx.to(self.device, non_blocking=True)
        blocks, slots = idx[:, 0], idx[:, 1]
        for dev, host in zip(self._dev_rows, self._host_rows, strict=True):
            if to_host:
                host.index_copy_(0, slots, dev.index_select(0, blocks))
            else:
                dev.index_copy_(0, blocks, host.index_select(0, slots))

    def _on_side_stream(self, pairs, to_host: bool):
        """Issue the copies after everything the compute stream has queued; returns the side
        stream's event after them (None on the CPU: already done)."""
        runs = coalesce(pairs)
        if not self.cuda:
            self._copy(pairs, runs, to_host)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._copy(pairs, runs, to_host)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev

    def store(self, pairs: Sequence[Sequence[int]]) -> None:
        """Copy device blocks to host slots (asynchronously on CUDA)."""
        if not pairs:
            return
        ev = self._on_side_stream(pairs, to_host=True)
        if ev is not None:
            self._stores.append((ev, {int(b) for b, _ in pairs}))

    def load(self, pairs: Sequence[Sequence[int]]):
        """Copy host slots to device blocks; returns a handle for :meth:`done`."""
        return self._on_side_stream(pairs, to_host=False) if pairs else None

    @staticmethod
    def done(handle) -> bool:
        return handle is None or handle.query()

    def guard(self, written_blocks: Iterable[int]) -> None:
        """Before a step that writes ``written_blocks``: the compute stream waits (on the device)
        for the stores still reading any of them."""
        if not self._stores:
            return
        written = set(written_blocks)
        live = []
        for ev, blocks in self._stores:
            if ev.query():
                continue
            live.append((ev, blocks))
            if blocks & written:
                torch.cuda.current_stream(self.device).wait_event(ev)
        self._stores = live

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self._stores = []
