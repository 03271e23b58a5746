"""Hybrid HiSparse with MTP speculative decoding, on CPU: greedy tokens (and logprobs within 1e-4)
with 1..3 drafts per step equal HiSparse without drafts and the all-in-HBM run without drafts,
while a 14-block GPU pool drops pages (read back through the hot buffer, which verify rows of
1 + k tokens share) and drafts are rejected (their KV rolled back; pages they completed must not
reach the host pool's prefix cache before their final rows do). A rerun of the same prompts
starts from host-only prefix-cache hits.

The checkpoint is the tiny one with :func:`align_mtp` applied, so drafts are accepted often enough
to exercise acceptance and rejection both (tests/worker/test_spec_decode.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.core.messages import KVCachePlan, KVPageUpdate
from vllm.engine.arg_utils import EngineArgs
from vllm.hisparse.worker import HiSparseWorker
from vllm.kv_cache_interface import KVCacheLayout

engine = pytest.mark.distributed  # starts engine + worker processes

TOKENS = 32
LENGTHS = (900, 300, 120)  # ~1.3K tokens of context against a 896-token GPU pool
HISPARSE = dict(
    attention_config={"hisparse_config": {"host_pool_gib": 0.05}}, num_gpu_blocks_override=14
)
KW = dict(max_num_batched_tokens=256)


def _prompts(salt: int = 0) -> list[list[int]]:
    return [[(7 * i + 3 * j + salt) % 1000 + 3 for i in range(n)] for j, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def aligned_ckpt(tmp_path_factory) -> str:
    from vllm.model_executor.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(
        str(tmp_path_factory.mktemp("aligned") / "tiny-mtp"), mtp_aligned=True
    )


def _run(m: LLM, salt: int = 0):
    """(greedy tokens per prompt, logprobs of the first prompt's tokens as {token: logprob})."""
    sp = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=2)
    outs = m.generate([{"prompt_token_ids": p} for p in _prompts(salt)], sp, use_tqdm=False)
    lps = [{t: d[t].logprob for t in d} for d in outs[0].outputs[0].logprobs]
    return [o.outputs[0].token_ids for o in outs], lps


def _assert_same(got, ref):
    assert got[0] == ref[0]
    for g, r in zip(got[1], ref[1], strict=True):
        assert g.keys() == r.keys()
        # fp32 on CPU: HiSparse sums the same rows in another order (hot rows vs in place)
        np.testing.assert_allclose([g[t] for t in r], list(r.values()), atol=1e-4)


def _extra_max(m: LLM, key: str, since: int = 0) -> float:
    return max((s.extra or {}).get(key, 0) for s in m.stats_history[since:])


def _accepted(m: LLM, since: int = 0) -> tuple[int, int]:
    """(draft tokens verified, accepted) over the stats since ``since``."""
    ss = [s.spec_decoding for s in m.stats_history[since:] if s.spec_decoding is not None]
    return sum(s.num_draft_tokens for s in ss), sum(s.num_accepted_tokens for s in ss)


@pytest.fixture(scope="module")
def reference(aligned_ckpt):
    """All in HBM, no drafts: the first run and a second set of prompts."""
    with LLM(aligned_ckpt, **KW) as m:
        return _run(m), _run(m, salt=5)


@engine
def test_hisparse_without_drafts_matches(aligned_ckpt, reference):
    with LLM(aligned_ckpt, **HISPARSE, **KW) as m:
        _assert_same(_run(m), reference[0])
        assert _extra_max(m, "hisparse_pages_dropped_total") > 0


@engine
@pytest.mark.parametrize("k", [1, 2, 3])
def test_outputs_identical_with_drafts(aligned_ckpt, reference, k):
    """Pages dropped and read back through the hot buffer, drafts accepted and rejected; then the
    same prompts again: their prefixes come from the host pool's prefix cache (host-only)."""
    spec = {"method": "mtp", "num_speculative_tokens": k}
    with LLM(aligned_ckpt, speculative_config=spec, **HISPARSE, **KW) as m:
        _assert_same(_run(m), reference[0])
        drafted, accepted = _accepted(m)
        assert 0 < accepted < drafted  # rollback exercised too
        assert _extra_max(m, "hisparse_pages_dropped_total") > 0
        assert _extra_max(m, "hisparse_h2d_bytes_per_step") > 0  # rows came from the host pool
        assert sum(s.num_preemptions for s in m.stats_history) == 0
        n = len(m.stats_history)
        _assert_same(_run(m), reference[0])
        assert sum(s.prefix_cache_hits for s in m.stats_history[n:]) > 0


@engine
def test_static_buffer_path_with_drafts(aligned_ckpt, reference):
    """The decode graphs' static path (verify + drafting graph, run uncaptured on CPU): the
    resolver's stamp and the MTP layer's HiSparse metadata built from device tensors."""
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    with LLM(
        aligned_ckpt,
        speculative_config=spec,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16]},  # q = 4: 1, 2, 4
        **HISPARSE,
        **KW,
    ) as m:
        _assert_same(_run(m, salt=5), reference[1])
        assert sum(s.num_cudagraph_steps for s in m.stats_history) >= TOKENS // 4
        assert _accepted(m)[1] > 0
        assert _extra_max(m, "hisparse_h2d_bytes_per_step") > 0


def test_config(tiny_ckpt):
    """The combination starts with a hot buffer of (k + 2) × topk rows; one below
    (k + 1) × topk is refused, naming the flag."""
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    hs = {"hisparse_config": {"host_pool_gib": 0.05}}
    cfg = EngineArgs(
        model=tiny_ckpt, speculative_config=spec, attention_config=hs
    ).create_engine_config()
    topk = cfg.model_config.arch.index_topk
    assert cfg.hot_buffer_rows == 4 * topk and cfg.hot_buffer_min_rows == 3 * topk
    small = {"hisparse_config": {"host_pool_gib": 0.05, "hot_buffer_rows": 3 * topk - 1}}
    with pytest.raises(ValueError, match=r"hisparse_config\.hot_buffer_rows must be >= 96"):
        EngineArgs(
            model=tiny_ckpt, speculative_config=spec, attention_config=small
        ).create_engine_config()
    ok = {"hisparse_config": {"host_pool_gib": 0.05, "hot_buffer_rows": 3 * topk}}
    cfg = EngineArgs(
        model=tiny_ckpt, speculative_config=spec, attention_config=ok
    ).create_engine_config()
    assert cfg.hot_buffer_rows == 3 * topk


# ---- page backups over committed positions ---------------------------------------------------
class _Layer:
    def __init__(self, has_indexer: bool):
        self.has_indexer = has_indexer

    def bind_kv(self, kv_cache, indexer_cache, kv_access) -> None:
        self.kv_cache, self.indexer_cache = kv_cache, indexer_cache


def _write(hs: HiSparseWorker, slot: int, lo: int, hi: int, value: float) -> None:
    """Positions [lo, hi) of request ``slot`` written in every layer (MLA rows, indexer keys)."""
    bs = hs.layout.block_size
    for p in range(lo, hi):
        blk, iblk = int(hs.block_table[slot, p // bs]), int(hs.idx_table[slot, p // bs])
        for attn in hs.layers:
            attn.kv_cache[blk, p % bs] = value + p
            if attn.has_indexer:
                attn.indexer_cache[iblk, p % bs] = value + p


def _step(hs, start, seq_lens, num_drafts, accepted) -> None:
    sample_rows = np.nonzero(np.asarray(num_drafts) > 0)[0]
    inp = SimpleNamespace(
        idx_np=np.arange(len(start)),
        start=np.array(start),
        seq_lens=np.array(seq_lens),
        num_drafts=np.array(num_drafts),
        sample_rows=sample_rows,
    )
    hs.after_step(inp, torch.tensor(accepted))


def _host_page(hs: HiSparseWorker, layer: int, slot: int, page: int) -> torch.Tensor:
    return hs.host_mla[layer][int(hs.host_np[slot, page])]


def test_backups_hold_committed_pages_only():
    """Request 0 verifies 3 drafts at positions 62..65: they complete its page 0, but all are
    rejected, so the page waits; the next step rewrites 63.. and accepts: now the page is
    backed up, with the rewritten rows. Request 1, a prefill chunk in the same steps, backs up
    its completed pages at once."""
    layout = KVCacheLayout("auto", torch.float32, kv_lora_rank=8, rope_dim=4, index_head_dim=4)
    layers = [_Layer(True), _Layer(False)]  # a full layer and one sharing its top-k
    block_table = torch.full((2, 4), -1, dtype=torch.int32)
    hs = HiSparseWorker(layers, layout, block_table, 4, 64, 1.0, torch.device("cpu"))
    hs.allocate(KVCachePlan(num_blocks=6, num_host_blocks=6, num_idx_blocks=6), None)
    block_table[0, :2] = torch.tensor([4, 2], dtype=torch.int32)
    block_table[1, :3] = torch.tensor([0, 1, 3], dtype=torch.int32)
    hs.add_request(0, SimpleNamespace(kv_update=KVPageUpdate(host=[3, 1], idx=[0, 2])))
    hs.add_request(1, SimpleNamespace(kv_update=KVPageUpdate(host=[0, 2, 5], idx=[1, 3, 4])))

    _write(hs, 0, 0, 66, 1000.0)  # request 0: its prompt earlier, the verify row now
    _write(hs, 1, 0, 100, 5000.0)
    _step(hs, start=[62, 0], seq_lens=[66, 100], num_drafts=[3, 0], accepted=[0])
    for layer in range(2):
        assert (_host_page(hs, layer, 0, 0) == 0).all()  # completed only by rejected drafts
        assert torch.equal(_host_page(hs, layer, 1, 0), layers[layer].kv_cache[0])

    _write(hs, 0, 63, 67, 2000.0)  # rewritten from the first rejected draft on
    _write(hs, 1, 100, 130, 5000.0)
    _step(hs, start=[63, 100], seq_lens=[67, 130], num_drafts=[3, 0], accepted=[3])
    for layer in range(2):
        page = _host_page(hs, layer, 0, 0)
        assert torch.equal(page, layers[layer].kv_cache[4])
        assert page[62, 0] == 1062.0 and page[63, 0] == 2063.0  # the final rows
        assert torch.equal(_host_page(hs, layer, 1, 1), layers[layer].kv_cache[1])
        assert (_host_page(hs, layer, 0, 1) == 0).all()  # page 1 is not complete yet
    assert torch.equal(hs.host_idx[0][3], layers[0].indexer_cache[0])
