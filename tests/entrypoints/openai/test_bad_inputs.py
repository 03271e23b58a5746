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
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
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
    # ---- penalties, logit_bias, allowed_token_ids, bad_words
    ("presence_penalty above 2", "completions", _cmpl(presence_penalty=2.5), 400),
    ("frequency_penalty below -2", "completions", _cmpl(frequency_penalty=-3), 400),
    ("frequency_penalty NaN", "completions", _cmpl(frequency_penalty=NAN), 400),
    ("repetition_penalty 0", "completions", _cmpl(repetition_penalty=0), 400),
    ("logit_bias token past the vocabulary", "completions", _cmpl(logit_bias={"100000": 1}), 400),
    ("logit_bias token negative", "completions", _cmpl(logit_bias={"-1": 1}), 400),
    ("logit_bias key not a token id", "completions", _cmpl(logit_bias={"abc": 1}), 400),
    ("logit_bias above 100", "completions", _cmpl(logit_bias={"5": 150}), 400),
    ("logit_bias below -100", "completions", _cmpl(logit_bias={"5": -101}), 400),
    ("logit_bias NaN", "completions", _cmpl(logit_bias={"5": NAN}), 400),
    ("logit_bias a list", "completions", _cmpl(logit_bias=[1, 2]), 400),
    ("allowed_token_ids empty", "completions", _cmpl(allowed_token_ids=[]), 400),
    (
        "allowed_token_ids past the vocabulary",
        "completions",
        _cmpl(allowed_token_ids=[1, 10**9]),
        400,
    ),
    ("allowed_token_ids negative", "completions", _cmpl(allowed_token_ids=[-1]), 400),
    ("bad_words blank", "completions", _cmpl(bad_words=[" "]), 400),
    ("bad_words not strings", "completions", _cmpl(bad_words=[5]), 400),
    ("chat logit_bias past the vocabulary", "chat/completions", _chat(logit_bias={"5000": 1}), 400),
    ("chat logprobs a number", "chat/completions", _chat(logprobs=5), 400),
    ("chat top_logprobs negative", "chat/completions", _chat(logprobs=True, top_logprobs=-1), 400),
    # ---- fields of upstream's API this server does not implement: refused, not ignored
    ("suffix", "completions", _cmpl(suffix="x"), 400),
    ("use_beam_search", "completions", _cmpl(use_beam_search=True), 400),
    ("logits_processors", "completions", _cmpl(logits_processors=["my.module:Proc"]), 400),
    ("return_tokens_as_token_ids", "chat/completions", _chat(return_tokens_as_token_ids=True), 400),
    ("truncate_prompt_tokens", "completions", _cmpl(truncate_prompt_tokens=4), 400),
    ("priority", "completions", _cmpl(priority=1), 400),
    ("chat echo", "chat/completions", _chat(echo=True), 400),
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
    # ---- tools, tool_choice, tool messages (this server has no --enable-auto-tool-choice)
    ("tools with auto choice, no parser", "chat/completions", _chat(tools=[_TOOL]), 400),
    ("tools not a list", "chat/completions", _chat(tools={"name": "f"}), 400),
    ("tool not a function", "chat/completions", _chat(tools=[{"type": "retrieval"}]), 400),
    (
        "tool without a name",
        "chat/completions",
        _chat(tools=[{"type": "function", "function": {"description": "x"}}]),
        400,
    ),
    (
        "tool parameters not an object",
        "chat/completions",
        _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]),
        400,
    ),
    ("tool_choice without tools", "chat/completions", _chat(tool_choice="required"), 400),
    ("tool_choice unknown", "chat/completions", _chat(tools=[_TOOL], tool_choice="any"), 400),
    ("tool_choice a number", "chat/completions", _chat(tools=[_TOOL], tool_choice=3), 400),
    (
        "tool_choice names a missing tool",
        "chat/completions",
        _chat(tools=[_TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
        400,
    ),
    (
        "tool_choice without a function",
        "chat/completions",
        _chat(tools=[_TOOL], tool_choice={"type": "function"}),
        400,
    ),
    (
        "tool message without tool_call_id",
        "chat/completions",
        _chat([{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]),
        400,
    ),
    (
        "assistant tool call arguments not JSON",
        "chat/completions",
        _chat(
            [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}],
                },
            ]
        ),
        400,
    ),
    (
        "chat_template_kwargs sets messages",
        "chat/completions",
        _chat(chat_template_kwargs={"messages": []}),
        400,
    ),
    ("parallel_tool_calls not a bool", "chat/completions", _chat(parallel_tool_calls="maybe"), 400),
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


# cases whose message must name the field (or the bad token id)
NAMED = {
    "presence_penalty above 2": "presence_penalty",
    "repetition_penalty 0": "repetition_penalty",
    "logit_bias token past the vocabulary": "100000",
    "logit_bias key not a token id": "abc",
    "logit_bias above 100": "logit_bias",
    "allowed_token_ids empty": "allowed_token_ids",
    "allowed_token_ids past the vocabulary": "1000000000",
    "bad_words blank": "bad_words",
    "suffix": "suffix",
    "use_beam_search": "use_beam_search",
    "logits_processors": "logits_processors",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids",
    "truncate_prompt_tokens": "truncate_prompt_tokens",
    "chat echo": "echo",
    "tools with auto choice, no parser": "--enable-auto-tool-choice",
    "tool not a function": "tools[0].type",
    "tool_choice without tools": "tools",
    "tool_choice names a missing tool": "tool_choice",
    "tool message without tool_call_id": "tool_call_id",
    "assistant tool call arguments not JSON": "messages[1].tool_calls[0].function.arguments",
}


@pytest.mark.parametrize("name", list(NAMED))
def test_the_message_names_the_field(server, name):
    _, endpoint, body, _ = next(c for c in CASES if c[0] == name)
    msg = _post(server, endpoint, body).json()["error"]["message"]
    assert NAMED[name] in msg, msg


def test_sampling_fields_are_served(server):
    """logit_bias (string keys, as JSON has them) and allowed_token_ids act through the API; the
    other fields, neutral values of unsupported ones, and `user` are accepted."""
    force = dict(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)
    tokens = []
    for kw in (dict(logit_bias={"7": 100}), dict(allowed_token_ids=[7])):
        r = _post(server, "completions", _cmpl(**force, **kw))
        assert r.status_code == 200, r.text[:500]
        tokens.append(r.json()["choices"][0]["logprobs"]["tokens"])
    assert tokens[0] == tokens[1] == tokens[0][:1] * 4
    body = _chat(
        user="u1",
        presence_penalty=1.0,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        bad_words=["hello", "good day"],
        allowed_token_ids=list(range(100, 300)),
        logit_bias={"150": -5, "151": 2.5},
        min_p=0.1,
        use_beam_search=False,
        echo=False,
    )
    r = _post(server, "chat/completions", body)
    assert r.status_code == 200, r.text[:500]


def test_tools_served_without_the_auto_flags(server):
    """Without --enable-auto-tool-choice, tools are still served with tool_choice "none" (the
    text is returned as it is) and with a forced choice (decoded under the schema)."""
    r = _post(server, "chat/completions", _chat(tools=[_TOOL], tool_choice="none"))
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]
    named = {"type": "function", "function": {"name": "f"}}
    r = _post(server, "chat/completions", _chat(tools=[_TOOL], tool_choice=named, max_tokens=8))
    assert r.status_code == 200, r.text[:500]
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f"
    # completions take no tools: ignored there, as upstream, whatever they hold
    r = _post(server, "completions", _cmpl(tools=[{}], tool_choice="required"))
    assert r.status_code == 200, r.text[:500]


def test_every_counter_is_exported_from_start_up(tiny_ckpt):
    """Counters are present at 0 before anything increments them (a fresh server)."""
    with RemoteServer([tiny_ckpt, "--max-model-len", str(MAX_LEN)]) as s:
        text = requests.get(s.url + "/metrics").text
    for name in (
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:external_prefix_cache_hits_total",
        "vllm:external_prefix_cache_queries_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        'vllm:request_success_total{finished_reason="abort"',
        "vllm:e2e_request_latency_seconds_count",
    ):
        lines = [line for line in text.splitlines() if line.startswith(name)]
        assert lines and float(lines[0].split()[-1]) == 0.0, name
