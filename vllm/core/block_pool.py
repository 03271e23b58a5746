"""Physical KV blocks, reference counts, and the prefix cache.

A full block is identified by a chained hash: H(parent hash, the block's token ids). Freed blocks
keep their hash and stay findable until they are evicted (least recently freed first).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def hash_block(parent: bytes | None, tokens: list[int]) -> bytes:
    """Stable across processes (P/D transfers and the offload tier key blocks by it)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # free blocks in eviction order (first = evicted first); value unused
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.stats_queries = 0
        self.stats_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks if self.num_blocks else 0.0

    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h) if self.enable_caching else None

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                self.free.pop(b, None)
            self.ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:  # evict from the prefix cache
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        # reversed: a request's tail blocks are evicted before its head (the shared prefix)
        for b in reversed(blocks):
            self.ref_cnt[b] -= 1
            assert self.ref_cnt[b] >= 0, "block freed twice"
            if self.ref_cnt[b] == 0:
                self.free[b] = None

    def cache_block(self, b: int, h: bytes) -> None:
        if not self.enable_caching or self.block_hash[b] is not None:
            return
        self.block_hash[b] = h
        self.cached.setdefault(h, b)

    def reset_prefix_cache(self) -> bool:
        if any(self.ref_cnt):
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True
