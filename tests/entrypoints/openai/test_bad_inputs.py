"""Bad input against a live `vllm serve`: every case is a 4xx in OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``) with a message in the request's terms, and
the server keeps serving (a good request right after succeeds)."""

from __future__ import annotations

import json

import pytest
import requests

from tests.utils import RemoteServer

MODEL = "tiny-glm-5.3"
MAX_LEN = 256
MAX_SEQS = 8


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    with RemoteServer(
        [
            tiny_ckpt,
            "--served-model-name",
            MODEL,
            "--max-model-len",
            str(MAX_LEN),
            "--max-num-seqs",
            str(MAX_SEQS),
        ]
    ) as s:
        yield s


def _cmpl(**kw):
    return {"model": MODEL, "prompt": "hello", "max_tokens": 2, **kw}


def _chat(messages=None, **kw):
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}] if messages is None else messages,
        "max_tokens": 2,
        **kw,
    }


NAN, INF = float("nan"), float("inf")
# (name, endpoint, body: a dict sent as JSON, or bytes sent as they are, expected status)
CASES = [
    # ---- the body itself
    ("malformed json", "completions", b"{not json", 400),
    ("body not an object", "completions", b"[1, 2, 3]", 400),
    ("json nested 100000 deep", "completions", b"[" * 100_000 + b"]" * 100_000, 400),
    ("body over the size limit", "completions", b'{"prompt": "' + b"x" * (33 << 20) + b'"}', 413),
    ("not utf-8", "completions", b'{"prompt": "\xff\xfe"}', 400),
    # ---- sampling numbers
    ("temperature NaN", "completions", _cmpl(temperature=NAN), 400),
    ("temperature Infinity", "completions", _cmpl(temperature=INF), 400),
    ("temperature negative", "completions", _cmpl(temperature=-0.5), 400),
    ("temperature a string", "completions", _cmpl(temperature="hot"), 400),
    ("top_p 0", "completions", _cmpl(top_p=0), 400),
    ("top_p NaN", "completions", _cmpl(top_p=NAN), 400),
    ("top_p above 1", "completions", _cmpl(top_p=1.5), 400),
    ("top_k -2", "completions", _cmpl(top_k=-2), 400),
    ("top_k a float", "completions", _cmpl(top_k=1.5), 400),
    ("min_p NaN", "completions", _cmpl(min_p=NAN), 400),
    ("min_p above 1", "completions", _cmpl(min_p=2), 400),
    ("seed 2**70", "completions", _cmpl(seed=2**70), 400),
    ("seed -2**70", "completions", _cmpl(seed=-(2**70)), 400),
    ("seed a string", "completions", _cmpl(seed="abc"), 400),
    ("max_tokens 0", "completions", _cmpl(max_tokens=0), 400),
    ("max_tokens negative", "completions", _cmpl(max_tokens=-1), 400),
    ("max_tokens past the context", "completions", _cmpl(max_tokens=10 * MAX_LEN), 400),
    ("min_tokens above max_tokens", "completions", _cmpl(min_tokens=5), 400),
    ("n 0", "completions", _cmpl(n=0), 400),
    ("n past --max-num-seqs", "completions", _cmpl(n=100_000), 400),
    ("best_of 0", "completions", _cmpl(best_of=0), 400),
    ("best_of above n", "completions", _cmpl(best_of=3), 400),
    ("logprobs negative", "completions", _cmpl(logprobs=-1), 400),
    ("logprobs past the limit", "completions", _cmpl(logprobs=10_000), 400),
    ("prompt_logprobs past the limit", "completions", _cmpl(prompt_logprobs=10_000), 400),
    ("stop an empty string", "completions", _cmpl(stop=[""]), 400),
    ("stop_token_ids negative", "completions", _cmpl(stop_token_ids=[-1]), 400),
    ("stop_token_ids past the vocabulary", "completions", _cmpl(stop_token_ids=[10**9]), 400),
    # ---- prompts
    ("prompt missing", "completions", {"model": MODEL, "max_tokens": 2}, 400),
    ("prompt empty string", "completions", _cmpl(prompt=""), 400),
    ("prompt empty list", "completions", _cmpl(prompt=[]), 400),
    ("prompt a number", "completions", _cmpl(prompt=42), 400),
    ("prompt mixed list", "completions", _cmpl(prompt=[1, "a"]), 400),
    ("prompt token id negative", "completions", _cmpl(prompt=[1, -3]), 400),
    ("prompt token id out of vocabulary", "completions", _cmpl(prompt=[1, 10**9]), 400),
    ("prompt over max-model-len", "completions", _cmpl(prompt=[1] * (MAX_LEN + 5)), 400),
    ("prompt nested three deep", "completions", _cmpl(prompt=[[[1]]]), 400),
    ("unknown model", "completions", _cmpl(model="nope"), 404),
    # ---- chat messages
    ("messages missing", "chat/completions", {"model": MODEL, "max_tokens": 2}, 400),
    ("messages empty", "chat/completions", _chat([]), 400),
    ("messages not a list", "chat/completions", _chat("hi"), 400),
    ("message not an object", "chat/completions", _chat(["hi"]), 400),
    ("message without role", "chat/completions", _chat([{"content": "hi"}]), 400),
    ("unknown role", "chat/completions", _chat([{"role": "wizard", "content": "hi"}]), 400),
    ("message without content", "chat/completions", _chat([{"role": "user"}]), 400),
    ("content a number", "chat/completions", _chat([{"role": "user", "content": 5}]), 400),
    (
        "content part without text",
        "chat/completions",
        _chat([{"role": "user", "content": [{"type": "text"}]}]),
        400,
    ),
    (
        "content part of an unknown type",
        "chat/completions",
        _chat([{"role": "user", "content": [{"type": "video", "url": "x"}]}]),
        400,
    ),
    ("top_logprobs without logprobs", "chat/completions", _chat(top_logprobs=2), 400),
    ("chat temperature NaN", "chat/completions", _chat(temperature=NAN), 400),
]


def _post(server, endpoint, body):
    url = f"{server.base_url}/{endpoint}"
    if isinstance(body, bytes):
        return requests.post(url, data=body, headers={"Content-Type": "application/json"})
    # allow_nan: NaN and Infinity as JSON literals, the way non-strict clients send them
    data = json.dumps(body, allow_nan=True).encode()
    return requests.post(url, data=data, headers={"Content-Type": "application/json"})


def test_the_table_is_large_enough():
    assert len(CASES) >= 40


@pytest.mark.parametrize("name,endpoint,body,code", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_4xx_in_openai_shape(server, name, endpoint, body, code):
    r = _post(server, endpoint, body)
    assert r.status_code == code, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == code
    assert err["message"] and "Traceback" not in err["message"]
    ok = _post(server, endpoint, _cmpl() if endpoint == "completions" else _chat())
    assert ok.status_code == 200, ok.text[:500]


def test_every_counter_is_exported_from_start_up(tiny_ckpt):
    """Counters are present at 0 before anything increments them (a fresh server)."""
    with RemoteServer([tiny_ckpt, "--max-model-len", str(MAX_LEN)]) as s:
        text = requests.get(s.url + "/metrics").text
    for name in (
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        'vllm:request_success_total{finished_reason="abort"',
        "vllm:e2e_request_latency_seconds_count",
    ):
        lines = [line for line in text.splitlines() if line.startswith(name)]
        assert lines and float(lines[0].split()[-1]) == 0.0, name
