"""Resharding plan: which KV rows a decode rank reads from which prefill rank (pure numpy).

Where rows live (read from ``distributed/groups.py``, ``pcp_manager.py``, ``cp_attention.py``):

  * An engine replica has ``world_size`` = PCP × TP ranks, ordered [PCP, TP] with TP fastest.
    DCP adds no ranks: DCP groups are runs of ``dcp_size`` consecutive ranks, so rank k has DCP
    rank ``k % dcp_size`` and there are ``world_size // dcp_size`` full copies of the KV.
  * PCP splits the *queries* only: every step's new KV rows are all-gathered over the PCP group
    before the cache write, so PCP ranks do not split the KV. PCP ranks that share a DCP rank
    (PCP > DCP, e.g. PCP2 × DCP1) hold identical replicas; PCP2 × DCP2 (TP 1) is two ranks, each
    holding half the rows; PCP2 × TP2 × DCP2 is four ranks where {0, 2} hold shard 0 and {1, 3}
    shard 1; PCP2 × TP2 × DCP4 is four ranks with four distinct shards.
  * DCP size N, interleave I: token p lives on DCP rank (p // I) % N. A scheduler block is a
    virtual block of block_size·N tokens whose one id addresses one physical block of
    block_size rows on every DCP rank; position p sits at slot
    ``block_ids[p // (bs·N)]·bs + ((p % (bs·N)) // (I·N))·I + p % I`` of its owner
    (``MLAMetadata.slots_for``). With I dividing bs, that is local index
    j = (p // (I·N))·I + p % I at slot ``block_ids[j // bs]·bs + j % bs``.

A plan is layer-independent and made of slot runs; each cache *region* (the MLA rows, the FP8
indexer values, the FP8 indexer scales) lowers slot runs to byte runs: the MLA cache and the bf16
indexer cache are flat arrays of rows (a run may cross block boundaries when the blocks are
consecutive), while the FP8 indexer page stores all block_size values first and the scales after
them, so its runs are cut at page boundaries.

Only the rows a destination rank owns cross to it. Where the source keeps several copies (PCP or
TP replicas), destination ranks spread their reads over the copies.

Short runs (DCP N -> M with a small interleave: every other row, say) make a transfer
descriptor-bound. Such a read can be *staged*: ``staged_rows`` lists its rows in source order,
``source_runs`` cuts them into runs contiguous on the source side only, ``staged_byte_runs``
lowers those to byte runs into a packed staging area (per region: ``n`` rows of ``row_bytes``),
and the reader scatters staged row r to destination slot ``dst[r]`` itself. Still only the owned
rows cross.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm.kv_cache_interface import KVCacheLayout


@dataclass(frozen=True)
class KVShardLayout:
    """How one engine replica spreads a request's KV rows over its ranks."""

    world_size: int = 1  # ranks holding KV: PCP × TP
    dcp_size: int = 1
    interleave: int = 1
    block_size: int = 64

    def __post_init__(self) -> None:
        if min(self.world_size, self.dcp_size, self.interleave, self.block_size) < 1:
            raise ValueError(f"KVShardLayout sizes must be >= 1: {self}")
        if self.world_size % self.dcp_size:
            raise ValueError(f"DCP size {self.dcp_size} must divide world size {self.world_size}")
        if self.block_size % self.interleave:
            raise ValueError(
                f"interleave {self.interleave} must divide the block size {self.block_size}"
            )

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.dcp_size

    def dcp_rank(self, rank: int) -> int:
        return rank % self.dcp_size

    def owner(self, pos: np.ndarray) -> np.ndarray:
        """DCP rank holding each position."""
        return (pos // self.interleave) % self.dcp_size

    def slots(self, pos: np.ndarray, block_ids: Sequence[int]) -> np.ndarray:
        """Slot of each position on its owner (block ids of the owner's DCP rank)."""
        bs, n, i = self.block_size, self.dcp_size, self.interleave
        bt = np.asarray(block_ids, dtype=np.int64)
        off = pos % (bs * n)
        return bt[pos // (bs * n)] * bs + (off // (i * n)) * i + off % i

    def num_blocks(self, num_tokens: int) -> int:
        """Scheduler (virtual) blocks covering ``num_tokens`` positions."""
        return -(-num_tokens // (self.block_size * self.dcp_size))


@dataclass
class SlotRuns:
    """Runs of rows contiguous in both caches: rows [src, src + n) go to [dst, dst + n)."""

    src: np.ndarray  # [R] int64 first source slot
    dst: np.ndarray  # [R] int64 first destination slot
    length: np.ndarray  # [R] int64 rows

    @property
    def num_rows(self) -> int:
        return int(self.length.sum())

    def __len__(self) -> int:
        return len(self.length)


@dataclass
class RankReads:
    """What one destination rank reads from one source rank."""

    src_rank: int
    runs: SlotRuns


def merge_runs(src: np.ndarray, dst: np.ndarray, page: int | None = None) -> SlotRuns:
    """Maximal runs of (src slot, dst slot) pairs that are consecutive on both sides. Pairs are
    sorted by source slot first, so a run never depends on position order. ``page``: also cut
    where either side enters a new page of that many rows."""
    order = np.argsort(src, kind="stable")
    src, dst = src[order], dst[order]
    if len(src) == 0:
        z = np.zeros(0, dtype=np.int64)
        return SlotRuns(z, z.copy(), z.copy())
    brk = (np.diff(src) != 1) | (np.diff(dst) != 1)
    if page is not None:
        brk |= (src[1:] % page == 0) | (dst[1:] % page == 0)
    starts = np.concatenate([[0], np.nonzero(brk)[0] + 1])
    lengths = np.diff(np.concatenate([starts, [len(src)]]))
    return SlotRuns(src[starts], dst[starts], lengths.astype(np.int64))


def plan_reads(
    src: KVShardLayout,
    src_block_ids: Sequence[Sequence[int]],
    dst: KVShardLayout,
    dst_block_ids: Sequence[Sequence[int]],
    dst_rank: int,
    lo: int,
    hi: int,
) -> list[RankReads]:
    """Reads that fill destination rank ``dst_rank`` with positions [lo, hi) of a request.

    ``src_block_ids[s]`` / ``dst_block_ids[d]``: the request's block ids on source DCP rank s /
    destination DCP rank d (today one virtual id list shared by every DCP rank). Returns one entry
    per source rank read from (source ranks are replica ranks, ``0 <= rank < src.world_size``),
    with maximal slot runs. Only the positions ``dst_rank`` owns are listed.
    """
    if not 0 <= lo <= hi:
        raise ValueError(f"bad position range [{lo}, {hi})")
    d = dst.dcp_rank(dst_rank)
    pos = np.arange(lo, hi, dtype=np.int64)
    pos = pos[dst.owner(pos) == d]
    if len(pos) == 0:
        return []
    if src.num_blocks(hi) > len(src_block_ids[0]) or dst.num_blocks(hi) > len(dst_block_ids[d]):
        raise ValueError(f"block ids do not cover {hi} tokens")
    dst_slot = dst.slots(pos, dst_block_ids[d])
    owner = src.owner(pos)
    replica = dst_rank % src.num_replicas
    reads = []
    for s in range(src.dcp_size):
        mine = owner == s
        if not mine.any():
            continue
        src_slot = src.slots(pos[mine], src_block_ids[s])
        reads.append(RankReads(replica * src.dcp_size + s, merge_runs(src_slot, dst_slot[mine])))
    return reads


# ---- byte lowering --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Region:
    """Where a slot's bytes sit in one per-layer cache tensor: at
    ``(slot // rows_per_page)·page_bytes + base + (slot % rows_per_page)·row_bytes``."""

    name: str
    row_bytes: int
    page_bytes: int
    rows_per_page: int
    base: int = 0

    @property
    def flat(self) -> bool:
        """Rows of consecutive pages are adjacent: runs may cross page boundaries."""
        return self.page_bytes == self.rows_per_page * self.row_bytes and self.base == 0

    def offsets(self, slots: np.ndarray) -> np.ndarray:
        p, o = slots // self.rows_per_page, slots % self.rows_per_page
        return p * self.page_bytes + self.base + o * self.row_bytes


def mla_regions(layout: KVCacheLayout) -> list[Region]:
    """The MLA cache ``[num_blocks, bs, row]``: one flat region."""
    row = layout.mla_bytes_per_token
    return [Region("mla", row, row * layout.block_size, layout.block_size)]


def indexer_regions(layout: KVCacheLayout) -> list[Region]:
    """The indexer cache: FP8 pages hold all values, then all fp32 scales; bf16 is flat."""
    bs, d = layout.block_size, layout.index_head_dim
    if not layout.is_fp8:
        row = layout.indexer_bytes_per_token
        return [Region("indexer", row, row * bs, bs)]
    page = bs * (d + 4)
    return [Region("indexer_k", d, page, bs), Region("indexer_scale", 4, page, bs, base=bs * d)]


@dataclass
class ByteRuns:
    """Byte ranges relative to each tensor's start: [src, src + n) -> [dst, dst + n)."""

    src: np.ndarray  # [R] int64
    dst: np.ndarray  # [R] int64
    length: np.ndarray  # [R] int64

    @property
    def num_bytes(self) -> int:
        return int(self.length.sum())


def byte_runs(runs: SlotRuns, region: Region) -> ByteRuns:
    """Lower slot runs to byte runs of one region (cut at page boundaries unless flat)."""
    if not region.flat and len(runs):
        # expand to rows and re-merge with page cuts: exact, and O(rows) like the plan itself
        idx = np.repeat(np.arange(len(runs)), runs.length)
        k = np.arange(len(idx)) - np.repeat(np.cumsum(runs.length) - runs.length, runs.length)
        runs = merge_runs(runs.src[idx] + k, runs.dst[idx] + k, page=region.rows_per_page)
    n = runs.length * region.row_bytes
    return ByteRuns(region.offsets(runs.src), region.offsets(runs.dst), n)


def cache_byte_runs(runs: SlotRuns, regions: list[Region]) -> ByteRuns:
    """Byte runs of one cache tensor made of ``regions``. A split page (FP8 indexer: values,
    then scales) moves whole pages as one run where a slot run covers pages aligned on both
    sides (the common M = N case: two descriptors per page become one per run of pages); the
    partial pages at a run's ends go region by region."""
    if len(regions) == 1:
        return byte_runs(runs, regions[0])
    bs, page = regions[0].rows_per_page, regions[0].page_bytes
    aligned = (runs.src - runs.dst) % bs == 0
    head = np.where(aligned, np.minimum((-runs.src) % bs, runs.length), runs.length)
    full = np.where(aligned, (runs.length - head) // bs, 0)
    tail = runs.length - head - full * bs
    whole = full > 0
    pages = ByteRuns(
        (runs.src[whole] + head[whole]) // bs * page,
        (runs.dst[whole] + head[whole]) // bs * page,
        full[whole] * page,
    )
    end = head + full * bs
    rest = SlotRuns(
        np.concatenate([runs.src, runs.src + end]),
        np.concatenate([runs.dst, runs.dst + end]),
        np.concatenate([head, tail]),
    )
    keep = rest.length > 0
    rest = SlotRuns(rest.src[keep], rest.dst[keep], rest.length[keep])
    parts = [pages] + [byte_runs(rest, r) for r in regions]
    return ByteRuns(
        *(np.concatenate([getattr(p, f) for p in parts]) for f in ("src", "dst", "length"))
    )


# ---- staging: source-contiguous reads, scattered locally ------------------------------------------
@dataclass
class StagedRows:
    """A read's rows in source-slot order: staged row r comes from source slot ``src[r]`` and
    belongs at destination slot ``dst[r]``."""

    src: np.ndarray  # [rows] int64, ascending
    dst: np.ndarray  # [rows] int64

    def __len__(self) -> int:
        return len(self.src)


def staged_rows(runs: SlotRuns) -> StagedRows:
    """Expand slot runs (as ``merge_runs`` makes them: sorted by source slot) to rows."""
    idx = np.repeat(np.arange(len(runs)), runs.length)
    k = np.arange(len(idx)) - np.repeat(np.cumsum(runs.length) - runs.length, runs.length)
    src, dst = runs.src[idx] + k, runs.dst[idx] + k
    order = np.argsort(src, kind="stable")  # a no-op for merge_runs' runs
    return StagedRows(src[order], dst[order])


def source_runs(src: np.ndarray, first_row: int = 0) -> SlotRuns:
    """Maximal runs of consecutive source slots of ascending ``src``; ``dst`` is the staged row
    (``first_row`` + index) where each run starts: staged rows are packed in source order."""
    if len(src) == 0:
        z = np.zeros(0, dtype=np.int64)
        return SlotRuns(z, z.copy(), z.copy())
    starts = np.concatenate([[0], np.nonzero(np.diff(src) != 1)[0] + 1])
    lengths = np.diff(np.concatenate([starts, [len(src)]]))
    return SlotRuns(src[starts], starts + first_row, lengths.astype(np.int64))


def staged_byte_runs(runs: SlotRuns, region: Region) -> ByteRuns:
    """Byte runs from a region of the source cache into a packed staging area of that region
    (staged row r at ``r·row_bytes``); ``runs.dst`` are staged rows. Cut at source pages unless
    the region is flat (the staging side is always flat)."""
    if not region.flat and len(runs):
        rpp = region.rows_per_page
        first = runs.src // rpp
        pieces = (runs.src + runs.length - 1) // rpp - first + 1
        idx = np.repeat(np.arange(len(runs)), pieces)
        k = np.arange(len(idx)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        lo = np.maximum(runs.src[idx], (first[idx] + k) * rpp)
        hi = np.minimum(runs.src[idx] + runs.length[idx], (first[idx] + k + 1) * rpp)
        runs = SlotRuns(lo, runs.dst[idx] + lo - runs.src[idx], hi - lo)
    return ByteRuns(
        region.offsets(runs.src), runs.dst * region.row_bytes, runs.length * region.row_bytes
    )
