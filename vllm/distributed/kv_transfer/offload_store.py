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

On the CPU every copy is synchronous, so the same code is exercised in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from vllm.distributed.kv_transfer.base import LayerKVCache


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

    def _copy(self, runs: list[tuple[int, int, int]], to_host: bool) -> None:
        for dev, host in zip(self.dev, self.host, strict=True):
            for b, s, n in runs:
                if to_host:
                    host[s : s + n].copy_(dev[b : b + n], non_blocking=self.cuda)
                else:
                    dev[b : b + n].copy_(host[s : s + n], non_blocking=self.cuda)

    def _on_side_stream(self, runs, to_host: bool):
        """Issue the copies after everything the compute stream has queued; returns the side
        stream's event after them (None on the CPU: already done)."""
        if not self.cuda:
            self._copy(runs, to_host)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._copy(runs, to_host)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev

    def store(self, pairs: Sequence[Sequence[int]]) -> None:
        """Copy device blocks to host slots (asynchronously on CUDA)."""
        if not pairs:
            return
        ev = self._on_side_stream(coalesce(pairs), to_host=True)
        if ev is not None:
            self._stores.append((ev, {int(b) for b, _ in pairs}))

    def load(self, pairs: Sequence[Sequence[int]]):
        """Copy host slots to device blocks; returns a handle for :meth:`done`."""
        return self._on_side_stream(coalesce(pairs), to_host=False) if pairs else None

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
