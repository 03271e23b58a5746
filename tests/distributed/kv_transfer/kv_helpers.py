"""Shared by the KV-transfer tests and the benchmark: small GLM-shaped KV layouts, caches laid out
by the engine's own write path (``MLAMetadata.slots_for`` + the cache write references), and
plan application with plain tensor copies (direct, or staged and scattered as NixlWorker does)."""

from __future__ import annotations

import numpy as np
import torch

from vllm.attention.metadata import CPMetadata, MLAMetadata
from vllm.distributed.kv_transfer.nixl_worker import word_view
from vllm.distributed.kv_transfer.reshard import (
    KVShardLayout,
    RankReads,
    cache_byte_runs,
    indexer_regions,
    mla_regions,
    plan_reads,
    source_runs,
    staged_byte_runs,
    staged_rows,
)
from vllm.kernels.kv_cache import write_indexer_cache_ref, write_mla_cache_ref
from vllm.kv_cache_interface import KVCacheLayout

# GLM-shaped but small: fp8_ds_mla rows of 128 + 4 + 2·16 = 164 B, FP8 indexer keys of 32 + 4 B
SMALL_FP8 = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 128, 16, 32)
SMALL_BF16 = KVCacheLayout("auto", torch.bfloat16, 128, 16, 32)


def engine_slots(layout: KVShardLayout, rank: int, block_ids, pos: torch.Tensor) -> torch.Tensor:
    """Slots of positions on `rank` as the engine computes them (−1: not owned)."""
    n = len(pos)
    bt = torch.tensor([list(block_ids)], dtype=torch.int32)
    meta = MLAMetadata(
        layout=KVCacheLayout("auto", torch.float32, 128, 16, 32, layout.block_size),
        index_topk=1,
        positions=pos,
        token_req=torch.zeros(n, dtype=torch.int64),
        query_start_loc_cpu=[0, n],
        seq_lens=torch.tensor([n]),
        seq_lens_cpu=[n],
        block_table=bt,
        is_prefill_cpu=[True],
        use_dense_cpu=[False],
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        cp=CPMetadata(layout.dcp_size, layout.dcp_rank(rank), layout.interleave),
    )
    return meta.slots_for(meta.token_req, pos)


class LogicalKV:
    """A request's KV rows in position order, for `num_layers` layers (odd layers: no indexer)."""

    def __init__(self, layout: KVCacheLayout, num_tokens: int, num_layers: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.layout, self.num_tokens, self.num_layers = layout, num_tokens, num_layers
        r, rope, d = layout.kv_lora_rank, layout.rope_dim, layout.index_head_dim
        self.kv_c = [torch.randn(num_tokens, r, generator=g) for _ in range(num_layers)]
        self.k_pe = [torch.randn(num_tokens, rope, generator=g) for _ in range(num_layers)]
        self.idx = [
            torch.randn(num_tokens, d, generator=g) * (1 + li) if li % 2 == 0 else None
            for li in range(num_layers)
        ]

    def caches(self, shard: KVShardLayout, rank: int, block_ids, num_blocks: int, lo=0, hi=None):
        """This rank's per-layer (MLA, indexer | None) caches holding positions [lo, hi) it owns,
        written by the engine's cache-write references at the engine's slots."""
        out = empty_caches(self.layout, self.num_layers, num_blocks)
        self.write_into(out, shard, rank, block_ids, lo, hi)
        return out

    def write_into(self, caches, shard: KVShardLayout, rank: int, block_ids, lo=0, hi=None):
        hi = self.num_tokens if hi is None else hi
        pos = torch.arange(self.num_tokens)
        slots = engine_slots(shard, rank, block_ids, pos)
        slots = torch.where((pos >= lo) & (pos < hi), slots, -1)
        for li, (mla, idx) in enumerate(caches):
            write_mla_cache_ref(mla, self.kv_c[li], self.k_pe[li], slots, self.layout)
            if idx is not None:
                write_indexer_cache_ref(idx, self.idx[li], slots, self.layout)


def empty_caches(layout: KVCacheLayout, num_layers: int, num_blocks: int):
    """Zeroed per-layer caches; even layers have an indexer cache (like IndexShare's full ones)."""
    return [
        (
            layout.allocate_mla(num_blocks, "cpu"),
            layout.allocate_indexer(num_blocks, "cpu") if li % 2 == 0 else None,
        )
        for li in range(num_layers)
    ]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


def apply_plan(
    kv_layout: KVCacheLayout,
    src: KVShardLayout,
    src_block_ids,
    src_caches,
    dst: KVShardLayout,
    dst_block_ids,
    dst_rank: int,
    dst_caches,
    lo: int,
    hi: int,
    staged: bool = False,
    chunk_rows: int | None = None,
) -> tuple[int, int]:
    """Copy the planned byte runs with plain tensor copies; returns (bytes, runs) moved.
    ``staged``: read source-contiguous runs into staging areas, ``chunk_rows`` rows at a time,
    and scatter them to their slots with word-view indexed copies."""
    moved = num_runs = 0
    for rr in plan_reads(src, src_block_ids, dst, dst_block_ids, dst_rank, lo, hi):
        for li, (dst_mla, dst_idx) in enumerate(dst_caches):
            src_mla, src_idx = src_caches[rr.src_rank][li]
            pairs = [(mla_regions(kv_layout), src_mla, dst_mla)]
            if dst_idx is not None:
                pairs.append((indexer_regions(kv_layout), src_idx, dst_idx))
            for regions, s_t, d_t in pairs:
                copy = _copy_staged if staged else _copy_direct
                b, r = copy(rr, regions, s_t, d_t, chunk_rows)
                moved, num_runs = moved + b, num_runs + r
    return moved, num_runs


def _copy_runs(sb: torch.Tensor, db: torch.Tensor, br) -> None:
    for a, b, n in zip(br.src.tolist(), br.dst.tolist(), br.length.tolist(), strict=True):
        db[b : b + n] = sb[a : a + n]


def _copy_direct(rr: RankReads, regions, s_t, d_t, chunk_rows) -> tuple[int, int]:
    br = cache_byte_runs(rr.runs, regions)
    _copy_runs(as_bytes(s_t), as_bytes(d_t), br)
    return br.num_bytes, len(br.length)


def _copy_staged(rr: RankReads, regions, s_t, d_t, chunk_rows) -> tuple[int, int]:
    rows = staged_rows(rr.runs)
    step = chunk_rows or max(len(rows), 1)
    moved = num_runs = 0
    for region in regions:
        view = word_view(d_t, region)  # [pages, rows_per_page, words]
        for a in range(0, len(rows), step):
            b = min(a + step, len(rows))
            stage = torch.zeros((b - a) * region.row_bytes, dtype=torch.uint8)
            br = staged_byte_runs(source_runs(rows.src[a:b]), region)
            _copy_runs(as_bytes(s_t), stage, br)
            dst = torch.from_numpy(rows.dst[a:b])
            view[dst // region.rows_per_page, dst % region.rows_per_page] = stage.view(
                view.dtype
            ).view(b - a, -1)
            moved, num_runs = moved + br.num_bytes, num_runs + len(br.length)
    return moved, num_runs


def block_ids_for(shard: KVShardLayout, num_tokens: int, pool: int, seed: int, shuffle=True):
    """Per DCP rank block ids (one shared virtual list, as the engine allocates)."""
    n = shard.num_blocks(num_tokens)
    rng = np.random.default_rng(seed)
    ids = rng.permutation(pool)[:n] if shuffle else np.arange(1, n + 1)
    return [ids.tolist()] * shard.dcp_size
