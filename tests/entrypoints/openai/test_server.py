"""The real `openai` client against a live `vllm serve` on 127.0.0.1 (tiny checkpoint)."""

from __future__ import annotations

import asyncio

import openai
import pytest
import requests

from tests.utils import RemoteServer

KEY = "test-key"
MODEL = "tiny-glm-5.3"
MAX_LEN = 512


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    with RemoteServer(
        [
            tiny_ckpt,
            "--served-model-name",
            MODEL,
            "--api-key",
            KEY,
            "--enable-prompt-tokens-details",
            "--max-model-len",
            str(MAX_LEN),
        ]
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)


def render(server, prompt) -> list[int]:
    r = requests.post(
        server.base_url + "/completions/render",
        json={"model": MODEL, "prompt": prompt},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 200
    return r.json()[0]["token_ids"]  # upstream's schema: one GenerateRequest per prompt


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert requests.get(server.url + "/health").status_code == 200


def test_completion_and_usage(server, client):
    r = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0
    )
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.prompt_tokens == len(render(server, "The quick brown fox"))
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completion_stream_matches_non_stream(client):
    kw = dict(model=MODEL, prompt="Streaming test", max_tokens=15, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage.completion_tokens == 15 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_and_non_stream(server, client):
    msgs = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    chat_ids = requests.post(
        server.base_url + "/chat/completions/render",
        json={"model": MODEL, "messages": msgs},
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()["token_ids"]
    assert r.usage.prompt_tokens == len(chat_ids)
    s = list(
        client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=10, temperature=0, stream=True
        )
    )
    assert s[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in s) == r.choices[0].message.content


def test_token_id_prompt_and_max_completion_tokens(client):
    r = client.completions.create(
        model=MODEL,
        prompt=[10, 20, 30, 40],
        max_tokens=50,
        temperature=0,
        extra_body={"max_completion_tokens": 3},
    )
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 3


def test_stop_string(client):
    base = (
        client.completions.create(model=MODEL, prompt="Stop here", max_tokens=20, temperature=0)
        .choices[0]
        .text
    )
    stop = base[5:8]
    assert stop
    r = client.completions.create(
        model=MODEL, prompt="Stop here", max_tokens=20, temperature=0, stop=[stop]
    )
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.text == base[: base.index(stop)]
    assert c.model_extra["stop_reason"] == stop


def test_min_tokens_and_ignore_eos_extra_fields(client):
    r = client.completions.create(
        model=MODEL,
        prompt=[5, 6, 7],
        max_tokens=6,
        temperature=0,
        extra_body={"min_tokens": 6, "ignore_eos": True},
    )
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"


def test_logprobs(client):
    r = client.completions.create(
        model=MODEL, prompt="Logprobs", max_tokens=5, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5
    for _tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert val <= 0 and len(top) >= 3
        assert val == pytest.approx(max(top.values()))  # greedy picks the top token
    c = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(c.choices[0].logprobs.content) == 3
    assert len(c.choices[0].logprobs.content[0].top_logprobs) == 2


def test_prompt_logprobs(server):
    r = requests.post(
        server.base_url + "/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "prompt": [11, 12, 13, 14], "max_tokens": 1, "prompt_logprobs": 1},
    )
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 4
    for pos, entry in enumerate(plp[1:], start=1):
        assert str([11, 12, 13, 14][pos]) in entry  # the actual prompt token is reported


def test_seed_reproducible_and_n(client):
    kw = dict(model=MODEL, prompt="Seeded", max_tokens=12, temperature=1.0, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    c = client.completions.create(**{**kw, "seed": 99}).choices[0].text
    assert a == b and a != c
    r = client.completions.create(n=3, **kw)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    assert r.choices[0].text == a  # child 0 keeps the seed; the others use seed+i
    assert len({ch.text for ch in r.choices}) > 1
    assert r.usage.completion_tokens == 36


def test_cached_prefix_reported(client):
    prompt = list(range(100, 300))  # 200 tokens: three full 64-token blocks
    r1 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    r2 = client.completions.create(model=MODEL, prompt=prompt + [7], max_tokens=2, temperature=0)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.usage.prompt_tokens_details.cached_tokens == 192


def test_x_request_id_and_unknown_fields(server):
    r = requests.post(
        server.base_url + "/completions",
        headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "abc-123"},
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "some_future_field": {"x": 1}},
    )
    assert r.status_code == 200
    assert r.json()["id"] == "cmpl-abc-123" and r.headers["X-Request-Id"] == "abc-123"


BAD = [
    ("malformed json", dict(data=b"{not json"), 400),
    ("negative max_tokens", dict(json={"model": MODEL, "prompt": "x", "max_tokens": -1}), 400),
    (
        "prompt over max-model-len",
        dict(json={"model": MODEL, "prompt": [1] * (MAX_LEN + 5), "max_tokens": 1}),
        400,
    ),
    ("unknown model", dict(json={"model": "nope", "prompt": "x"}), 404),
    (
        "token id out of vocabulary",
        dict(json={"model": MODEL, "prompt": [1, 999999], "max_tokens": 1}),
        400,
    ),
    ("n = 0", dict(json={"model": MODEL, "prompt": "x", "n": 0}), 400),
    ("bad temperature type", dict(json={"model": MODEL, "prompt": "x", "temperature": "hot"}), 400),
]


@pytest.mark.parametrize("name,kw,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_4xx_and_server_stays_healthy(server, name, kw, code):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = requests.post(server.base_url + "/completions", headers=h, **kw)
    assert r.status_code == code, r.text
    assert r.json()["error"]["message"]
    assert requests.get(server.url + "/health").status_code == 200
    ok = requests.post(
        server.base_url + "/completions",
        headers=h,
        json={"model": MODEL, "prompt": "ok", "max_tokens": 2},
    )
    assert ok.status_code == 200


def test_api_key_enforced(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = requests.post(
            server.base_url + "/completions", headers=headers, json={"model": MODEL, "prompt": "x"}
        )
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert requests.get(server.base_url + "/models").status_code == 401
    assert requests.get(server.url + "/health").status_code == 200  # /health needs no key


def test_64_concurrent_streams_and_kv_usage_returns_to_zero(server):
    aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)

    async def one(i):
        n = 0
        stream = await aclient.completions.create(
            model=MODEL,
            prompt=f"client {i} says",
            max_tokens=8 + i % 5,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        async for ch in stream:
            if ch.usage is not None:
                usage = ch.usage
            n += 1
        return usage.completion_tokens

    async def main():
        return await asyncio.gather(*[one(i) for i in range(64)])

    counts = asyncio.run(main())
    assert counts == [8 + i % 5 for i in range(64)]
    metrics = requests.get(server.url + "/metrics").text
    usage = [line for line in metrics.splitlines() if line.startswith("vllm:kv_cache_usage_perc")]
    assert usage and float(usage[0].split()[-1]) == 0.0
    running = [
        line for line in metrics.splitlines() if line.startswith("vllm:num_requests_running")
    ]
    assert float(running[0].split()[-1]) == 0.0
    for name in (
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:prefix_cache_queries_total",
        "vllm:generation_tokens_total",
        "vllm:inter_token_latency_seconds_count",
    ):
        assert name in metrics


def _greedy_streams(server, prompts, reset_calls: int = 0):
    """Stream every prompt greedily at once; meanwhile POST /reset_prefix_cache `reset_calls`
    times. Returns (the answers' texts, the reset replies' status codes)."""
    aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)

    async def one(prompt):
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    def reset():
        r = requests.post(
            server.url + "/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"}
        )
        return r.status_code, r.json()

    async def resets():
        codes = []
        for _ in range(reset_calls):
            codes.append(await asyncio.to_thread(reset))
            await asyncio.sleep(0.02)
        return codes

    async def main():
        return await asyncio.gather(asyncio.gather(*[one(p) for p in prompts]), resets())

    return asyncio.run(main())


def test_reset_prefix_cache_during_streams_leaves_answers_unchanged(server):
    """The reset's reply is routed by call id through the engine client's one output reader, so
    32 concurrent greedy streams come back exactly as without it (a second reader on the socket
    used to reorder, drop or lose their tokens)."""
    prompts = [f"stream {i}: a shared prefix that the prefix cache keeps. " * 3 for i in range(32)]
    want, _ = _greedy_streams(server, prompts)
    got, replies = _greedy_streams(server, prompts, reset_calls=20)
    assert got == want
    assert len(replies) == 20 and all(code == 200 for code, _ in replies)
    assert all(isinstance(body["reset"], bool) for _, body in replies)
    idle = requests.post(
        server.url + "/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert idle.json() == {"reset": True}  # nothing running: every cached block can go


def test_admin_endpoint_needs_the_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = requests.post(server.url + "/reset_prefix_cache", headers=headers)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]


def _running(server) -> float:
    text = requests.get(server.url + "/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("vllm:num_requests_running"))
    return float(line.split()[-1])


def _long_body(stream: bool) -> dict:
    return {"model": MODEL, "prompt": "a long answer", "max_tokens": MAX_LEN - 16, "stream": stream,
            "temperature": 0, "ignore_eos": True}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_client_disconnect_aborts_within_two_seconds(server, stream):
    """A client that leaves mid-request frees its seat: the running gauge is back at 0 within
    2 s (the engine reports stats after the abort; a non-streaming request notices the
    disconnect within DISCONNECT_POLL_S)."""
    import time

    h = {"Authorization": f"Bearer {KEY}"}
    url = server.base_url + "/completions"
    if stream:
        with requests.post(url, json=_long_body(True), headers=h, stream=True) as r:
            lines = r.iter_lines()
            assert next(lines)  # the first event arrived: the request is running
            assert _running(server) == 1.0
    else:
        with pytest.raises(requests.Timeout):
            requests.post(url, json=_long_body(False), headers=h, timeout=1.0)
    left = time.monotonic()
    while _running(server) != 0.0:
        assert time.monotonic() - left < 2.0, "the request kept running after its client left"
        time.sleep(0.05)
