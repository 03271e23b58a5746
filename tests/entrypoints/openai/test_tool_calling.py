"""Tool calling and reasoning through `vllm serve --enable-auto-tool-choice --tool-call-parser
glm47 --reasoning-parser glm45` with the real `openai` client, on the random-weight tiny model
and a GLM-style chat template. Where the test needs the model to write GLM markup, structured
outputs force that exact text (``{"choice": [TEXT]}``), so the whole path runs: template,
generation, reasoning split, tool-call parsing, streamed and not."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest
import requests

from tests.entrypoints.chat_templates import GLM_STYLE_TEMPLATE
from tests.utils import RemoteServer
from vllm.tokenizer import Tokenizer

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "tiny-glm-5.3"
CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Zürich", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city, e.g. Zürich (°C)",
        "parameters": CITY_SCHEMA,
    },
}
TIME_SCHEMA = {"type": "object", "properties": {}, "additionalProperties": False}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}}
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "Weather in Zürich?"}]
MARKUP = (
    "Zürich, 3 days.</think>Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>"
    "<arg_value>Zürich</arg_value>\n<arg_key>days</arg_key><arg_value>3</arg_value>\n"
    "</tool_call>\n<tool_call>get_time</tool_call>"
)


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    template = tmp_path_factory.mktemp("tmpl") / "glm_style.jinja"
    template.write_text(GLM_STYLE_TEMPLATE)
    args = [tiny_ckpt, "--served-model-name", MODEL, "--max-model-len", "2048"]
    args += ["--chat-template", str(template), "--enable-auto-tool-choice"]
    args += ["--tool-call-parser", "glm47", "--reasoning-parser", "glm45"]
    with RemoteServer(args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def _forced(text: str) -> dict:
    return {"structured_outputs": {"choice": [text]}}


def test_tools_and_history_are_rendered(server):
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 °C"},
    ]
    body = {"model": MODEL, "messages": history, "tools": TOOLS}
    r = requests.post(server.base_url + "/chat/completions/render", json=body)
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert json.dumps(WEATHER, ensure_ascii=False) in prompt  # tojson(ensure_ascii=False)
    assert (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich</arg_value></tool_call>"
        "<|observation|><tool_response>21 °C</tool_response><|assistant|><think>"
    ) in prompt
    without = requests.post(
        server.base_url + "/chat/completions/render", json={"model": MODEL, "messages": USER}
    ).json()
    assert len(r.json()["token_ids"]) > len(without["token_ids"]) + 50


def test_reasoning_and_tool_calls(client):
    r = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, max_tokens=400, temperature=0,
        extra_body=_forced(MARKUP),
    )  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.reasoning_content == "Zürich, 3 days."
    assert c.message.content == "Checking."
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
    assert calls == [("get_weather", {"city": "Zürich", "days": 3}), ("get_time", {})]
    assert all(t.id.startswith("call_") and t.type == "function" for t in c.message.tool_calls)


def test_streamed_reasoning_and_tool_calls_add_up(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, max_tokens=400, temperature=0,
            stream=True, extra_body=_forced(MARKUP),
        )
    )  # fmt: skip
    reasoning, content, calls, finish = "", "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        for t in d.tool_calls or ():
            call = calls.setdefault(t.index, {"id": t.id, "name": "", "arguments": ""})
            call["name"] += t.function.name or ""
            call["arguments"] += t.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert (reasoning, content, finish) == ("Zürich, 3 days.", "Checking.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Zürich", "days": 3}),
        ("get_time", {}),
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_without_markup_the_text_is_unchanged(server, client):
    """enable_thinking false: the template closes the thinking block, so the whole text is
    content, exactly what the same prompt gives through /v1/completions."""
    kw = dict(chat_template_kwargs={"enable_thinking": False})
    body = {"model": MODEL, "messages": USER, "tools": TOOLS, **kw}
    ids = requests.post(server.base_url + "/chat/completions/render", json=body).json()
    plain = client.completions.create(
        model=MODEL, prompt=ids["token_ids"], max_tokens=12, temperature=0
    ).choices[0]
    r = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, max_tokens=12, temperature=0, extra_body=kw
    )
    c = r.choices[0]
    assert "<tool_call>" not in plain.text and "</think>" not in plain.text
    assert c.message.content == (plain.text or None)
    assert c.message.tool_calls is None and c.message.reasoning_content is None
    assert c.finish_reason == plain.finish_reason
    # thinking on: the output starts inside the opened block, so it is all reasoning
    r = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, max_tokens=12, temperature=0
    )
    assert r.choices[0].message.content is None and r.choices[0].message.reasoning_content


def test_named_tool_choice(client):
    """The arguments are decoded under the tool's schema (constrained), whatever the weights."""
    done = 0
    for seed in range(4):
        r = client.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, max_tokens=120, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )  # fmt: skip
        c = r.choices[0]
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather" and c.message.content is None
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(call.function.arguments), CITY_SCHEMA)
            done += 1
    assert done >= 2


def test_required_tool_choice(client, tiny_ckpt):
    """A non-empty array of calls under the tools' schemas. A random model rarely closes the
    array (it may list calls until max_tokens); a bias on "]" closes it at the first place the
    grammar allows."""
    close = {str(Tokenizer(tiny_ckpt).encode("]", add_special_tokens=False)[0]): 30}
    for seed in range(2):
        kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=200, temperature=1.0)
        kw.update(seed=seed, tool_choice="required", logit_bias=close)
        c = client.chat.completions.create(**kw).choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        calls = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
        for name, args in calls:
            assert name in ("get_weather", "get_time")
            jsonschema.validate(args, CITY_SCHEMA if name == "get_weather" else TIME_SCHEMA)
        streamed, finish = {}, None
        for ch in client.chat.completions.create(stream=True, **kw):
            for t in ch.choices[0].delta.tool_calls or () if ch.choices else ():
                call = streamed.setdefault(t.index, ["", ""])
                call[0] += t.function.name or ""
                call[1] += t.function.arguments or ""
            finish = (ch.choices[0].finish_reason if ch.choices else None) or finish
        assert finish == "tool_calls"
        assert [(n, json.loads(a)) for n, a in streamed.values()] == calls


def test_unknown_parser_is_refused_at_start_up(tiny_ckpt):
    r = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", tiny_ckpt,
         "--tool-call-parser", "hermes"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "--tool-call-parser" in r.stderr and "glm47" in r.stderr
