"""Penalties, logit_bias, allowed_token_ids, bad_words and min_p against plain references written
from upstream vLLM's definitions, on fresh random logits and token histories; the per-slot state
(prompt mask, output counts, bad-word histories) is driven as the runner drives it: admission
with known tokens (a preempted request resumes with its outputs), then tokens sampled step by
step, with slots reused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.core.messages import SamplingOptions
from vllm.worker.gpu.logit_bias import LogitBiasState, apply_allowed, apply_logit_bias
from vllm.worker.gpu.penalties import PenaltiesState, apply_penalties
from vllm.worker.gpu.sampler import SamplingBatch, apply_min_p, sample

V = 97
NEG_INF = float("-inf")


def h2d(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


# ---- references, from the definitions ------------------------------------------------------------
def ref_penalties(logits, prompts, outputs, rep, freq, pres):
    """Per row and token: repetition penalty if the token is in the prompt or the outputs
    (positive logit / penalty, else * penalty); then minus freq * count + pres * (count > 0),
    count over the outputs only."""
    out = logits.clone()
    for b in range(logits.shape[0]):
        for v in range(logits.shape[1]):
            count = outputs[b].count(v)
            x = out[b, v].item()
            if v in prompts[b] or count > 0:
                x = x / rep[b] if x > 0 else x * rep[b]
            x -= freq[b] * count + pres[b] * (1 if count > 0 else 0)
            out[b, v] = x
    return out


def ref_min_p(x, min_p):
    probs = torch.softmax(x, dim=-1)
    out = x.clone()
    for b in range(x.shape[0]):
        for v in range(x.shape[1]):
            if probs[b, v] < min_p[b] * probs[b].max():
                out[b, v] = NEG_INF
    return out


def ref_bad_word_bans(bad_words, outputs):
    """Ban a word's last token when the outputs end with the rest of it."""
    bans = set()
    for b, words in enumerate(bad_words):
        for w in words:
            prefix = w[:-1]
            if len(prefix) <= len(outputs[b]) and outputs[b][len(outputs[b]) - len(prefix) :] == (
                prefix
            ):
                bans.add((b, w[-1]))
    return bans


def _rand_ids(g, n):
    return torch.randint(0, V, (n,), generator=g).tolist()


# ---- penalties -------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalties_state_and_apply_match_reference(seed):
    g = torch.Generator().manual_seed(seed)
    st = PenaltiesState(8, V, torch.device("cpu"))
    # a stale request leaves counts in slot 3 that its next tenant must not see
    st.add(3, SamplingOptions(frequency_penalty=1.0), np.arange(20, dtype=np.int64), 5)
    st.count_sampled(torch.tensor([3]), torch.tensor([7]))
    slots = np.array([3, 0, 5, 1, 6])
    params = [(1.3, 0.5, 0.2), (0.7, -0.4, 1.0), (1.0, 0.0, 0.0), (2.0, 2.0, -2.0), (1.0, 1.5, 0.0)]
    prompts, outputs = [], []
    for s, (rep, freq, pres) in zip(slots, params, strict=True):
        prompt = _rand_ids(g, int(torch.randint(1, 30, (1,), generator=g)))
        resumed = _rand_ids(g, int(torch.randint(0, 10, (1,), generator=g)))  # after preemption
        sp = SamplingOptions(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
        st.add(int(s), sp, np.array(prompt + resumed, dtype=np.int64), len(prompt))
        prompts.append(prompt)
        outputs.append(resumed)
    dslots = torch.from_numpy(slots)
    for _ in range(6):  # decode steps: the sampled tokens join the counts on the device
        sampled = torch.randint(0, V, (len(slots),), generator=g)
        st.count_sampled(dslots, sampled)
        for b, t in enumerate(sampled.tolist()):
            outputs[b].append(t)
    logits = torch.randn(len(slots), V, generator=g) * 3
    p = st.gather(slots, dslots)
    got = apply_penalties(logits, p)
    rep, freq, pres = zip(*params, strict=True)
    want = ref_penalties(logits, prompts, outputs, rep, freq, pres)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)  # fp32: divide vs reciprocal
    assert torch.equal(got[2], logits[2])  # the neutral row is bit-identical
    assert st.gather(np.array([2, 4]), torch.tensor([2, 4])) is None  # no row uses penalties


# ---- allowed_token_ids, logit_bias, bad_words -------------------------------------------------------
def test_allowed_and_logit_bias_match_reference():
    g = torch.Generator().manual_seed(3)
    st = LogitBiasState(8, torch.device("cpu"))
    allowed = {0: [5, 6, 90], 2: [1], 3: None, 4: list(range(40))}
    biases = {0: {5: 100.0, 7: -3.0}, 1: {0: 2.5}, 2: None, 3: {96: -100.0, 1: 0.5}, 4: None}
    slots = np.array([6, 2, 0, 7, 4])
    for b, s in enumerate(slots):
        sp = SamplingOptions(allowed_token_ids=allowed.get(b), logit_bias=biases[b])
        st.add(int(s), sp, np.array([1, 2], dtype=np.int64), 2)
    logits = torch.randn(len(slots), V, generator=g)
    got = apply_allowed(logits, st.gather_allowed(slots, h2d))
    got = apply_logit_bias(got, st.gather_bias(slots, h2d))
    want = logits.clone()
    for b in range(len(slots)):
        if allowed.get(b) is not None:
            for v in range(V):
                if v not in allowed[b]:
                    want[b, v] = NEG_INF
        for v, bias in (biases[b] or {}).items():
            want[b, v] += bias
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    st.remove(6)
    assert st.gather_allowed(np.array([6, 7]), h2d) is None


def test_bad_words_bans_match_reference():
    g = torch.Generator().manual_seed(4)
    st = LogitBiasState(4, torch.device("cpu"))
    words = [[[5], [3, 4], [9, 9, 2]], [], [[1, 2, 3, 4]], [[8], [6, 7]]]
    outputs = [[1, 3], [4, 4], [9, 1, 2], [6]]
    prompt = [11, 12, 13]
    for s in range(4):
        sp = SamplingOptions(bad_words_token_ids=words[s] or None)
        st.add(s, sp, np.array(prompt + outputs[s], dtype=np.int64), len(prompt))
    slots = np.array([2, 0, 3, 1])
    for step in range(40):
        rows, ids = st.bad_word_bans(slots)
        want = ref_bad_word_bans([words[s] for s in slots], [outputs[s] for s in slots])
        assert set(zip(rows, ids, strict=True)) == want, step
        for s in slots:  # tokens from a small alphabet so the prefixes do match at times
            t = int(torch.randint(1, 10, (1,), generator=g))
            st.record(int(s), t)
            outputs[s].append(t)
    assert st.outputs[1] == []  # a request without bad_words keeps no history


# ---- min_p and the whole pipeline -------------------------------------------------------------------
def test_min_p_matches_reference():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, V, generator=g) * 2
    min_p = torch.tensor([0.0, 0.05, 0.2, 0.5, 0.9, 1.0])
    got = apply_min_p(x, min_p)
    torch.testing.assert_close(got, ref_min_p(x, min_p), rtol=0, atol=0)
    assert torch.equal(got[0], x[0])


def _sb(b, **kw):
    d = dict(
        temperature=torch.ones(b),
        top_k=torch.zeros(b, dtype=torch.int64),
        top_p=torch.ones(b),
        min_p=torch.zeros(b),
        seeds=torch.arange(b, dtype=torch.int64),
        positions=torch.zeros(b, dtype=torch.int64),
        all_greedy=False,
        any_top_k=False,
        any_top_p=False,
        any_min_p=False,
        max_logprobs=-1,
    )
    d.update(kw)
    return SamplingBatch(**d)


def test_min_p_applies_before_top_p():
    """Upstream's order: min-p, then top-p over what is left. probs .4/.3/.2/.1, min_p .3 drops
    the .1 token; top-p .75 over the rest (.44/.33/.22) keeps two tokens (three the other way)."""
    n = 3000
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).repeat(n, 1)
    sb = _sb(
        n,
        seeds=torch.arange(n, dtype=torch.int64),
        min_p=torch.full((n,), 0.3),
        top_p=torch.full((n,), 0.75),
        any_min_p=True,
        any_top_p=True,
    )
    out, _ = sample(logits, sb)
    assert set(out.tolist()) == {0, 1}


def test_greedy_pipeline_and_raw_logprobs():
    """allowed → bans → bias → penalties, then argmax; logprobs stay those of the raw logits."""
    g = torch.Generator().manual_seed(6)
    b = 4
    logits = torch.randn(b, V, generator=g) * 2
    pst = PenaltiesState(b, V, torch.device("cpu"))
    lst = LogitBiasState(b, torch.device("cpu"))
    opts = [
        SamplingOptions(repetition_penalty=3.0, allowed_token_ids=list(range(0, V, 2))),
        SamplingOptions(frequency_penalty=2.0, logit_bias={int(logits[1].argmin()): 50.0}),
        SamplingOptions(bad_words_token_ids=[[int(logits[2].argmax())]]),
        SamplingOptions(),
    ]
    hist = [[int(t) for t in logits[r].topk(3).indices] for r in range(b)]
    for s, sp in enumerate(opts):
        toks = np.array([50] + hist[s], dtype=np.int64)
        pst.add(s, sp, toks, 1)
        lst.add(s, sp, toks, 1)
    slots, dslots = np.arange(b), torch.arange(b)
    rows, ids = lst.bad_word_bans(slots)
    sb = _sb(
        b,
        temperature=torch.zeros(b),
        all_greedy=True,
        max_logprobs=2,
        banned=(torch.tensor(rows), torch.tensor(ids)),
        allowed=lst.gather_allowed(slots, h2d),
        bias=lst.gather_bias(slots, h2d),
        penalties=pst.gather(slots, dslots),
    )
    out, lp = sample(logits, sb)
    want = logits.clone()
    for v in range(V):
        if v % 2:
            want[0, v] = NEG_INF
    want[2, int(logits[2].argmax())] = NEG_INF
    want[1, int(logits[1].argmin())] += 50.0
    want = ref_penalties(want, [[50]] * b, hist, [3.0, 1, 1, 1], [0, 2.0, 0, 0], [0] * b)
    assert out.tolist() == want.argmax(-1).tolist()
    raw = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp[0], raw.gather(1, out.unsqueeze(1)).squeeze(1))
    assert torch.equal(lp[2], raw.topk(2).indices)


@pytest.mark.gpu
def test_the_sampling_path_never_waits_for_the_device():
    """On CUDA, with every edit in use, gathering the step's parameters, sampling and counting
    the sampled tokens raise no synchronising call (torch's sync debug mode), for several steps;
    the tokens equal the CPU run's."""
    from vllm.worker.gpu.staging import HostStaging

    def run(dev: torch.device, check: bool):
        g = torch.Generator().manual_seed(7)
        b, staging = 4, HostStaging(dev)
        pst, lst = PenaltiesState(b, V, dev), LogitBiasState(b, dev)
        opts = [
            SamplingOptions(repetition_penalty=1.5, allowed_token_ids=list(range(0, V, 2))),
            SamplingOptions(frequency_penalty=1.0, presence_penalty=0.5, logit_bias={3: 2.0}),
            SamplingOptions(bad_words_token_ids=[[4], [5, 6]]),
            SamplingOptions(),
        ]
        all_logits = (torch.randn(5, b, V, generator=g) * 3).to(dev)
        slots, outs = np.arange(b), []
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if check else 0)
        try:
            for s, sp in enumerate(opts):  # admission too
                pst.add(s, sp, np.array([1, 2, 3, 5], dtype=np.int64), 3)
                lst.add(s, sp, np.array([1, 2, 3, 5], dtype=np.int64), 3)
            for step in range(5):
                h2d = staging.to_device
                dslots = h2d(slots)
                rows, ids = lst.bad_word_bans(slots)
                sb = SamplingBatch(
                    temperature=torch.full((b,), 0.8, device=dev),
                    top_k=torch.full((b,), 20, dtype=torch.int64, device=dev),
                    top_p=torch.full((b,), 0.9, device=dev),
                    min_p=torch.full((b,), 0.05, device=dev),
                    seeds=h2d(np.arange(b, dtype=np.int64)),
                    positions=h2d(np.full(b, step, dtype=np.int64)),
                    all_greedy=False,
                    any_top_k=True,
                    any_top_p=True,
                    any_min_p=True,
                    max_logprobs=2,
                    banned=(h2d(np.array(rows, np.int64)), h2d(np.array(ids, np.int64))),
                    allowed=lst.gather_allowed(slots, h2d),
                    bias=lst.gather_bias(slots, h2d),
                    penalties=pst.gather(slots, dslots),
                )
                out, _ = sample(all_logits[step], sb)
                pst.count_sampled(dslots, out)
                outs.append(out)
                host = out.to("cpu", non_blocking=True)
                if dev.type == "cuda":  # the step's one sync, as the runner's to_host
                    torch.cuda.set_sync_debug_mode(0)
                    torch.cuda.current_stream().synchronize()
                    torch.cuda.set_sync_debug_mode("error" if check else 0)
                staging.synced()
                for s, t in enumerate(host.tolist()):
                    lst.record(s, t)
        finally:
            if dev.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        return torch.stack(outs).cpu()

    got = run(torch.device("cuda"), check=True)
    assert torch.equal(got, run(torch.device("cpu"), check=False))
