"""MTP speculative decoding (`--speculative-config`): validation, verification, the sampler's
distribution under drafts, and outputs identical with and without drafts on the tiny checkpoint.

The engine tests use the tiny checkpoint with :func:`align_mtp` applied (the MTP layer predicts
the model's next token from the current one; the context still moves the logits), so drafts are
accepted often enough to exercise acceptance, the bonus token and the KV rollback of rejected
drafts; with random MTP weights almost nothing would be accepted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.config.speculative import SpeculativeConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.worker.gpu.sampler import SamplingBatch, sample
from vllm.worker.gpu.spec_decode.rejection_sample import synthetic_accepted, verify_drafts


# ---- configuration --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, match",
    [
        ('{"method": "eagle", "num_speculative_tokens": 1}', "method"),
        ('{"method": "mtp"}', "num_speculative_tokens"),
        ('{"method": "mtp", "num_speculative_tokens": 4}', "1..3"),
        ('{"method": "mtp", "num_speculative_tokens": 0}', "1..3"),
        ('{"method": "mtp", "num_speculative_tokens": true}', "integer"),
        ('{"method": "mtp", "num_speculative_tokens": 2, "draft_model": "x"}', "unknown keys"),
        ('{"num_speculative_tokens": 3, "synthetic_acceptance_length": 5}', r"\[1, num_spec"),
        ('{"num_speculative_tokens": 3, "synthetic_acceptance_length": "2"}', "a number"),
        ("[1]", "JSON object"),
    ],
)
def test_bad_config_names_the_flag(value, match):
    with pytest.raises(ValueError, match=match) as e:
        SpeculativeConfig.from_json(value)
    assert "--speculative-config" in str(e.value)


def test_config_keys():
    c = SpeculativeConfig.from_json('{"method": "deepseek_mtp", "num_speculative_tokens": 3}')
    assert (c.method, c.num_speculative_tokens, c.synthetic_acceptance_length) == ("mtp", 3, None)
    c = SpeculativeConfig.from_json({"num_speculative_tokens": 2, "synthetic_acceptance_length": 2})
    assert c.synthetic_acceptance_length == 2.0
    assert SpeculativeConfig.from_json(None) is None


def test_unsupported_combinations_are_refused(tiny_ckpt, tmp_path):
    from vllm.model_executor.tiny.checkpoint import TINY_CONFIG, tiny_state_dict, write_checkpoint

    spec = {"method": "mtp", "num_speculative_tokens": 1}
    cfg = EngineArgs(model=tiny_ckpt, speculative_config=spec).create_engine_config()
    assert cfg.num_spec_tokens == 1
    no_mtp = {**TINY_CONFIG, "num_nextn_predict_layers": 0}
    write_checkpoint(str(tmp_path), no_mtp, tiny_state_dict(no_mtp, 0))
    with pytest.raises(ValueError, match="no MTP layer"):
        EngineArgs(model=str(tmp_path), speculative_config=spec).create_engine_config()


# ---- verification ---------------------------------------------------------------------------
def _verify_ref(sampled, first, num_drafts, drafts):
    """Plain loops: accept drafts while they equal the sample at their position."""
    out = []
    for b in range(len(first)):
        a = 0
        while a < num_drafts[b] and sampled[first[b] + a] == drafts[b][a]:
            a += 1
        out.append(a)
    return out


def test_verify_drafts_matches_reference():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        b, k = int(torch.randint(1, 9, (1,), generator=g)), 3
        nd = torch.randint(0, k + 1, (b,), generator=g)
        per = 1 + nd
        first = torch.cumsum(per, 0) - per
        n = int(per.sum())
        sampled = torch.randint(0, 3, (n,), generator=g)  # 3 tokens: many matches
        drafts = torch.randint(0, 3, (b, k), generator=g)
        tokens, acc = verify_drafts(sampled, first, nd, drafts, int(nd.max()))
        assert acc.tolist() == _verify_ref(
            sampled.tolist(), first.tolist(), nd.tolist(), drafts.tolist()
        )
        for i in range(b):  # a row's samples, in order, up to its drafts
            m = int(nd[i]) + 1
            assert tokens[i, :m].tolist() == sampled[first[i] : first[i] + m].tolist()


def test_rejection_sampling_reproduces_the_target_distribution():
    """k = 3 drafts at temperature 1: at each position, the emitted token (when the position is
    reached) follows the target distribution. Drafts are proposals with p ≈ 0.3-0.6, so each
    position is reached often enough. Pearson's chi-square per position against the critical
    value at false-failure rate 1e-4 (df = 5: 25.74); the seeds are fixed, so it is deterministic."""
    v, k, n = 6, 3, 40_000
    g = torch.Generator().manual_seed(1)
    target = torch.randn(k + 1, v, generator=g) * 1.5  # [positions, vocab]
    probs = torch.softmax(target, dim=-1)
    drafts = probs[:k].argmax(dim=-1)  # the likeliest token at each position, as a drafter would
    logits = target.repeat(n, 1)  # request i's rows i·(k+1) .. i·(k+1)+k
    rows = n * (k + 1)
    sb = SamplingBatch(
        temperature=torch.ones(rows),
        top_k=torch.zeros(rows, dtype=torch.int64),
        top_p=torch.ones(rows),
        min_p=torch.zeros(rows),
        seeds=torch.arange(n, dtype=torch.int64).repeat_interleave(k + 1) * 7919 + 13,
        positions=torch.arange(k + 1).repeat(n) + 100,
        all_greedy=False,
        any_top_k=False,
        any_top_p=False,
        any_min_p=False,
        max_logprobs=-1,
    )
    sampled, _ = sample(logits, sb)
    first = torch.arange(n) * (k + 1)
    tokens, acc = verify_drafts(sampled, first, torch.full((n,), k), drafts.repeat(n, 1), k)
    for j in range(k + 1):
        reached = acc >= j  # position j emits a token iff the j drafts before it were accepted
        got = torch.bincount(tokens[reached, j], minlength=v).double()
        m = got.sum()
        assert m > 1000
        expected = probs[j].double() * m
        chi2 = float(((got - expected) ** 2 / expected).sum())
        assert chi2 < 25.74, (j, chi2, got.tolist(), expected.tolist())
    # acceptance at position j is the draft's probability there
    p_acc = (acc.unsqueeze(1) > torch.arange(k)).double().mean(0)
    cond = p_acc / torch.cat([torch.ones(1), p_acc[:-1]])
    np.testing.assert_allclose(cond.numpy(), probs[torch.arange(k), drafts].numpy(), atol=0.02)


def test_synthetic_acceptance_mean():
    nd = torch.full((20_000,), 3)
    g = torch.Generator().manual_seed(0)
    acc = synthetic_accepted(nd, 2.99, g)
    assert acc.min() >= 1 and acc.max() <= 2
    assert abs(float(acc.double().mean()) - 1.99) < 0.01
    assert synthetic_accepted(torch.tensor([0, 1, 3]), 4.0, g).tolist() == [0, 1, 3]


# ---- the engine ------------------------------------------------------------------------------
PROMPTS = [list(range(7 + 3 * i, 7 + 3 * i + n)) for i, n in enumerate((5, 40, 70, 130, 33, 9))]
MAX_TOKENS = [3, 30, 9, 17, 24, 5]
KW = dict(max_num_batched_tokens=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def aligned_ckpt(tmp_path_factory) -> str:
    from vllm.model_executor.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(
        str(tmp_path_factory.mktemp("aligned") / "tiny-mtp"), mtp_aligned=True
    )


def _params(sampled_rows: bool = True):
    return [
        SamplingParams(
            temperature=0.8 if sampled_rows and i % 2 else 0.0,
            top_p=0.9,
            seed=100 + i,
            max_tokens=n,
            ignore_eos=True,
            logprobs=2 if i == 1 else None,
        )
        for i, n in enumerate(MAX_TOKENS)
    ]


def _run(m: LLM, params=None):
    outs = m.generate([{"prompt_token_ids": p} for p in PROMPTS], params or _params())
    lps = outs[1].outputs[0].logprobs
    return [o.outputs[0].token_ids for o in outs], [{t: d[t].logprob for t in d} for d in lps]


def _spec_totals(m: LLM, since: int = 0):
    ss = [s.spec_decoding for s in m.stats_history[since:] if s.spec_decoding is not None]
    per_pos = np.sum([s.num_accepted_tokens_per_pos for s in ss], axis=0)
    return (
        sum(s.num_drafts for s in ss),
        sum(s.num_draft_tokens for s in ss),
        sum(s.num_accepted_tokens for s in ss),
        per_pos.tolist(),
    )


@pytest.fixture(scope="module")
def reference(aligned_ckpt):
    m = LLM(aligned_ckpt, **KW)
    try:
        yield _run(m)
    finally:
        m.shutdown()


def _assert_same(got, ref):
    assert got[0] == ref[0]
    for g, r in zip(got[1], ref[1], strict=True):
        assert g.keys() == r.keys()
        np.testing.assert_allclose([g[t] for t in r], list(r.values()), atol=1e-4)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_outputs_identical_with_drafts(aligned_ckpt, reference, k):
    """Greedy and seeded rows, logprobs, chunked prompts joining decodes, rows finishing at
    different steps; then the same prompts again, hitting the prefix cache."""
    m = LLM(aligned_ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": k}, **KW)
    try:
        _assert_same(_run(m), reference)
        drafts, tokens, accepted, per_pos = _spec_totals(m)
        assert drafts > 0 and 0 < accepted <= tokens <= k * drafts
        assert sum(per_pos) == accepted and len(per_pos) == k
        assert per_pos == sorted(per_pos, reverse=True)  # non-increasing by position
        n = len(m.stats_history)
        _assert_same(_run(m), reference)  # prefix-cache hits this time
        assert sum(s.prefix_cache_hits for s in m.stats_history[n:]) > 0
    finally:
        m.shutdown()


def test_outputs_identical_under_preemption(aligned_ckpt, reference):
    """A KV budget too small for the batch: requests are preempted mid-decode (their drafts are
    dropped with the workers' state) and recomputed."""
    from vllm.kv_cache_interface import kv_bytes_per_token

    cfg = EngineArgs(model=aligned_ckpt).create_engine_config()
    mc = cfg.model_config
    per_block = 64 * kv_bytes_per_token(mc.arch, "auto", mc.dtype, num_mtp_layers=1)
    m = LLM(
        aligned_ckpt,
        speculative_config={"method": "mtp", "num_speculative_tokens": 3},
        kv_cache_memory_bytes=5 * per_block,
        max_num_batched_tokens=64,
    )
    try:
        got = _run(m)
        assert sum(s.num_preemptions for s in m.stats_history) > 0
        assert _spec_totals(m)[2] > 0
    finally:
        m.shutdown()
    _assert_same(got, reference)


def test_position_dependent_sampling_verifies_no_drafts(aligned_ckpt):
    """Penalties change from one drafted position to the next: such requests decode one token
    per step (exactly as without drafts) while the others in the batch verify drafts."""
    params = _params(sampled_rows=False)
    params[2] = SamplingParams(temperature=0, max_tokens=9, repetition_penalty=1.3, ignore_eos=True)
    params[3] = SamplingParams(temperature=0, max_tokens=17, min_tokens=5, ignore_eos=True)
    ref = LLM(aligned_ckpt, **KW)
    try:
        want = _run(ref, params)
    finally:
        ref.shutdown()
    m = LLM(aligned_ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **KW)
    try:
        _assert_same(_run(m, params), want)
        assert _spec_totals(m)[2] > 0
    finally:
        m.shutdown()


def test_synthetic_mode_sets_the_accepted_length(aligned_ckpt):
    spec = {"method": "mtp", "num_speculative_tokens": 3, "synthetic_acceptance_length": 2.5}
    m = LLM(aligned_ckpt, **KW, speculative_config=spec)
    try:
        params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 4
        outs = m.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params)
        assert [len(o.outputs[0].token_ids) for o in outs] == [40] * 4
        drafts, _, accepted, _ = _spec_totals(m)
        assert abs(1 + accepted / drafts - 2.5) < 0.25
    finally:
        m.shutdown()


def test_static_buffer_path_with_drafts(aligned_ckpt, reference):
    """The CUDA-graph path (verify graph + drafting graph; uncaptured on CPU, same static
    buffers and padding): decode steps replay it, and in mixed steps the decode rows replay it
    while the prompt chunks and their drafting pass take the piecewise graphs (the target's and
    the MTP layer's); outputs equal the reference."""
    m = LLM(
        aligned_ckpt,
        speculative_config={"method": "mtp", "num_speculative_tokens": 3},
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]},
        **KW,
    )
    try:
        _assert_same(_run(m), reference)
        assert sum(s.num_cudagraph_steps for s in m.stats_history) >= 5
        assert sum(s.num_cudagraph_split_steps for s in m.stats_history) >= 2
        assert sum(s.num_piecewise_steps for s in m.stats_history) >= 2
        assert _spec_totals(m)[2] > 0
    finally:
        m.shutdown()


def test_piecewise_path_with_drafts(aligned_ckpt, reference):
    """PIECEWISE with MTP3: every verify forward (1 + 3 tokens a row) replays the target's
    pieces and every drafting pass (the first over all step tokens, the chained ones over one
    token a row) the MTP layer's; outputs equal the reference."""
    m = LLM(
        aligned_ckpt,
        speculative_config={"method": "mtp", "num_speculative_tokens": 3},
        compilation_config={"cudagraph_mode": "PIECEWISE"},
        **KW,
    )
    try:
        _assert_same(_run(m), reference)
        assert sum(s.num_cudagraph_steps for s in m.stats_history) == 0
        assert sum(s.num_piecewise_steps for s in m.stats_history) >= 10
        assert _spec_totals(m)[2] > 0
    finally:
        m.shutdown()
