"""Unit tests of the PCP sharder, DCP ownership/slot formulas, and the LSE combine."""

from __future__ import annotations

import numpy as np
import torch

from vllm.attention.metadata import CPMetadata, MLAMetadata
from vllm.config import ParallelConfig
from vllm.config.arch import ModelArch
from vllm.distributed.cp_attention import local_len, local_to_global
from vllm.distributed.groups import group_ranks
from vllm.distributed.pcp_manager import shard_tokens, v_chunks
from vllm.kernels.merge_attn import merge_attn_states_ref
from vllm.kernels.sparse_mla import sparse_mla_attend_ref
from vllm.kv_cache_interface import KVCacheLayout


def test_v_chunks_pair_cheap_with_expensive():
    assert v_chunks(16, 2) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert v_chunks(3, 2) == [
        (0, 1),
        (1, 2),
        (2, 3),
        (3, 3),
    ]  # shorter than 2N: an empty tail chunk
    assert v_chunks(10, 2) == [(0, 3), (3, 6), (6, 9), (9, 10)]  # not divisible


def test_shard_tokens_v_pattern_decode_round_robin_and_restore():
    # batch: prefill of 10 tokens, decode, decode, prefill of 3
    qsl = np.array([0, 10, 11, 12, 15])
    sh = shard_tokens(qsl, np.array([True, False, False, True]), 2)
    # rank 0: chunks 0 and 3 of the 10-token prompt, the first decode, chunk 0 (+ empty chunk 3) of the 3-token one
    assert sh.per_rank[0].tolist() == [0, 1, 2, 9, 10, 12]
    assert sh.per_rank[1].tolist() == [3, 4, 5, 6, 7, 8, 11, 13, 14]
    assert sh.per_rank_counts.tolist() == [[4, 1, 0, 1], [6, 0, 1, 2]]
    assert sh.pad == 9 and (sh.gathered == -1).sum() == 3
    assert np.array_equal(
        sh.gathered[sh.restore], np.arange(15)
    )  # restore puts tokens back in order


def test_causal_work_is_balanced():
    n, pcp = 4096, 8
    sh = shard_tokens(np.array([0, n]), np.array([True]), pcp)
    work = [int((p + 1).sum()) for p in sh.per_rank]  # attention cost ~ position + 1
    assert max(work) / min(work) < 1.01


def test_dcp_ownership_slots_and_local_len():
    arch = ModelArch.from_dict(
        __import__("vllm.model_executor.tiny", fromlist=["TINY_CONFIG"]).TINY_CONFIG
    )
    layout = KVCacheLayout.from_arch(arch, "auto", torch.float32)
    n, i, s = 4, 2, 1000
    pos = torch.arange(s)
    seen = torch.zeros(s, dtype=torch.int64)
    for rank in range(n):
        meta = MLAMetadata(
            layout,
            32,
            pos,
            torch.zeros(s, dtype=torch.long),
            [0, s],
            torch.tensor([s]),
            [s],
            torch.arange(4, dtype=torch.int32).view(1, 4) + 10,
            [True],
            [False],
            torch.empty(0),
            cp=CPMetadata(dcp_size=n, dcp_rank=rank, interleave=i),
        )
        slots = meta.slots_for(torch.zeros(s, dtype=torch.long), pos)
        mine = slots >= 0
        assert torch.equal(mine, (pos // i) % n == rank)  # token p lives on rank (p // I) % N
        seen += mine
        j = torch.arange(int(mine.sum()))
        assert int(mine.sum()) == local_len(s, n, i, rank)
        assert torch.equal(local_to_global(j, n, i, rank), pos[mine])  # packed local order
        # local index j sits at block_table[j // 64]·64 + j % 64
        assert torch.equal(slots[mine], (10 + j // 64) * 64 + j % 64)
    assert torch.equal(seen, torch.ones(s, dtype=torch.int64))


def test_lse_merge_exact_with_empty_and_dominant_shards():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 16, generator=g)
    kv = torch.randn(3, 12, 16, generator=g)
    kv[:, 5] *= 30  # one dominant row
    full, lse_full = sparse_mla_attend_ref(q, kv, torch.ones(3, 12, dtype=torch.bool), 0.3, 8)
    owner = torch.tensor([0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2])  # rank 3 owns nothing
    outs, lses = [], []
    for r in range(4):
        o, lse = sparse_mla_attend_ref(q, kv, (owner == r).expand(3, 12), 0.3, 8)
        outs.append(o)
        lses.append(lse)
    assert torch.isinf(lses[3]).all() and outs[3].eq(0).all() and not torch.isnan(outs[3]).any()
    out, lse = merge_attn_states_ref(torch.stack(outs), torch.stack(lses))
    assert torch.allclose(out, full, atol=1e-5) and torch.allclose(lse, lse_full, atol=1e-5)
    empty_out, empty_lse = merge_attn_states_ref(
        torch.zeros(2, 3, 4, 8), torch.full((2, 3, 4), float("-inf"))
    )
    assert empty_out.eq(0).all() and torch.isinf(empty_lse).all()


def test_rank_layout_tp_fastest():
    g = group_ranks(
        ParallelConfig(
            tensor_parallel_size=2,
            prefill_context_parallel_size=2,
            data_parallel_size=2,
            decode_context_parallel_size=4,
            enable_expert_parallel=True,
        )
    )
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["pcp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dcp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["ep"] == [list(range(8))]
