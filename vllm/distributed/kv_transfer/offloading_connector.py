"""CPU KV offload (``--kv-offloading-size``, upstream's ``OffloadingConnector``): a host-memory
tier of whole KV blocks keyed by the prefix cache's block hashes, so that a prefix evicted from
device memory (an agentic session's next turn, minutes later) is copied back over PCIe instead of
recomputed.

Scheduler half (this class, role SCHEDULER) — the index, in one place:

  * ``index``: block hash → host slot, least recently used first; a slot being read by a load
    is pinned (never evicted) until the load is reported finished.
  * Stores: every computed full block of a running request is offered once, in the step after
    it became final (KV of rejected speculative tokens is never final: only positions below the
    request's committed count are), and a finishing request's last ones in the next step. A
    hash already in the index is only refreshed.
  * Loads: :meth:`get_num_new_matched_tokens` counts the blocks after the device prefix hit that
    the index holds, consecutively; the request then waits (``WAITING_FOR_REMOTE_KVS``) while
    the workers copy them into its freshly allocated blocks, and resumes with them computed
    (and published to the device prefix cache).

Worker half (role WORKER): :class:`~vllm.distributed.kv_transfer.offload_store.HostKVStore`
does the copies; each step's :class:`OffloadMetadata` lists them.
"""

from __future__ import annotations

from collections import OrderedDict

from vllm.distributed.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from vllm.utils import logger


class OffloadMetadata(KVConnectorMetadata, tag=True):
    """One step's copies, the same on every rank: (device block, host slot) pairs. Stores are
    issued before loads: a load may read a slot this step's stores fill."""

    loads: dict[str, list[tuple[int, int]]] = {}
    stores: list[tuple[int, int]] = []


class _Tracked:
    __slots__ = ("req", "blocks", "offered")

    def __init__(self, req, blocks: list[int]):
        self.req, self.blocks, self.offered = req, blocks, 0


class OffloadingConnector(KVConnectorBase):
    def __init__(self, ctx: KVConnectorContext, role: KVConnectorRole):
        super().__init__(ctx, role)
        self.num_slots = ctx.offload_num_blocks
        self.block_size = ctx.shard.block_size * ctx.shard.dcp_size  # a scheduler block
        # scheduler state
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, LRU first
        self.slot_hash: list[bytes | None] = [None] * self.num_slots
        self.free_slots = list(range(self.num_slots - 1, -1, -1))  # pop() gives 0, 1, ...
        self.pins: dict[int, int] = {}  # slot -> loads reading it
        self.tracked: dict[str, _Tracked] = {}
        self.loading: dict[str, list[int]] = {}  # request -> pinned slots
        self._loads: dict[str, list[tuple[int, int]]] = {}
        self._stores: list[tuple[int, int]] = []
        self._stats: dict[str, float] = {}
        # worker state
        self.store = None  # a HostKVStore once the caches are registered
        self._pending: dict[str, tuple[object, int]] = {}  # request -> (load handle, bytes)
        self._worker_stats: dict[str, float] = {}

    # ---- scheduler side: the index ----------------------------------------------------------------
    def _count(self, key: str, v: float) -> None:
        self._stats[key] = self._stats.get(key, 0) + v

    def _alloc_slot(self) -> int | None:
        """A free slot, else the least recently used one that no load is reading (evicted)."""
        if self.free_slots:
            return self.free_slots.pop()
        for h, s in self.index.items():
            if not self.pins.get(s):
                del self.index[h]
                self.slot_hash[s] = None
                self._count("kv_offload_evicted_blocks", 1)
                return s
        return None

    def _offer(self, t: _Tracked, num_full: int) -> None:
        """Queue stores for the request's blocks [offered, num_full) not yet in the tier."""
        hashes = t.req.block_hashes if t.req.use_prefix_cache else ()
        num_full = min(num_full, len(hashes), len(t.blocks))
        for i in range(t.offered, num_full):
            h = hashes[i]
            if h in self.index:
                self.index.move_to_end(h)
                continue
            slot = self._alloc_slot()
            if slot is None:  # every slot is being read: offer the rest later
                num_full = i
                break
            self.index[h] = slot
            self.slot_hash[slot] = h
            self._stores.append((t.blocks[i], slot))
        t.offered = max(t.offered, num_full)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        if not request.use_prefix_cache or request.request_id in self.loading:
            return 0, False
        first = num_computed_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size  # leave a token to compute
        hashes = request.block_hashes
        n = 0
        for i in range(first, min(last, len(hashes))):
            if hashes[i] not in self.index:
                break
            n += 1
        return (n * self.block_size, True) if n else (0, False)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        rid = request.request_id
        self.tracked[rid] = _Tracked(request, list(block_ids))
        self._count("external_prefix_cache_queries", request.num_tokens)
        if num_external_tokens <= 0:
            return
        first = request.num_computed_tokens // self.block_size
        pairs, slots = [], []
        for i in range(first, first + num_external_tokens // self.block_size):
            slot = self.index[request.block_hashes[i]]
            self.index.move_to_end(request.block_hashes[i])
            self.pins[slot] = self.pins.get(slot, 0) + 1
            pairs.append((block_ids[i], slot))
            slots.append(slot)
        self._loads[rid] = pairs
        self.loading[rid] = slots
        self._count("external_prefix_cache_hits", num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> OffloadMetadata:
        so = scheduler_output
        for r in so.new_reqs:
            t = self.tracked.get(r.req_id)
            if t is not None:
                t.blocks = list(r.block_ids)
        for c in so.cached_reqs:
            t = self.tracked.get(c.req_id)
            if t is not None and c.new_block_ids:
                t.blocks += c.new_block_ids
        for rid, n in so.num_scheduled_tokens.items():
            t = self.tracked.get(rid)
            if t is not None:  # final: what was computed before this step (drafts rolled back)
                self._offer(t, (t.req.num_computed_tokens - n) // self.block_size)
        meta = OffloadMetadata(loads=self._loads, stores=self._stores)
        self._count("kv_offload_stored_blocks", len(self._stores))
        self._loads, self._stores = {}, []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_recving:
            for s in self.loading.pop(rid, ()):
                self.pins[s] -= 1
                if not self.pins[s]:
                    del self.pins[s]

    def request_finished(self, request, block_ids):
        rid = request.request_id
        t = self.tracked.pop(rid, None)
        if rid in self.loading:
            if self._loads.pop(rid, None) is not None:  # not issued yet: nothing will land
                self.update_connector_output(KVConnectorOutput(finished_recving=[rid]))
                return False, None
            return True, None  # its blocks are being filled: free them once that ended
        if t is not None:
            t.blocks = list(block_ids)
            # its last blocks are stored in the next step, before any new owner writes them
            self._offer(t, request.num_computed_tokens // self.block_size)
        return False, None

    def take_scheduler_stats(self) -> dict[str, float]:
        out, self._stats = self._stats, {}
        return out

    # ---- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        from vllm.distributed.kv_transfer.offload_store import HostKVStore

        self.store = HostKVStore(self.num_slots, kv_caches[0][0].device)
        self.store.register(kv_caches)
        logger.info(
            "CPU KV offload: %.2f GiB of %s host memory on this rank (%d blocks of %d tokens)",
            self.store.nbytes / 2**30,
            "pinned" if self.store.cuda else "plain",
            self.num_slots,
            self.block_size,
        )

    def start_load_kv(self, so) -> None:
        meta = self._metadata
        if isinstance(meta, OffloadMetadata):
            # stores first: a block offered in this step's metadata may be the one a load of
            # the same step reads back (its device copy evicted meanwhile); the slots loads
            # read are pinned, so no store of the step targets them
            self.store.store(meta.stores)
            if meta.stores:
                st = self._worker_stats
                st["kv_offload_store_bytes"] = (
                    st.get("kv_offload_store_bytes", 0)
                    + len(meta.stores) * self.store.bytes_per_block
                )
            for rid, pairs in meta.loads.items():  # same stream as the stores: ordered after
                nbytes = len(pairs) * self.store.bytes_per_block
                self._pending[rid] = (self.store.load(pairs), nbytes)
        written = [b for r in so.new_reqs for b in r.block_ids]
        written += [b for c in so.cached_reqs for b in c.new_block_ids]
        self.store.guard(written)

    def get_finished(self, finished_req_ids):
        recving = set()
        for rid, (handle, nbytes) in list(self._pending.items()):
            if self.store.done(handle):
                del self._pending[rid]
                recving.add(rid)
                st = self._worker_stats
                st["kv_offload_load_bytes"] = st.get("kv_offload_load_bytes", 0) + nbytes
                st["kv_offload_num_loads"] = st.get("kv_offload_num_loads", 0) + 1
        return set(), recving

    def take_failures_and_stats(self):
        out, self._worker_stats = self._worker_stats, {}
        return {}, out

    def shutdown(self) -> None:
        if self.store is not None:
            self.store.synchronize()
