"""The serving glue of tool calls and reasoning: `OpenAIServing.chat` (the function behind
/v1/chat/completions) on a fake engine that "generates" a given text, streamed in random pieces
or whole, so every path of the response building runs on chosen text (a random-weight model
would never write the markup). Streaming must add up to the non-streaming message."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.entrypoints.chat_templates import GLM_STYLE_TEMPLATE
from vllm.entrypoints.openai.chat_utils import ChatParsers
from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.serving import OpenAIServing
from vllm.sampling_params import RequestOutputKind
from vllm.tokenizer import Tokenizer

ASSETS = Path(__file__).resolve().parents[3] / "vllm/model_executor/tiny/assets"
FULL = ChatParsers("glm47", True, "glm45")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "Weather in Paris?"}]


class FakeEngine:
    """Generates `texts[i]` for choice i: in random pieces (streaming) or whole."""

    def __init__(self, texts: list[str], seed: int = 0, finish: str = "stop"):
        self.tokenizer = Tokenizer(str(ASSETS), chat_template=GLM_STYLE_TEMPLATE)
        self.texts, self.rng, self.finish = texts, random.Random(seed), finish
        self.prompts = []

    def add(self, p, params, request_id, kv_transfer_params=None):
        self.prompts.append(p.prompt)
        return params

    def cancel(self, h):
        pass

    async def iterate(self, params):
        if params.output_kind == RequestOutputKind.FINAL_ONLY:
            for i, t in enumerate(self.texts):
                yield i, _output(t, self.finish)
            return
        queues = []
        for t in self.texts:
            cuts = sorted({0, len(t), *(self.rng.randint(0, len(t)) for _ in range(len(t) // 4))})
            queues.append([t[a:b] for a, b in zip(cuts, cuts[1:], strict=False)])
        while any(queues):  # the choices interleave at random, each in its own order
            i = self.rng.choice([j for j, q in enumerate(queues) if q])
            yield i, _output(queues[i].pop(0), None)
        for i in range(len(self.texts)):
            yield i, _output("", self.finish)


def _output(text: str, finish: str | None):
    c = SimpleNamespace(
        text=text, token_ids=[1], logprobs=None, finish_reason=finish, stop_reason=None
    )
    return SimpleNamespace(
        outputs=[c], num_cached_tokens=0, prompt_logprobs=None, kv_transfer_params=None
    )


def _chat(engine, parsers, stream: bool, **body):
    serving = OpenAIServing(engine, "m", False, parsers)
    req = ChatCompletionRequest.model_validate({"messages": USER, **body})

    async def run():
        r = await serving.chat(req, "rid", stream)
        if not stream:
            return r
        return [json.loads(e[6:]) for e in [x async for x in r] if e != "data: [DONE]\n\n"]

    return asyncio.run(run())


def _merge(events: list[dict]) -> dict[int, dict]:
    """The streamed chunks as non-streaming choices (message and finish_reason)."""
    out: dict[int, dict] = {}
    for ev in events:
        for ch in ev["choices"]:
            m = out.setdefault(ch["index"], {"parts": {}, "calls": {}, "finish_reason": None})
            d = ch["delta"]
            for k in ("reasoning_content", "content"):
                if d.get(k):
                    m["parts"][k] = m["parts"].get(k, "") + d[k]
            for tc in d.get("tool_calls", ()):
                call = m["calls"].setdefault(tc["index"], {"name": "", "arguments": ""})
                if "id" in tc:
                    assert not call["name"] and tc["type"] == "function", "a call opens once"
                call["name"] += tc["function"].get("name", "")
                call["arguments"] += tc["function"].get("arguments", "")
            if ch["finish_reason"] is not None:
                m["finish_reason"] = ch["finish_reason"]
    return out


def _calls(message: dict) -> list[dict]:
    return [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message.get("tool_calls", [])
    ]


def _check_stream_matches(texts, parsers, seeds=range(4), **body) -> list[dict]:
    """Non-streaming choices; for each seed the streamed chunks must add up to them."""
    full = _chat(FakeEngine(texts), parsers, False, **body)["choices"]
    for seed in seeds:
        merged = _merge(_chat(FakeEngine(texts, seed), parsers, True, **body))
        for ch in full:
            m = merged[ch["index"]]
            msg = ch["message"]
            for k in ("reasoning_content", "content"):
                assert m["parts"].get(k) == msg.get(k), (seed, k)
            assert [m["calls"][i] for i in sorted(m["calls"])] == _calls(msg), seed
            assert m["finish_reason"] == ch["finish_reason"], seed
    return full


THINK_AND_CALL = (
    "The user wants Paris.</think>Let me check.\n"
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n"
    "<tool_call>get_time</tool_call>"
)


def test_reasoning_then_two_calls():
    (ch,) = _check_stream_matches([THINK_AND_CALL], FULL, tools=TOOLS)
    msg = ch["message"]
    assert msg["reasoning_content"] == "The user wants Paris."
    assert msg["content"] == "Let me check."
    assert _calls(msg) == [
        {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
        {"name": "get_time", "arguments": "{}"},
    ]
    assert ch["finish_reason"] == "tool_calls"
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in msg["tool_calls"])


def test_no_markup_keeps_the_text_and_has_no_tool_calls():
    text = "It is sunny in Paris < 30°C."
    (ch,) = _check_stream_matches(
        [text], FULL, tools=TOOLS, chat_template_kwargs={"enable_thinking": False}
    )
    assert ch["message"] == {"role": "assistant", "content": text, "reasoning_content": None}
    assert ch["finish_reason"] == "stop"


def test_without_parsers_the_message_is_the_text():
    text = "<think>x</think><tool_call>get_time</tool_call>"
    (ch,) = _check_stream_matches([text], ChatParsers())
    assert ch["message"] == {"role": "assistant", "content": text}


def test_tool_choice_none_parses_reasoning_only():
    (ch,) = _check_stream_matches([THINK_AND_CALL], FULL, tools=TOOLS, tool_choice="none")
    assert ch["message"]["reasoning_content"] == "The user wants Paris."
    assert ch["message"]["content"].startswith("Let me check.\n<tool_call>get_weather")
    assert "tool_calls" not in ch["message"] and ch["finish_reason"] == "stop"


def test_unfinished_call_cut_by_length_is_content():
    text = "hm</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Pa"
    engine = FakeEngine([text], finish="length")
    (ch,) = _chat(engine, FULL, False, tools=TOOLS)["choices"]
    assert ch["message"]["content"] == "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Pa"
    assert ch["finish_reason"] == "length" and "tool_calls" not in ch["message"]


def test_parallel_tool_calls_false_keeps_the_first():
    (ch,) = _check_stream_matches([THINK_AND_CALL], FULL, tools=TOOLS, parallel_tool_calls=False)
    assert [c["name"] for c in _calls(ch["message"])] == ["get_weather"]


def test_n_choices_interleaved():
    texts = [THINK_AND_CALL, "plain</think>answer", "no end tag, all reasoning"]
    chs = _check_stream_matches(texts, FULL, tools=TOOLS, n=3)
    assert [c["finish_reason"] for c in chs] == ["tool_calls", "stop", "stop"]
    assert chs[1]["message"]["content"] == "answer"
    assert chs[2]["message"] == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "no end tag, all reasoning",
    }


def test_named_tool_choice_streams_arguments():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    text = '{"city": "Paris", "days": 2}'
    (ch,) = _check_stream_matches([text], FULL, tools=TOOLS, tool_choice=choice)
    assert _calls(ch["message"]) == [{"name": "get_weather", "arguments": text}]
    assert ch["message"]["content"] is None and ch["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "text,calls,content",
    [
        (
            '[{"name": "get_time", "parameters": {}}, '
            '{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
            [
                {"name": "get_time", "arguments": "{}"},
                {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            ],
            None,
        ),
        ('[{"name": "get_ti', [], '[{"name": "get_ti'),  # cut by max_tokens
    ],
)
def test_required_tool_choice(text, calls, content):
    # the forced JSON comes from the grammar, whatever the server's parsers
    for parsers in (FULL, ChatParsers()):
        (ch,) = _check_stream_matches([text], parsers, tools=TOOLS, tool_choice="required")
        assert _calls(ch["message"]) == calls and ch["message"]["content"] == content
        assert ch["finish_reason"] == ("tool_calls" if calls else "stop")


def test_the_prompt_gets_tools_and_template_kwargs():
    engine = FakeEngine(["x"])
    _chat(engine, FULL, False, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    assert '{"type": "function", "function": {"name": "get_weather"' in engine.prompts[0]
    assert engine.prompts[0].endswith("<|assistant|></think>")


@pytest.mark.parametrize(
    "parsers,body,message",
    [
        (ChatParsers(), dict(tools=TOOLS), '"auto" tool choice requires --enable-auto-tool-choice'),
        (ChatParsers(), dict(tools=TOOLS, tool_choice="auto"), "--tool-call-parser"),
        (FULL, dict(tool_choice="required"), "`tools` must be set"),
        (FULL, dict(tools=TOOLS, tool_choice="sometimes"), "Invalid value for `tool_choice`"),
        (
            FULL,
            dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
            "does not match any of the specified `tools`",
        ),
        (FULL, dict(tools=TOOLS, tool_choice={"function": {"name": "get_time"}}), "tool_choice"),
        (FULL, dict(tools=[{"type": "retrieval"}]), "tools[0].type must be 'function'"),
        (FULL, dict(tools=[{"type": "function", "function": {}}]), "tools[0].function.name"),
        (
            FULL,
            dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
            "tools[0].function.parameters must be a JSON schema object",
        ),
        (FULL, dict(chat_template_kwargs={"tools": []}), "chat_template_kwargs may not set tools"),
    ],
)
def test_bad_tools_are_value_errors(parsers, body, message):
    with pytest.raises(ValueError) as e:
        _chat(FakeEngine(["x"]), parsers, False, **body)
    assert message in str(e.value)


def test_tool_messages_round_trip():
    """A tool result and the assistant's call it answers are accepted and rendered."""
    engine = FakeEngine(["ok"])
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    serving = OpenAIServing(engine, "m", False, FULL)
    req = ChatCompletionRequest.model_validate({"messages": history, "tools": TOOLS})
    prompt = serving.chat_prompt(req).prompt
    assert (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
        "<|observation|><tool_response>sunny</tool_response>" in prompt
    )
    for bad, message in [
        ({"role": "tool", "content": "sunny"}, "messages[1].tool_call_id is required"),
        (
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}],
            },
            "messages[1].tool_calls[0].function.arguments must be a JSON object",
        ),
        ({"role": "user", "content": "x", "tool_calls": []}, "only allowed on assistant"),
    ]:
        req = ChatCompletionRequest.model_validate({"messages": [USER[0], bad]})
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            serving.chat_prompt(req)
