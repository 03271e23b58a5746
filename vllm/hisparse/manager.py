"""Engine-core side of HiSparse: where each page of each request lives.

Three pools:
  * `gpu`  — MLA pages (and hot-buffer leases) in HBM, the ordinary KV block pool;
  * `host` — pinned host pages: every completed page is backed up here (also the prefix cache);
  * `idx`  — indexer-key pages in HBM (small: keys never leave the GPU).
A request always has host and indexer pages for all its tokens, and a GPU page for its tail. When
the GPU pool is short, completed (already backed-up) pages of the requests holding the most GPU
pages are dropped — no copy needed — instead of preempting; such a request then leases a hot
buffer of `hot_rows` rows. Admission and capacity follow the host pool, so long-context
concurrency is bounded by host memory, not HBM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.core.block_pool import BlockPool
from vllm.core.kv_cache_manager import KVCacheManager
from vllm.core.messages import KVPageUpdate
from vllm.core.request import Request
from vllm.kv_cache_interface import cdiv


@dataclass
class Pages:
    gpu: list[int] = field(default_factory=list)  # per page, −1 = dropped (host only)
    host: list[int] = field(default_factory=list)
    idx: list[int] = field(default_factory=list)
    hot: list[int] = field(default_factory=list)  # leased GPU blocks of the hot buffer
    backed: int = 0  # pages [0, backed) are complete and have a host copy
    # deltas not yet sent to the workers
    sent_pages: int = 0
    dropped: list[int] = field(default_factory=list)
    restore: list[int] = field(default_factory=list)
    upload: list[int] = field(default_factory=list)
    hot_sent: bool = False


class HiSparseKVManager(KVCacheManager):
    def __init__(
        self,
        num_gpu_blocks: int,
        num_host_blocks: int,
        num_idx_blocks: int,
        block_size: int,
        hot_rows: int,
        enable_caching: bool = True,
    ):
        self.block_size = block_size
        self.pool = BlockPool(num_gpu_blocks, enable_caching=False)
        self.host = BlockPool(num_host_blocks, enable_caching)
        self.idx = BlockPool(num_idx_blocks, enable_caching=False)
        self.hot_blocks = cdiv(hot_rows, block_size)
        self.pages: dict[str, Pages] = {}
        self.stats_dropped = 0

    def max_chunk_tokens(self) -> int | None:
        """Largest prefill chunk whose pages fit in the GPU pool beside one hot-buffer lease."""
        pages = self.pool.num_blocks - self.hot_blocks - 1
        if pages < 1:
            raise ValueError(
                f"HiSparse needs at least {self.hot_blocks + 2} GPU KV blocks (a hot buffer of "
                f"{self.hot_blocks} blocks, a tail page and a page to prefill into); got {self.pool.num_blocks}"
            )
        return pages * self.block_size

    @property
    def capacity_tokens(self) -> int:
        return min(self.host.num_blocks, self.idx.num_blocks) * self.block_size

    def usage(self) -> float:
        return self.pool.usage()

    def reset_prefix_cache(self) -> bool:
        """The prefix cache is the host pool here."""
        return self.host.reset_prefix_cache()

    @property
    def prefix_pool(self) -> BlockPool:
        """The prefix cache is the host pool here."""
        return self.host

    def extra_stats(self, worker_stats: dict[str, float]) -> dict[str, float]:
        hits, misses = worker_stats.get("hisparse_hits", 0), worker_stats.get("hisparse_misses", 0)
        return {
            "hisparse_host_pool_usage_perc": self.host.usage(),
            "hisparse_hot_hit_rate": hits / (hits + misses) if hits + misses else 1.0,
            "hisparse_h2d_bytes_per_step": worker_stats.get("hisparse_h2d_bytes", 0),
            "hisparse_pages_dropped_total": self.stats_dropped,
        }

    # ---- prefix cache: host pages ------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        if not self.host.enable_caching or not req.use_prefix_cache:
            return [], 0
        hits = self.host.cached_prefix(self._hashes(req, (req.num_tokens - 1) // self.block_size))
        return hits, len(hits) * self.block_size

    # ---- allocation ----------------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[int] | None = None):
        st = self.pages.get(req.request_id) or Pages()
        computed = computed or []
        have = len(st.host) + len(computed)
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        need = cdiv(total, self.block_size) - have
        need_hot = self.hot_blocks if (computed and not st.hot) else 0
        self.host.touch(computed)
        new_host = self.host.allocate(need) if need > 0 else []
        new_idx = self.idx.allocate(len(computed) + max(need, 0))
        if new_host is None or new_idx is None:
            for pool, blocks in ((self.host, new_host), (self.idx, new_idx)):
                if blocks:
                    pool.release(blocks)
            self.host.release(computed)
            return None
        new_gpu = self._allocate_gpu(max(need, 0) + need_hot, req.request_id)
        if new_gpu is None:
            self.host.release(computed + new_host)
            self.idx.release(new_idx)
            return None
        if need_hot:
            st.hot, new_gpu = new_gpu[:need_hot], new_gpu[need_hot:]
        first_restore = len(st.host)
        st.host += computed + new_host
        st.idx += new_idx
        st.gpu += [-1] * len(computed) + new_gpu
        st.restore += list(range(first_restore, first_restore + len(computed)))
        if computed:  # cached pages are complete on the host; a partial last page is not
            st.backed = max(st.backed, first_restore + len(computed))
        self.pages[req.request_id] = st
        return new_gpu

    # ---- KV from a remote engine (P/D): received into the host pool ------------------------------
    partial_loads = False  # received pages are host-only: a failed load recomputes from scratch

    def allocate_for_load(self, req: Request, num_external_tokens: int, computed: list[int]):
        """Pages for a prompt whose KV a connector writes into the host pool (MLA rows and
        indexer keys, at :meth:`transfer_block_ids`): every page gets a host and an indexer
        page; complete pages stay host-only (like prefix-cache hits: their indexer keys are
        restored to the GPU when the request starts, decode reads their rows through the hot
        buffer, leased here); a partial last page gets a device block, to which its received
        rows are uploaded (decode writes its next rows there)."""
        assert req.request_id not in self.pages, "a load is planned for a new request"
        bs = self.block_size
        total = len(computed) * bs + num_external_tokens
        n_pages, full = cdiv(total, bs), total // bs
        need_hot = self.hot_blocks if full else 0
        self.host.touch(computed)
        new_host = self.host.allocate(n_pages - len(computed))
        new_idx = self.idx.allocate(n_pages)
        new_gpu = None
        if new_host is not None and new_idx is not None:
            new_gpu = self._allocate_gpu(n_pages - full + need_hot, req.request_id)
        if new_gpu is None:
            for pool, blocks in ((self.host, new_host), (self.idx, new_idx)):
                if blocks:
                    pool.release(blocks)
            self.host.release(computed)
            return None
        st = Pages(
            gpu=[-1] * full + new_gpu[need_hot:],
            host=computed + new_host,
            idx=new_idx,
            hot=new_gpu[:need_hot],
            backed=len(computed),  # received pages are published once they land
            restore=list(range(n_pages)),
            upload=list(range(full, n_pages)),
        )
        self.pages[req.request_id] = st
        return new_gpu

    def transfer_block_ids(self, req: Request) -> list[int]:
        """The request's host pages: a connector writes received KV there."""
        st = self.pages.get(req.request_id)
        return list(st.host) if st else []

    def _allocate_gpu(self, n: int, requester: str) -> list[int] | None:
        if n <= self.pool.num_free_blocks:
            return self.pool.allocate(n)
        if not self._drop_pages(n - self.pool.num_free_blocks, requester):
            return None
        return self.pool.allocate(n)

    def _drop_pages(self, short: int, requester: str) -> bool:
        """Free `short` GPU blocks by dropping backed-up pages, oldest first, from the requests
        holding the most droppable pages (a request's first drop costs it a hot-buffer lease)."""

        def droppable(st: Pages) -> list[int]:
            return [i for i in range(min(st.backed, len(st.gpu) - 1)) if st.gpu[i] >= 0]

        order = sorted(self.pages.items(), key=lambda kv: -len(droppable(kv[1])))
        freed = 0
        for _rid, st in order:
            cand = droppable(st)
            lease = 0 if st.hot else self.hot_blocks
            if len(cand) <= lease:
                continue
            take = cand[: min(len(cand), short - freed + lease)]
            blocks = [st.gpu[i] for i in take]
            for i in take:
                st.gpu[i] = -1
            st.dropped += take
            self.pool.release(blocks)
            self.stats_dropped += len(take)
            if lease:
                st.hot = self.pool.allocate(lease)
            freed += len(take) - lease
            if freed >= short:
                return True
        return freed >= short

    def cache_full_blocks(self, req: Request, num_computed: int) -> None:
        """After a step: pages complete by now have been backed up to host by the workers."""
        st = self.pages.get(req.request_id)
        if st is None:
            return
        n = min(num_computed, req.num_tokens) // self.block_size
        start = st.backed  # pages before it were published at an earlier step
        st.backed = max(st.backed, n)
        if n > start and self.host.enable_caching and req.use_prefix_cache:
            self._extend_hashes(req, n)
            for i in range(start, min(n, len(st.host))):
                self.host.cache_block(st.host[i], req.block_hashes[i])

    def free(self, req: Request) -> None:
        st = self.pages.pop(req.request_id, None)
        if st is None:
            return
        self.pool.release([b for b in st.gpu if b >= 0] + st.hot)
        self.idx.release(st.idx)
        self.host.release(st.host)

    def blocks_of(self, req: Request) -> list[int]:
        st = self.pages.get(req.request_id)
        return list(st.gpu) if st else []

    # ---- worker deltas ------------------------------------------------------------------------
    def worker_update(self, req: Request, is_new: bool) -> KVPageUpdate:
        """What the workers must learn about this request's pages (all of it for a new request)."""
        st = self.pages[req.request_id]
        lo = 0 if is_new else st.sent_pages
        upd = KVPageUpdate(
            host=st.host[lo:],
            idx=st.idx[lo:],
            dropped=[] if is_new else st.dropped,
            restore=st.restore,
            hot=st.hot if (st.hot and (is_new or not st.hot_sent)) else [],
            upload=st.upload,
        )
        st.sent_pages, st.dropped, st.restore, st.upload = len(st.host), [], [], []
        st.hot_sent = bool(st.hot)
        return upd

    def residency(self, req: Request) -> str:
        st = self.pages.get(req.request_id)
        if st is None or not st.gpu:
            return "none"
        on = sum(b >= 0 for b in st.gpu)
        return "full" if on == len(st.gpu) else ("none" if on <= 1 else "mixed")
