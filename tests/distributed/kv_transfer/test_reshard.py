"""The resharding planner, exhaustively on CPU: source caches written by the engine's own write
path at the engine's slots (PCP × TP × DCP with interleave), the plan applied with plain byte
copies, compared bit for bit with the destination layout written directly from the same logical
rows (MLA rows, FP8 indexer values and scales, bf16 caches), and the bytes moved counted. The
staged path (source-contiguous runs into packed staging areas, scattered locally) is held to the
same layouts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tests.distributed.kv_transfer.kv_helpers import (
    SMALL_BF16,
    SMALL_FP8,
    LogicalKV,
    apply_plan,
    block_ids_for,
    empty_caches,
    engine_slots,
)
from vllm.distributed.kv_transfer.reshard import (
    KVShardLayout,
    Region,
    byte_runs,
    cache_byte_runs,
    indexer_regions,
    merge_runs,
    plan_reads,
    source_runs,
    staged_byte_runs,
    staged_rows,
)

# (world = PCP × TP, DCP, interleave); (2, 2, 1) is PCP2 × DCP2, (4, 2, 1) PCP2 × TP2 × DCP2
# (two copies of each shard), (2, 1, 1) PCP2 × DCP1 (two full copies)
SOURCES = [(1, 1, 1), (2, 2, 1), (4, 2, 1), (4, 4, 1), (2, 2, 4), (4, 4, 2), (2, 1, 1)]
DESTS = [(1, 1, 1), (2, 2, 1), (3, 3, 1), (4, 4, 1), (2, 2, 8), (2, 1, 1), (4, 2, 2)]
LENGTHS = [1, 63, 64, 129, 333]
NUM_LAYERS = 2  # layer 0 with an indexer, layer 1 without


@pytest.mark.parametrize("shard", SOURCES + DESTS)
def test_slot_formula_matches_engine(shard):
    """KVShardLayout.slots / owner are the engine's MLAMetadata.slots_for."""
    lay = KVShardLayout(*shard)
    n = 777
    ids = block_ids_for(lay, n, 64, seed=1)
    pos = np.arange(n)
    for rank in range(lay.world_size):
        eng = engine_slots(lay, rank, ids[0], torch.from_numpy(pos)).numpy()
        mine = lay.owner(pos) == lay.dcp_rank(rank)
        assert ((eng >= 0) == mine).all()
        np.testing.assert_array_equal(eng[mine], lay.slots(pos[mine], ids[0]))


def _check(kv_layout, src, dst, length, lo, shuffle, seed, **staging):
    logical = LogicalKV(kv_layout, length, NUM_LAYERS, seed)
    pool = 48
    src_ids = block_ids_for(src, length, pool, seed, shuffle)
    dst_ids = block_ids_for(dst, length, pool, seed + 1, shuffle)
    src_caches = [
        logical.caches(src, k, src_ids[0], pool + 2) for k in range(src.world_size)
    ]  # every source rank: its shard of the whole request
    bytes_per_row = kv_layout.mla_bytes_per_token * NUM_LAYERS + kv_layout.indexer_bytes_per_token
    for d in range(dst.world_size):
        got = empty_caches(kv_layout, NUM_LAYERS, pool + 2)
        moved, _ = apply_plan(
            kv_layout, src, src_ids, src_caches, dst, dst_ids, d, got, lo, length, **staging
        )
        want = logical.caches(dst, d, dst_ids[0], pool + 2, lo, length)
        for (gm, gi), (wm, wi) in zip(got, want, strict=True):
            assert torch.equal(gm, wm)
            assert (gi is None) == (wi is None)
            if gi is not None:
                assert torch.equal(gi, wi)
        owned = int((dst.owner(np.arange(lo, length)) == dst.dcp_rank(d)).sum())
        assert moved == owned * bytes_per_row  # only the rows this rank owns cross


@pytest.mark.parametrize("src,dst", list(itertools.product(SOURCES, DESTS)))
def test_reshard_parity_fp8(src, dst):
    src, dst = KVShardLayout(*src), KVShardLayout(*dst)
    for k, length in enumerate(LENGTHS):
        lo = 0 if k % 2 == 0 else length // 3
        _check(SMALL_FP8, src, dst, length, lo, shuffle=k != 2, seed=k)


@pytest.mark.parametrize("src,dst", [((2, 2, 1), (1, 1, 1)), ((4, 2, 1), (3, 3, 1))])
def test_reshard_parity_bf16(src, dst):
    for k, length in enumerate((65, 200)):
        _check(SMALL_BF16, KVShardLayout(*src), KVShardLayout(*dst), length, 0, k == 0, seed=k)


# short runs: DCP2 I1 -> DCP1 (single rows, 64-row source runs), DCP1 -> DCP2 I1 (single rows on
# both sides), PCP2 × TP2 × DCP2 I2 -> DCP1, and a few others
STAGED = [
    ((2, 2, 1), (1, 1, 1)),
    ((1, 1, 1), (2, 2, 1)),
    ((4, 2, 2), (1, 1, 1)),
    ((4, 4, 1), (3, 3, 1)),
    ((2, 2, 4), (4, 2, 2)),
    ((1, 1, 1), (1, 1, 1)),
]


@pytest.mark.parametrize("kv_layout", [SMALL_FP8, SMALL_BF16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("src,dst", STAGED)
def test_staged_parity(src, dst, kv_layout):
    """Staged reads land the same bytes as direct ones; chunks (50 rows: pages split across
    chunks) change nothing; still only the owned rows cross."""
    src, dst = KVShardLayout(*src), KVShardLayout(*dst)
    for k, (length, lo, chunk) in enumerate([(129, 0, None), (333, 100, 50), (64, 0, 7)]):
        _check(kv_layout, src, dst, length, lo, k != 2, k, staged=True, chunk_rows=chunk)


def test_staged_runs_are_source_contiguous():
    """DCP2 I1 -> DCP1: single-row direct runs; staged, one run per source block (or run of
    consecutive blocks), the FP8 indexer cut per page and region."""
    src, dst = KVShardLayout(2, 2, 1), KVShardLayout(1, 1, 1)
    (r0, r1) = plan_reads(src, [[3, 4, 9]] * 2, dst, [[0, 1, 2, 5, 6, 7]], 0, 0, 6 * 64)
    assert r0.runs.length.tolist() == [1] * 192
    rows = staged_rows(r0.runs)
    np.testing.assert_array_equal(rows.src, np.r_[3 * 64 : 5 * 64, 9 * 64 : 10 * 64])
    runs = source_runs(rows.src, first_row=10)
    assert (runs.src.tolist(), runs.dst.tolist(), runs.length.tolist()) == (
        [3 * 64, 9 * 64],
        [10, 138],
        [128, 64],
    )
    k, scale = indexer_regions(SMALL_FP8)
    page = 64 * SMALL_FP8.indexer_bytes_per_token
    br = staged_byte_runs(runs, k)  # values: cut at the page boundary 4·64
    assert br.src.tolist() == [3 * page, 4 * page, 9 * page]
    assert br.dst.tolist() == [10 * 32, 74 * 32, 138 * 32]
    assert br.length.tolist() == [64 * 32] * 3
    br = staged_byte_runs(runs, scale)
    assert br.src.tolist() == [3 * page + 64 * 32, 4 * page + 64 * 32, 9 * page + 64 * 32]
    assert br.length.tolist() == [64 * 4] * 3


def test_equal_layouts_read_whole_blocks():
    """M = N with the same interleave: one run per block (per run of consecutive blocks)."""
    lay = KVShardLayout(2, 2, 1)
    ids = [[5, 9, 2, 3]] * 2
    reads = plan_reads(lay, ids, lay, [[7, 8, 1, 0]] * 2, 1, 0, 4 * 128)
    (rr,) = reads
    assert rr.src_rank == 1
    # source blocks 2,3 are consecutive but destination 1,0 are not: 4 runs of 64 rows
    assert rr.runs.length.tolist() == [64] * 4
    consecutive = plan_reads(lay, [[4, 5, 6, 7]] * 2, lay, [[0, 1, 2, 3]] * 2, 0, 0, 512)
    assert [len(r.runs) for r in consecutive] == [1]


def test_replicas_spread_reads():
    """PCP2 × TP2 × DCP2 keeps two copies: destination ranks read from different copies."""
    src, dst = KVShardLayout(4, 2, 1), KVShardLayout(2, 1, 1)
    ids = [[0, 1]] * 2
    r0 = {rr.src_rank for rr in plan_reads(src, ids, dst, [[0, 1, 2, 3]], 0, 0, 200)}
    r1 = {rr.src_rank for rr in plan_reads(src, ids, dst, [[0, 1, 2, 3]], 1, 0, 200)}
    assert r0 == {0, 1} and r1 == {2, 3}


def test_fp8_indexer_runs_cut_at_pages():
    region = Region("indexer_k", 32, 64 * 36, 64)
    runs = merge_runs(np.arange(60, 140), np.arange(0, 80))
    assert len(runs) == 1
    br = byte_runs(runs, region)
    page = 64 * 36  # cut where either side enters a new page: source 64, 128; destination 64
    assert br.length.tolist() == [4 * 32, 60 * 32, 4 * 32, 12 * 32]
    assert br.src.tolist() == [60 * 32, page, page + 60 * 32, 2 * page]
    assert br.dst.tolist() == [0, 4 * 32, page, page + 4 * 32]


def test_fp8_indexer_whole_pages_move_as_one_run():
    """Aligned full pages move values and scales together; partial pages region by region."""
    regions = indexer_regions(SMALL_FP8)
    page = 64 * SMALL_FP8.indexer_bytes_per_token
    runs = merge_runs(np.arange(64, 64 * 4), np.arange(128, 128 + 64 * 3))
    br = cache_byte_runs(runs, regions)
    assert (br.src.tolist(), br.dst.tolist(), br.length.tolist()) == (
        [page],
        [2 * page],
        [3 * page],
    )
    # 10 rows of head, 2 pages, 5 rows of tail: 1 page run + 2 partial pages x 2 regions
    runs = merge_runs(np.arange(54, 64 * 3 + 5), np.arange(118, 64 * 4 + 5))
    br = cache_byte_runs(runs, regions)
    assert len(br.length) == 5 and br.num_bytes == runs.num_rows * (page // 64)
    # page phases differ: no whole-page run
    runs = merge_runs(np.arange(0, 128), np.arange(1, 129))
    assert cache_byte_runs(runs, regions).num_bytes == 128 * (page // 64)


def test_bad_layouts_refused():
    with pytest.raises(ValueError, match="must divide world size"):
        KVShardLayout(3, 2)
    with pytest.raises(ValueError, match="must divide the block size"):
        KVShardLayout(2, 2, 3)
    with pytest.raises(ValueError, match="do not cover"):
        plan_reads(KVShardLayout(), [[0]], KVShardLayout(), [[0]], 0, 0, 65)
