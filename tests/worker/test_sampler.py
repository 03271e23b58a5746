"""Device sampler: filters, seeded reproducibility, logprobs."""

from __future__ import annotations

import pytest
import torch

from vllm.kernels.sampling import uniform_noise
from vllm.worker.gpu.sampler import SamplingBatch, prompt_logprobs, sample


def _sb(b, **kw):
    d = dict(
        temperature=torch.ones(b),
        top_k=torch.zeros(b, dtype=torch.int64),
        top_p=torch.ones(b),
        min_p=torch.zeros(b),
        seeds=torch.arange(b, dtype=torch.int64) * 7919,
        positions=torch.arange(b, dtype=torch.int64),
        all_greedy=False,
        any_top_k=False,
        any_top_p=False,
        any_min_p=False,
        max_logprobs=-1,
    )
    d.update(kw)
    return SamplingBatch(**d)


def test_noise_is_a_pure_function_and_uniform():
    s, p = torch.tensor([1, 2, 1]), torch.tensor([5, 5, 5])
    u = uniform_noise(s, p, 4096)
    assert torch.equal(u[0], u[2]) and not torch.equal(u[0], u[1])
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.02
    assert torch.equal(
        uniform_noise(s, p + 1, 4096)[0],
        uniform_noise(torch.tensor([1]), torch.tensor([6]), 4096)[0],
    )


def test_noise_never_reaches_one_so_masked_tokens_never_win():
    """Seed 11 at position 45 draws, for token 603, a hash in the top 128 of 2^32 (found by
    search); fp32 rounded its uniform to 1.0, an infinite Gumbel noise, and −inf + inf = NaN won
    the argmax: a token masked out (a grammar, top-k) was sampled."""
    u = uniform_noise(torch.tensor([11]), torch.tensor([45]), 1024)
    assert u.max() < 1.0
    logits = torch.full((1, 1024), float("-inf"))
    logits[0, 18] = logits[0, 99] = 0.0
    sb = _sb(1, seeds=torch.tensor([11]), positions=torch.tensor([45]))
    out, _ = sample(logits, sb)
    assert int(out[0]) in (18, 99)


def test_greedy_and_temperature_zero_rows():
    logits = torch.randn(3, 50)
    out, _ = sample(logits, _sb(3, temperature=torch.tensor([0.0, 1.0, 0.0])))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_a_precomputed_argmax_is_taken_only_while_nothing_edits_the_logits():
    """A replayed graph hands the sampler its logits' argmax: a greedy batch takes it as its
    tokens unless something edits the logits (bans, bias, allowed ids, penalties, grammar) or a
    row samples; then the sampler computes its own from the edited logits."""
    logits = torch.randn(4, 64)
    true = logits.argmax(dim=-1)
    given = (true + 1) % 64  # not the argmax: tells which one was taken
    greedy = dict(temperature=torch.zeros(4), all_greedy=True)
    out, _ = sample(logits, _sb(4, **greedy), given)
    assert torch.equal(out, given)
    banned = (torch.tensor([0]), true[:1])  # row 0's best token banned
    out, _ = sample(logits, _sb(4, **greedy, banned=banned), given)
    edited = logits.clone()
    edited[0, true[0]] = float("-inf")
    assert torch.equal(out, edited.argmax(dim=-1))
    out, _ = sample(logits, _sb(4, temperature=torch.tensor([0.0, 0.0, 0.0, 1.0])), given)
    assert torch.equal(out[:3], true[:3])  # sampled batch: its own (greedy rows' argmax)


def test_top_k_top_p_min_p_restrict_support():
    torch.manual_seed(0)
    logits = torch.randn(1, 64).repeat(400, 1)
    seeds = torch.arange(400, dtype=torch.int64)
    top5 = set(logits[0].topk(5).indices.tolist())
    out, _ = sample(logits, _sb(400, seeds=seeds, top_k=torch.full((400,), 5), any_top_k=True))
    assert set(out.tolist()) <= top5 and len(set(out.tolist())) > 2
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    out, _ = sample(logits, _sb(400, seeds=seeds, top_p=torch.full((400,), 0.5), any_top_p=True))
    assert set(out.tolist()) <= nucleus
    keep = set((probs >= 0.3 * probs.max()).nonzero().squeeze(1).tolist())
    out, _ = sample(logits, _sb(400, seeds=seeds, min_p=torch.full((400,), 0.3), any_min_p=True))
    assert set(out.tolist()) <= keep


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(6000, 1)
    out, _ = sample(logits, _sb(6000, seeds=torch.arange(6000, dtype=torch.int64)))
    freq = torch.bincount(out, minlength=3).float() / 6000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_logprobs_rank_and_banned_tokens():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    out, lp = sample(
        logits,
        _sb(
            1,
            temperature=torch.zeros(1),
            all_greedy=True,
            max_logprobs=2,
            banned=(torch.tensor([0]), torch.tensor([0])),
        ),
    )
    assert out.item() == 1  # token 0 banned (min_tokens)
    chosen, rank, ids, vals = lp
    # logprobs are of the raw logits, before any ban or bias (upstream's default raw_logprobs)
    assert rank.item() == 2 and ids[0].tolist() == [0, 1]
    assert abs(chosen.item() - torch.log_softmax(logits[0], 0)[1].item()) < 1e-6
    plp = prompt_logprobs(torch.tensor([[0.0, 1.0]]), torch.tensor([0]), 1)
    assert (
        plp[1].item() == 2
        and abs(plp[0].item() - torch.log_softmax(torch.tensor([0.0, 1.0]), 0)[0].item()) < 1e-6
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grammar_bitmask_on_device_matches_cpu():
    """Structured outputs' bitmask inside the sampler on CUDA: the same tokens as on CPU, every
    one allowed by its row, rows of -1 unconstrained."""
    from vllm.structured_output.bitmask import apply_token_bitmask_ref

    g = torch.Generator().manual_seed(0)
    b, v = 6, 1000
    logits = torch.randn(b, v, generator=g)
    words = torch.randint(-(2**31), 2**31 - 1, (b, (v + 31) // 32), generator=g)
    bm = (words & torch.randint(0, 2**31 - 1, words.shape, generator=g)).to(torch.int32)
    bm[0] = -1
    kw = dict(seeds=torch.arange(b, dtype=torch.int64) * 31, positions=torch.arange(b) + 3)
    cpu, _ = sample(logits.clone(), _sb(b, grammar=bm, **kw))
    dev = {k: t.cuda() for k, t in _sb(b, **kw).__dict__.items() if isinstance(t, torch.Tensor)}
    sb = _sb(b, grammar=bm.cuda(), **dev)
    gpu, _ = sample(logits.cuda(), sb)
    assert torch.equal(gpu.cpu(), cpu)
    masked = apply_token_bitmask_ref(logits, bm)
    assert torch.isfinite(masked.gather(1, cpu.unsqueeze(1))).all()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammar_rows_only_sample_allowed_tokens(temperature):
    from vllm.structured_output.bitmask import apply_token_bitmask_ref

    g = torch.Generator().manual_seed(1)
    b, v = 8, 300
    for _ in range(20):
        logits = torch.randn(b, v, generator=g) * 5
        bm = torch.randint(0, 2**31 - 1, (b, (v + 31) // 32), generator=g).to(torch.int32)
        bm &= torch.randint(0, 2**31 - 1, bm.shape, generator=g).to(torch.int32)
        sb = _sb(b, temperature=torch.full((b,), temperature), all_greedy=temperature == 0,
                 grammar=bm, seeds=torch.randint(0, 2**40, (b,), generator=g))  # fmt: skip
        out, _ = sample(logits.clone(), sb)
        masked = apply_token_bitmask_ref(logits, bm)
        assert torch.isfinite(masked.gather(1, out.unsqueeze(1))).all()
        if temperature == 0:
            assert torch.equal(out, masked.argmax(-1))


def test_logprobs_are_computed_only_for_steps_that_ask(tiny_ckpt, monkeypatch):
    """A step whose rows want no logprobs skips the log-softmax, rank and top-n over the
    vocabulary (at B = 256 and 154,880 tokens that is ~1 GB of device traffic a step); a row
    asking for them gets them, the others in its step still get none."""
    from vllm.core.messages import (
        CachedRequestData,
        KVCachePlan,
        NewRequestData,
        SamplingOptions,
        SchedulerOutput,
    )
    from vllm.distributed.parallel_state import ParallelContext
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import build_model
    from vllm.worker.gpu import model_runner as mr

    cfg = EngineArgs(
        model=tiny_ckpt, device="cpu", max_num_seqs=4, kv_cache_memory_bytes=1 << 28
    ).create_engine_config()
    model = build_model(tiny_ckpt, dtype=cfg.model_config.dtype, device=torch.device("cpu"))
    runner = mr.ModelRunner(cfg, model, ParallelContext.single(), torch.device("cpu"))
    runner.initialize_kv_cache(KVCachePlan(64))
    seen, real = [], mr.sample
    monkeypatch.setattr(
        mr,
        "sample",
        lambda logits, sb, argmax=None: (
            seen.append(sb.max_logprobs),
            real(logits, sb, argmax),
        )[1],
    )
    plain = SamplingOptions(temperature=0.0, max_tokens=100)
    asks = SamplingOptions(temperature=0.0, max_tokens=100, logprobs=2)
    toks = [5, 9, 13, 17, 21, 25]

    def step(i, new, cached, sched):
        so = SchedulerOutput(
            step=i,
            new_reqs=new,
            cached_reqs=cached,
            num_scheduled_tokens=sched,
            total_num_scheduled_tokens=sum(sched.values()),
        )
        return runner.execute(so)

    out = step(0, [NewRequestData("a", toks, 6, [0], 0, plain)], [], {"a": 6})
    assert seen == [-1] and out.logprobs == {}
    out = step(
        1,
        [NewRequestData("b", toks, 6, [1], 0, asks)],
        [CachedRequestData("a", [], 6)],
        {"a": 1, "b": 6},
    )
    assert seen[-1] == 2 and set(out.logprobs) == {"b"}
    assert len(out.logprobs["b"][0].top_logprobs) == 2


def test_a_reused_step_plan_samples_as_a_fresh_one(tiny_ckpt, monkeypatch):
    """A decode step of the same requests in the same slots reuses the previous step's sampling
    plan (refreshing the positions the seeded noise follows): the tokens must be those of a
    plan built every step, while requests finish, join, and carry bans, penalties and logprobs
    (which build fresh plans) beside steady sampled rows."""
    from vllm.core.messages import EngineCoreRequest, KVCachePlan, SamplingOptions
    from vllm.core.scheduler import Scheduler
    from vllm.distributed.parallel_state import ParallelContext
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import build_model
    from vllm.worker.gpu.model_runner import ModelRunner

    opts = [
        SamplingOptions(temperature=0.9, top_p=0.9, seed=1, max_tokens=14, ignore_eos=True),
        SamplingOptions(temperature=1.0, top_k=5, seed=2, max_tokens=5, ignore_eos=True),
        SamplingOptions(temperature=0.0, max_tokens=9, logprobs=1, ignore_eos=True),
        SamplingOptions(temperature=1.2, min_p=0.05, seed=4, max_tokens=11, ignore_eos=True),
        SamplingOptions(temperature=0.7, seed=5, max_tokens=6, repetition_penalty=1.3),
        SamplingOptions(temperature=0.8, seed=6, max_tokens=8, bad_words_token_ids=[[7]]),
    ]

    def run(reuse: bool) -> tuple[dict[str, list[int]], int]:
        cfg = EngineArgs(
            model=tiny_ckpt, device="cpu", max_num_seqs=8, kv_cache_memory_bytes=1 << 28
        ).create_engine_config()
        model = build_model(tiny_ckpt, dtype=cfg.model_config.dtype, device=torch.device("cpu"))
        runner = ModelRunner(cfg, model, ParallelContext.single(), torch.device("cpu"))
        runner.initialize_kv_cache(KVCachePlan(64))
        sched = Scheduler(cfg, KVCachePlan(64))
        built, plan_of = [0], runner._sampling_plan

        def plan(inp):
            if not reuse:
                runner._plan_cache = None
            before = runner._plan_cache
            out = plan_of(inp)
            built[0] += out is not None and (before is None or out is not before[2])
            return out

        monkeypatch.setattr(runner, "_sampling_plan", plan)
        out: dict[str, list[int]] = {}
        for step in range(40):
            if step in (0, 6, 12):  # two requests join every sixth step
                for i in range(2):
                    k = step // 3 + i
                    sched.add_request(
                        EngineCoreRequest(str(k), [3 + k, 11, 19 + k, 4], opts[k], [0])
                    )
            so = sched.schedule()
            if so.total_num_scheduled_tokens == 0:
                break
            for o in sched.update_from_output(so, runner.execute(so)):
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out, built[0]

    fresh, n_fresh = run(reuse=False)
    reused, n_reused = run(reuse=True)
    assert sorted(fresh) == [str(k) for k in range(6)]
    assert all(len(fresh[str(k)]) == opts[k].max_tokens for k in range(6))
    assert reused == fresh
    assert n_reused < n_fresh  # plans were reused
