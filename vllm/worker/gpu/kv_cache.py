"""This rank's KV cache tensors: sized from a memory budget, allocated, bound to the layers.

``WorkerKVCache`` keeps every layer's MLA rows and indexer keys in device memory; features that
keep KV elsewhere (Hybrid HiSparse: a pinned host pool beside a smaller device pool) subclass it.
"""

from __future__ import annotations

import torch

from vllm.attention.kv_access import KVAccess
from vllm.core.messages import KVCachePlan
from vllm.kv_cache_interface import KVCacheLayout


class WorkerKVCache:
    def __init__(
        self,
        layers: list,
        layout: KVCacheLayout,
        bytes_per_block: int,
        device: torch.device,
        num_blocks_override: int | None = None,
    ):
        """``layers``: the model's attention layers; ``bytes_per_block``: what one block of
        ``layout.block_size`` tokens takes across every layer of the model (MTP included)."""
        self.layers, self.layout, self.device = layers, layout, device
        self.bytes_per_block = bytes_per_block
        self.num_blocks_override = num_blocks_override

    def plan(self, budget_bytes: int) -> KVCachePlan:
        """Blocks per pool for a budget of device memory on this rank."""
        n = self.num_blocks_override or budget_bytes // self.bytes_per_block
        return KVCachePlan(num_blocks=int(n))

    def allocate(self, plan: KVCachePlan, kv_access: KVAccess) -> None:
        n = plan.num_blocks
        for attn in self.layers:
            idx = self.layout.allocate_indexer(n, self.device) if attn.has_indexer else None
            attn.bind_kv(self.layout.allocate_mla(n, self.device), idx, kv_access)

    def transfer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Every layer's (MLA rows, indexer keys) tensors, MTP layers last: what a KV connector
        registers, reads and writes at ``KVCacheManager.transfer_block_ids``."""
        return [(a.kv_cache, a.indexer_cache) for a in self.layers]
