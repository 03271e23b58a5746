"""Piecewise CUDA graphs (`worker/gpu/piecewise.py`) against the eager forward. On CPU the pieces
run uncaptured on the same static buffers, with the same padding to the captured token count and
the same eager attention between pieces, so prompt chunks of every length, mixed steps, prefix
hits, preemption, FP8 weights and HiSparse are checked here; tests/worker/test_cudagraph_gpu.py
replays real graphs on CUDA (parallel layouts: tests/distributed/test_cp_parity.py's graph
configurations, which take these graphs for their prompt chunks)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm import LLM, SamplingParams

# chunks of every length from 1 to the 64-token budget: padded to 16, 32 or 64 tokens
PROMPTS = [list(range(7 + 3 * i, 7 + 3 * i + n)) for i, n in enumerate((5, 40, 70, 130, 33, 9, 1))]
MAX_TOKENS = [3, 30, 9, 17, 24, 5, 12]
# on CPU on every machine: exact equality needs the same arithmetic as the eager forward (on
# CUDA a padded GEMM rounds otherwise: tests/worker/test_cudagraph_gpu.py, up to near-ties)
KW = dict(max_num_batched_tokens=64, max_num_seqs=8, device="cpu")


def _run(m: LLM):
    params = [
        SamplingParams(
            temperature=0.8 if i % 2 else 0.0,
            seed=100 + i,
            max_tokens=n,
            ignore_eos=True,
            logprobs=2 if i == 1 else None,
            prompt_logprobs=1 if i == 3 else None,
        )
        for i, n in enumerate(MAX_TOKENS)
    ]
    outs = m.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    toks = [o.outputs[0].token_ids for o in outs]
    lps = [{t: d[t].logprob for t in d} for d in outs[1].outputs[0].logprobs]
    plp = [next(iter(d.values())).logprob for d in outs[3].prompt_logprobs[1:]]
    return toks, lps, plp


def _steps(m: LLM, field: str, since: int = 0) -> int:
    return sum(getattr(s, field) for s in m.stats_history[since:])


def _same(got, ref):
    assert got[0] == ref[0]
    for g, r in zip(got[1], ref[1], strict=True):
        assert g.keys() == r.keys()
        np.testing.assert_allclose([g[t] for t in r], list(r.values()), atol=1e-4)
    np.testing.assert_allclose(got[2], ref[2], atol=1e-4)


@pytest.fixture(scope="module")
def eager(tiny_ckpt):
    m = LLM(tiny_ckpt, enforce_eager=True, **KW)  # graphs are the default on CUDA
    yield m
    m.shutdown()


# index_topk past every context here: each chunk takes the dense prefill (sparse ones:
# test_sparse_prefill_through_the_pieces)
DENSE = dict(KW, hf_overrides={"index_topk": 256})


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_piecewise_equals_eager(tiny_ckpt, mode):
    """Prompt chunks of 1–64 tokens (padding changes every step), mixed steps, greedy and seeded
    sampled rows, logprobs and prompt logprobs (every position's hidden state), then the same
    prompts again with their blocks cached. PIECEWISE alone also runs every decode step through
    the pieces; FULL_AND_PIECEWISE replays full graphs for decode steps and the pieces for the
    prompt chunks (mixed steps split into both: tests/worker/test_cudagraph.py, whose graph
    engine takes the pieces too)."""
    eager = LLM(tiny_ckpt, enforce_eager=True, **DENSE)
    try:
        ref = _run(eager)
        assert _steps(eager, "num_piecewise_steps") == 0
    finally:
        eager.shutdown()
    cc = {"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4, 8]}
    m = LLM(tiny_ckpt, compilation_config=cc, **DENSE)
    try:
        _same(_run(m), ref)
        pw, full = _steps(m, "num_piecewise_steps"), _steps(m, "num_cudagraph_steps")
        steps = len(m.stats_history)
        if mode == "PIECEWISE":
            assert full == 0 and pw >= steps - 2  # the stats of the last steps' flush
        else:
            assert full >= 10 and pw >= 5
        since = len(m.stats_history)
        _same(_run(m), ref)  # prefix hits: chunks start past cached blocks
        assert _steps(m, "num_piecewise_steps", since) > 0
    finally:
        m.shutdown()


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_sparse_prefill_through_the_pieces(tiny_ckpt, eager, mode):
    """index_topk 32: most chunks here have more context and take the sparse prefill (its
    attention eager between the pieces, split-K partials and merges included); same results as
    eager, every step through the pieces (PIECEWISE) or the prompt chunks through them and
    decode steps through full graphs."""
    cc = {"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4, 8]}
    m = LLM(tiny_ckpt, compilation_config=cc, **KW)
    try:
        _same(_run(m), _run(eager))
        pw, full = _steps(m, "num_piecewise_steps"), _steps(m, "num_cudagraph_steps")
        steps = len(m.stats_history)
        if mode == "PIECEWISE":
            assert full == 0 and pw >= steps - 2  # the stats of the last steps' flush
        else:
            assert full >= 10 and pw >= 5
    finally:
        m.shutdown()


def test_chunks_past_the_largest_size_run_eagerly(tiny_ckpt, eager):
    """With pieces captured at 16 tokens only, 64-token chunks run the eager forward and short
    ones the pieces, in the same engine, with the same results."""
    cc = {"cudagraph_mode": "PIECEWISE", "piecewise_capture_sizes": [16]}
    m = LLM(tiny_ckpt, compilation_config=cc, **KW)
    try:
        _same(_run(m), _run(eager))
        pw, steps = _steps(m, "num_piecewise_steps"), len(m.stats_history)
        assert 0 < pw < steps
    finally:
        m.shutdown()


def test_piecewise_under_preemption(tiny_ckpt, eager):
    """A KV budget too small for the batch: recomputed prompts go through the pieces again."""
    from vllm.kv_cache_interface import kv_bytes_per_token

    mc = eager.config.model_config
    per_block = 64 * kv_bytes_per_token(mc.arch, "auto", mc.dtype, num_mtp_layers=0)
    m = LLM(
        tiny_ckpt,
        kv_cache_memory_bytes=7 * per_block,
        max_num_batched_tokens=64,
        compilation_config={"cudagraph_mode": "PIECEWISE"},
    )
    try:
        got = _run(m)
        assert _steps(m, "num_preemptions") > 0 and _steps(m, "num_piecewise_steps") > 0
    finally:
        m.shutdown()
    assert got[0] == _run(eager)[0]


def test_fp8_weights_and_cache(tiny_ckpt_fp8):
    """FP8 linears and experts inside the pieces, the FP8 cache written by the eager attention."""
    kw = dict(KW, kv_cache_dtype="fp8_ds_mla")
    ref = LLM(tiny_ckpt_fp8, enforce_eager=True, **kw)
    try:
        want = _run(ref)[0]
    finally:
        ref.shutdown()
    m = LLM(tiny_ckpt_fp8, compilation_config={"cudagraph_mode": "PIECEWISE"}, **kw)
    try:
        assert _run(m)[0] == want
        assert _steps(m, "num_piecewise_steps") > 0
    finally:
        m.shutdown()


def test_hisparse_with_pieces(tiny_ckpt):
    """HiSparse's KV access (host pool, hot set) lives in the attention, which runs eagerly
    between the pieces: same tokens as HiSparse without graphs."""
    kw = dict(
        KW,
        attention_config={"hisparse_config": {"host_pool_gib": 0.05}},
        num_gpu_blocks_override=14,
    )
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def run(**extra):
        m = LLM(tiny_ckpt, **kw, **extra)
        try:
            toks = [o.outputs[0].token_ids for o in m.generate(prompts, sp)]
            return toks, _steps(m, "num_piecewise_steps")
        finally:
            m.shutdown()

    ref, none = run(enforce_eager=True)
    # PIECEWISE: the decode steps (sparse, through the hot set) take the pieces too
    got, pw = run(compilation_config={"cudagraph_mode": "PIECEWISE"})
    assert none == 0 and pw > 0
    assert got == ref


def test_pieces_compute_the_rotary_angles_once_a_step(tiny_ckpt, monkeypatch):
    """Piece 0 writes the positions' (cos, sin) for every layer's piece: one computation per
    forward through the pieces (as the eager forward), not one per layer; the pieces' outputs
    are those of pieces that compute their own."""
    from types import SimpleNamespace

    import torch

    from vllm.model_executor.model_loader import build_model
    from vllm.model_executor.models import glm_moe_dsa
    from vllm.worker.gpu.piecewise import PiecewiseGraphs, TargetStack

    model = build_model(tiny_ckpt, device=torch.device("cpu"))
    pg = PiecewiseGraphs(SimpleNamespace(device=torch.device("cpu")), (4, 8), TargetStack(model))
    assert pg.rope is not None and pg.num_layers > 1
    calls = []
    real = glm_moe_dsa.rope_cos_sin
    monkeypatch.setattr(glm_moe_dsa, "rope_cos_sin", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(0)
    pg.inputs["ids"][:8] = torch.randint(0, 400, (8,), generator=g)
    pg.positions[:8] = torch.randint(0, 2000, (8,), generator=g)

    def forward(rope):
        pg.rope = rope
        outs = []
        with torch.inference_mode():
            for i in range(pg.num_layers + 1):
                pg.out.copy_(torch.randn(pg.out.shape, generator=torch.Generator().manual_seed(i)))
                pg._piece(i, 8)
                outs += [pg.hidden.clone()] + [b.clone() for b in pg.bufs.values()]
        return outs

    shared = forward(pg.rope)
    assert len(calls) == 1
    calls.clear()
    own = forward(None)
    assert len(calls) == pg.num_layers
    assert all(torch.equal(a, b) for a, b in zip(shared, own, strict=True))
