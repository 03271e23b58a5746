"""Offline `LLM` with the full set of sampling parameters (penalties, logit_bias,
allowed_token_ids, bad_words) on the tiny checkpoint: their effect on the tokens, the penalties
against a reference built from the same model's logits, and the same tokens through chunked
prefill and preemption."""

from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.model_executor.model_loader import build_model
from vllm.model_executor.simple_forward import prompt_logits

PROMPTS = [list(range(10, 50)), [7, 8, 9, 7, 8, 9, 300, 301, 7, 8, 9] * 3]


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    m = LLM(tiny_ckpt, device="cpu")  # fp32: the reference below is exact to fp32 rounding
    yield m
    m.shutdown()


@pytest.fixture(scope="module")
def model(llm, tiny_ckpt):
    return build_model(tiny_ckpt, dtype=llm.config.model_config.dtype)


def _greedy(m, prompts, max_tokens=30, **kw):
    outs = m.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw),
    )
    return [o.outputs[0].token_ids for o in outs]


def ref_penalised(logits, prompt, outputs, rep, freq, pres):
    """logits [V] of the next token; upstream's definitions: repetition over prompt and
    outputs (positive / rep, negative * rep), then minus freq * count + pres * (count > 0)."""
    count = torch.bincount(torch.tensor(outputs, dtype=torch.long), minlength=logits.numel())
    seen = torch.zeros_like(count, dtype=torch.bool)
    seen[torch.tensor(prompt)] = True
    seen |= count > 0
    x = torch.where(seen & (logits > 0), logits / rep, logits)
    x = torch.where(seen & (logits <= 0), logits * rep, x)
    return x - freq * count - pres * (count > 0).float()


def _check_against_reference(m, model, rep, freq, pres, device="cpu"):
    """Each greedy token is the argmax of the reference-penalised logits of the same model over
    the prompt and the outputs before it (teacher-forced on the engine's tokens)."""
    kw = dict(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    for p, out in zip(PROMPTS, _greedy(m, PROMPTS, **kw), strict=True):
        logits = prompt_logits(model, p + out, device=device).cpu()
        for i, t in enumerate(out):
            x = ref_penalised(logits[len(p) - 1 + i], p, out[:i], rep, freq, pres)
            assert x[t] >= x.max() - 1e-3, (i, t, int(x.argmax()))  # engine vs ref fp32 kernels


@pytest.mark.parametrize(
    "rep,freq,pres", [(1.5, 0.0, 0.0), (1.0, 1.2, 0.0), (1.0, 0.0, 1.5), (0.8, -0.5, 0.7)]
)
def test_penalties_match_a_step_by_step_reference(llm, model, rep, freq, pres):
    _check_against_reference(llm, model, rep, freq, pres)


def test_penalties_change_greedy_output(llm):
    base = _greedy(llm, PROMPTS)
    assert base[1] != _greedy(llm, PROMPTS[1:], repetition_penalty=1.5)[0]
    assert base != _greedy(llm, PROMPTS, frequency_penalty=2.0, presence_penalty=2.0)


def test_large_repetition_penalty_bans_repeats(llm):
    for p, out in zip(PROMPTS, _greedy(llm, PROMPTS, repetition_penalty=1e6), strict=True):
        assert len(set(out)) == len(out) and not set(out) & set(p)


def test_logit_bias(llm):
    base = _greedy(llm, PROMPTS, 10)
    forced, plain = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        [
            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias={7: 100}),
            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        ],
    )
    assert forced.outputs[0].token_ids == [7] * 10
    assert plain.outputs[0].token_ids == base[1]  # its batch neighbour's bias is not its own
    first = base[0][0]
    out = _greedy(llm, PROMPTS[:1], 10, logit_bias={first: -100.0})[0]
    assert out[0] != first and first not in out


def test_allowed_token_ids(llm):
    allowed = [3, 5, 900]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        [
            SamplingParams(temperature=1.0, seed=1, max_tokens=30, allowed_token_ids=allowed),
            SamplingParams(temperature=1.0, seed=1, max_tokens=30),
        ],
    )
    restricted, free = outs[0].outputs[0].token_ids, outs[1].outputs[0].token_ids
    assert set(restricted) <= set(allowed) and len(set(restricted)) > 1
    assert not set(free) <= set(allowed)
    greedy = _greedy(llm, PROMPTS[:1], 10, allowed_token_ids=[11])[0]
    assert greedy == [11] * 10


def _bad_word_sequences(tok, word):
    """The token sequences upstream bans for a word: as it starts the text, and after a space
    when that gives other tokens of the same length."""
    first = tok.encode(word.lstrip(), add_special_tokens=False)
    spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
    if spaced[0] != first[0] and len(spaced) == len(first):
        return [first, spaced]
    return [first]


def _contains(ids, seq):
    return any(ids[i : i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


def test_bad_words_never_appear(llm):
    tok = llm.get_tokenizer()
    prompt = "Hello there, tell me a story"
    sp = dict(temperature=0, max_tokens=30, ignore_eos=True)
    base = llm.generate(prompt, SamplingParams(**sp))[0].outputs[0].token_ids
    words = []  # one single-token word and one of two tokens, both in the plain output
    for n in (1, 2):
        for i in range(len(base) - n + 1):
            w = tok.decode(base[i : i + n])
            if w.strip() and any(s == base[i : i + n] for s in _bad_word_sequences(tok, w)):
                words.append(w)
                break
    assert len(words) == 2, "no re-encodable word in the plain output"
    for w in words:
        out = llm.generate(prompt, SamplingParams(bad_words=[w], **sp))[0].outputs[0].token_ids
        assert out != base
        for seq in _bad_word_sequences(tok, w):
            assert not _contains(out, seq), (w, seq, out)


def test_chunked_prefill_and_preemption_keep_the_output(llm, tiny_ckpt):
    """Prompt masks, output counts and bad-word histories are rebuilt when a preempted request
    resumes and never see a prompt chunk as an output: same tokens as the roomy engine."""
    from vllm.kv_cache_interface import kv_bytes_per_token

    mc = llm.config.model_config
    per_block = 64 * kv_bytes_per_token(mc.arch, "auto", mc.dtype, num_mtp_layers=0)
    prompts = [list(range(10, 10 + n)) for n in (5, 40, 70, 130)]
    params = [
        SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, **kw)
        for kw in (
            dict(repetition_penalty=1.3, presence_penalty=0.5),
            dict(frequency_penalty=0.8, logit_bias={5: 3.0}),
            dict(bad_words=[llm.get_tokenizer().decode([300])], repetition_penalty=1.2),
            dict(allowed_token_ids=list(range(0, 1024, 3)), frequency_penalty=1.0),
        )
    ]
    batch = [{"prompt_token_ids": p} for p in prompts]
    ref = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    tight = LLM(
        tiny_ckpt,
        device="cpu",
        kv_cache_memory_bytes=6 * per_block,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )
    try:
        got = [o.outputs[0].token_ids for o in tight.generate(batch, params)]
        assert sum(s.num_preemptions for s in tight.stats_history) > 0
    finally:
        tight.shutdown()
    assert got == ref


@pytest.mark.gpu
def test_sampling_params_on_cuda(tiny_ckpt):
    """The runner on CUDA (fp32, to compare with the reference): penalties as the reference, and
    the same constraints hold."""
    m = LLM(tiny_ckpt, device="cuda", dtype="float32", kv_cache_memory_bytes=256 * 2**20)
    try:
        model = build_model(tiny_ckpt, dtype=torch.float32, device="cuda")
        for rep, freq, pres in [(1.5, 0.0, 0.0), (0.8, -0.5, 0.7)]:
            _check_against_reference(m, model, rep, freq, pres, device="cuda")
        batch = [{"prompt_token_ids": p} for p in PROMPTS * 2]
        greedy = dict(temperature=0, max_tokens=30, ignore_eos=True)
        outs = m.generate(
            batch,
            [
                SamplingParams(logit_bias={7: 100}, **greedy),
                SamplingParams(repetition_penalty=1e6, **greedy),
                SamplingParams(temperature=1.0, seed=3, max_tokens=30, allowed_token_ids=[3, 5]),
                SamplingParams(frequency_penalty=2.0, presence_penalty=2.0, **greedy),
            ],
        )
        ids = [o.outputs[0].token_ids for o in outs]
        assert ids[0] == [7] * 30
        assert len(set(ids[1])) == 30 and not set(ids[1]) & set(PROMPTS[1])
        assert set(ids[2]) <= {3, 5}
        assert len(ids[3]) == 30
    finally:
        m.shutdown()
