"""Offline `LLM`: generation semantics at the token level, preemption, and parity with the server."""

from __future__ import annotations

import pytest
import requests

from tests.utils import RemoteServer
from vllm import LLM, SamplingParams

PROMPTS = [list(range(10, 10 + n)) for n in (5, 40, 70, 130)]


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    m = LLM(tiny_ckpt)
    yield m
    m.shutdown()


def _greedy(m, prompts, max_tokens=24, **kw):
    outs = m.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw),
    )
    return [o.outputs[0].token_ids for o in outs]


def test_generate_text_and_ids(llm):
    out = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.prompt == "Hello there" and out.prompt_token_ids == llm.get_tokenizer().encode(
        "Hello there"
    )
    assert isinstance(out.prompt_token_ids, list)  # upstream's type (a tuple inside the engine)
    c = out.outputs[0]
    assert len(c.token_ids) == 8 and c.text == llm.get_tokenizer().decode(c.token_ids)


def test_stop_token_ids_and_min_tokens(llm):
    ref = _greedy(llm, [PROMPTS[1]], 12)[0]
    stop_tok = ref[4]
    first = ref.index(stop_tok)
    out = llm.generate(
        {"prompt_token_ids": PROMPTS[1]},
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok], ignore_eos=True),
    )[0]
    c = out.outputs[0]
    assert (
        c.token_ids == ref[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_tok
    )
    # min_tokens bans the stop token until enough tokens exist
    out = llm.generate(
        {"prompt_token_ids": PROMPTS[1]},
        SamplingParams(
            temperature=0,
            max_tokens=12,
            min_tokens=first + 3,
            stop_token_ids=[stop_tok],
            ignore_eos=True,
        ),
    )[0]
    assert len(out.outputs[0].token_ids) >= first + 3
    assert stop_tok not in out.outputs[0].token_ids[: first + 2]


def test_eos_stops_unless_ignored(llm):
    eos = llm.config.model_config.arch.eos_token_id
    out = _greedy(llm, [PROMPTS[2]], 30)[0]
    hit = [i for i, t in enumerate(out) if t in eos]
    plain = llm.generate(
        {"prompt_token_ids": PROMPTS[2]}, SamplingParams(temperature=0, max_tokens=30)
    )[0].outputs[0]
    if hit:
        assert plain.token_ids == out[: hit[0] + 1] and plain.finish_reason == "stop"
    else:
        assert plain.token_ids == out and plain.finish_reason == "length"


def test_batch_equals_single(llm):
    together = _greedy(llm, PROMPTS)
    alone = [_greedy(llm, [p])[0] for p in PROMPTS]
    assert together == alone


def test_chunked_prefill_equals_whole(llm, tiny_ckpt):
    small = LLM(tiny_ckpt, max_num_batched_tokens=24, enable_prefix_caching=False)
    try:
        assert _greedy(small, PROMPTS) == _greedy(llm, PROMPTS)
    finally:
        small.shutdown()


def test_preemption_keeps_greedy_output(llm, tiny_ckpt):
    """A KV budget of 6 blocks for 4 requests that need up to 3 each forces recompute."""
    ref = _greedy(llm, PROMPTS, 60)
    per_block = 64 * _bytes_per_token(llm)
    tight = LLM(tiny_ckpt, kv_cache_memory_bytes=6 * per_block)
    try:
        assert tight.client.info["num_blocks"] == 6
        got = _greedy(tight, PROMPTS, 60)
        stats = tight.client.call_utility("info")[0]
        assert stats["num_blocks"] == 6
    finally:
        tight.shutdown()
    assert got == ref


def _bytes_per_token(m):
    from vllm.kv_cache_interface import kv_bytes_per_token

    mc = m.config.model_config
    return kv_bytes_per_token(mc.arch, "auto", mc.dtype, num_mtp_layers=0)


def test_prefix_cache_hit_gives_same_output(llm):
    p = list(range(200, 400))
    a = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=10))[0]
    b = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=10))[0]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 192
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_sampling_params_reproducible_per_seed(llm):
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, seed=7, max_tokens=16)
    a = llm.generate({"prompt_token_ids": PROMPTS[0]}, sp)[0].outputs[0].token_ids
    # same seed, different batch company: same tokens
    outs = llm.generate(
        [{"prompt_token_ids": PROMPTS[3]}, {"prompt_token_ids": PROMPTS[0]}],
        [SamplingParams(temperature=1.0, max_tokens=16), sp],
    )
    assert outs[1].outputs[0].token_ids == a


def test_prompt_too_long_is_refused(llm):
    with pytest.raises(ValueError, match="maximum context length|KV cache holds"):
        llm.generate({"prompt_token_ids": [1] * (llm.client.info["max_request_tokens"] + 1)})


def test_llm_equals_server(llm, tiny_ckpt):
    with RemoteServer([tiny_ckpt]) as s:
        for p in PROMPTS:
            r = requests.post(
                s.base_url + "/completions",
                json={
                    "prompt": p,
                    "max_tokens": 24,
                    "temperature": 0,
                    "ignore_eos": True,
                    "logprobs": 0,
                },
            )
            assert r.status_code == 200
            server_text = r.json()["choices"][0]["text"]
            offline = llm.generate(
                {"prompt_token_ids": p},
                SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            )[0].outputs[0]
            assert server_text == offline.text


def test_skip_tokenizer_init_serves_token_ids(tiny_ckpt):
    m = LLM(tiny_ckpt, skip_tokenizer_init=True)
    try:
        assert m.get_tokenizer() is None
        out = m.generate(
            {"prompt_token_ids": PROMPTS[1]}, SamplingParams(temperature=0, max_tokens=5)
        )[0]
        assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].text == ""
        with pytest.raises(ValueError, match="skip-tokenizer-init"):
            m.generate("a text prompt")
    finally:
        m.shutdown()


def test_llm_without_main_guard_says_what_to_do(tiny_ckpt, tmp_path):
    """A script that builds LLM(...) at top level: the spawned engine process re-imports it; the
    user gets one line saying to add the `__main__` guard, and no process is left."""
    import subprocess
    import sys
    import time

    import psutil

    script = tmp_path / "no_guard.py"
    script.write_text(f"from vllm import LLM\nllm = LLM({tiny_ckpt!r})\nprint('built')\n")
    before = {p.pid for p in psutil.process_iter()}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "built" not in r.stdout
    assert 'if __name__ == "__main__":' in r.stderr.splitlines()[-1], r.stderr[-2000:]
    assert "bootstrapping phase" not in r.stderr  # multiprocessing's own error is not shown
    time.sleep(0.5)
    left = [  # engine processes started by the script (spawn's children run spawn_main)
        p
        for p in psutil.process_iter(["pid", "cmdline"])
        if p.pid not in before and "spawn_main" in " ".join(p.info["cmdline"] or [])
    ]
    assert not left


def test_script_that_raises_before_shutdown_exits(tiny_ckpt, tmp_path):
    """No hang at interpreter exit when a script raises with an engine still up (its processes
    are stopped before multiprocessing joins them)."""
    import subprocess
    import sys

    script = tmp_path / "s.py"
    script.write_text(
        "from vllm import LLM\n"
        "if __name__ == '__main__':\n"
        f"    m = LLM({tiny_ckpt!r})\n"
        "    m.generate([{'prompt_token_ids': [10**6]}])\n"
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "out of vocabulary" in r.stderr
