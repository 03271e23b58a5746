"""The scheduler's view of the KV cache: which blocks each request holds, and the prefix cache.

``KVCacheManager`` declares what the scheduler asks of any KV manager; ``DeviceKVCacheManager``
keeps every block in device memory (the default); ``vllm.hisparse.manager.HiSparseKVManager``
backs pages with a pinned host pool. Blocks here are scheduler blocks of `block_size` tokens;
under DCP N a scheduler block is a "virtual" block of 64·N tokens whose id addresses one physical
64-token block on every DCP rank, so prefix caching hashes at that granularity.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from vllm.core.block_pool import BlockPool, hash_block, hash_chain
from vllm.core.messages import KVPageUpdate
from vllm.core.request import Request
from vllm.kv_cache_interface import cdiv


class KVCacheManager(ABC):
    """What the scheduler asks of a KV manager. ``pool`` is the device block pool."""

    block_size: int
    pool: BlockPool

    @property
    @abstractmethod
    def capacity_tokens(self) -> int:
        """Most tokens one request can hold."""

    @abstractmethod
    def usage(self) -> float:
        """Fraction of the device blocks in use."""

    @abstractmethod
    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix (whole blocks, leaving at least one token to compute): its
        blocks and its length in tokens."""

    @abstractmethod
    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed: list[int] | None = None
    ) -> list[int] | None:
        """Blocks for `num_new_tokens` more tokens (after `computed`, a cached prefix taken now).
        Returns the new device block ids, or None (nothing changed) if the pools are short."""

    @abstractmethod
    def cache_full_blocks(self, req: Request, num_computed: int) -> None:
        """After a step: publish the request's blocks that are now completely computed."""

    @abstractmethod
    def free(self, req: Request) -> None:
        """Release everything the request holds."""

    @abstractmethod
    def blocks_of(self, req: Request) -> list[int]:
        """The request's device block ids, in order (a copy)."""

    def max_chunk_tokens(self) -> int | None:
        """Largest prefill chunk the manager can place in one step (None: no limit)."""
        return None

    # ---- KV arriving from another engine (a KV connector's asynchronous load) ---------------------
    #: a load that failed part-way may keep its blocks before the first failed one (False: the
    #: manager cannot resume a request mid-load, so a failed load recomputes from scratch)
    partial_loads: bool = True

    def allocate_for_load(
        self, req: Request, num_external_tokens: int, computed: list[int]
    ) -> list[int] | None:
        """Room for a cached prefix (``computed``) plus ``num_external_tokens`` whose KV a
        connector writes; None (nothing changed) if the pools are short."""
        return self.allocate_slots(req, num_external_tokens, computed)

    def transfer_block_ids(self, req: Request) -> list[int]:
        """The block ids a connector reads or writes the request's KV at, one per block, in
        order (the device blocks here)."""
        return self.blocks_of(req)

    def worker_update(self, req: Request, is_new: bool) -> KVPageUpdate | None:
        """What the workers must learn about where the request's pages live, beyond its block
        ids (None: nothing)."""
        return None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (and nothing changes) while any is in use."""
        return self.pool.reset_prefix_cache()

    @property
    def prefix_pool(self) -> BlockPool:
        """The pool whose blocks are the prefix cache."""
        return self.pool

    def record_prefix_lookup(self, req: Request, num_hit: int) -> None:
        """Count a request's prefix-cache lookup once, when it is first admitted (a request
        waiting for room is looked up again at every try; a preempted one when it returns)."""
        pool = self.prefix_pool
        if pool.enable_caching and req.use_prefix_cache:
            pool.stats_queries += req.num_tokens
            pool.stats_hits += num_hit

    def take_prefix_cache_stats(self) -> tuple[int, int]:
        """(queried tokens, hit tokens) of the prefix cache since the last call."""
        pool = self.prefix_pool
        out = (pool.stats_queries, pool.stats_hits)
        pool.stats_queries = pool.stats_hits = 0
        return out

    def extra_stats(self, worker_stats: dict[str, float]) -> dict[str, float]:
        """Manager-specific gauges for the metrics endpoint, given the workers' counters summed
        since the last report."""
        return {}

    def _extend_hashes(self, req: Request, num_full: int) -> None:
        """Chain-hash the request's full blocks up to num_full (kept on the request)."""
        bs = self.block_size
        have = len(req.block_hashes)
        in_prompt = min(num_full, len(req.prompt_token_ids) // bs)
        if have < in_prompt:  # the prompt's blocks straight from its packed array
            parent = req.block_hashes[-1] if have else None
            part = req.prompt_token_ids[have * bs : in_prompt * bs]
            req.block_hashes.extend(hash_chain(parent, part, bs))
        while len(req.block_hashes) < num_full:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            req.block_hashes.append(hash_block(parent, req.token_slice(i * bs, (i + 1) * bs)))

    def _hashes(self, req: Request, num_full: int) -> list[bytes]:
        self._extend_hashes(req, num_full)
        return req.block_hashes[:num_full]


class DeviceKVCacheManager(KVCacheManager):
    """Every block in device memory, with prefix caching by chained block hashes."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[int]] = {}
        # blocks of each request already published to the prefix cache: a step publishes only
        # the ones completed since, not the whole context again
        self.published: dict[str, int] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def usage(self) -> float:
        return self.pool.usage()

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix (whole blocks), leaving at least one token to compute."""
        if not self.pool.enable_caching or not req.use_prefix_cache:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = self.pool.cached_prefix(self._hashes(req, max_blocks))
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed: list[int] | None = None
    ) -> list[int] | None:
        """Blocks for `num_new_tokens` more tokens (after the computed prefix). Returns the newly
        allocated block ids, or None (nothing changed) if the pool is short."""
        blocks = self.req_blocks.get(req.request_id)
        if blocks is not None and not computed:  # a running request: most steps need no block
            need = cdiv(req.num_computed_tokens + num_new_tokens, self.block_size) - len(blocks)
            if need <= 0:
                req.kv_room = len(blocks) * self.block_size
                return []
        computed = computed or []
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        need = cdiv(total, self.block_size) - len(blocks or ()) - len(computed)
        self.pool.touch(computed)
        new = self.pool.allocate(max(need, 0))
        if new is None:
            self.pool.release(computed)
            return None
        if blocks is None:  # grown in place: no per-step copy of a long request's block list
            blocks = self.req_blocks[req.request_id] = []
        blocks += computed
        blocks += new
        req.kv_room = len(blocks) * self.block_size
        return new

    def cache_full_blocks(self, req: Request, num_computed: int) -> None:
        """Publish the request's blocks that are now completely computed."""
        start = self.published.get(req.request_id, 0)
        req.kv_publish_at = (start + 1) * self.block_size  # the next block's end
        if num_computed // self.block_size <= start:  # no block completed since (most steps)
            return
        if not self.pool.enable_caching or not req.use_prefix_cache:
            req.kv_publish_at = 1 << 62  # never anything to publish
            return
        n = min(num_computed, req.num_tokens) // self.block_size
        if n <= start:
            return
        req.kv_publish_at = (n + 1) * self.block_size
        blocks = self.req_blocks.get(req.request_id, [])
        self._extend_hashes(req, n)
        hashes = req.block_hashes
        for i in range(start, min(n, len(blocks))):
            self.pool.cache_block(blocks[i], hashes[i])
        self.published[req.request_id] = n

    def free(self, req: Request) -> None:
        req.kv_room = req.kv_publish_at = 0
        self.published.pop(req.request_id, None)
        blocks = self.req_blocks.pop(req.request_id, None)
        if blocks:
            self.pool.release(blocks)

    def blocks_of(self, req: Request) -> list[int]:
        """A copy (the manager's own list keeps growing in place)."""
        return list(self.req_blocks.get(req.request_id, ()))
