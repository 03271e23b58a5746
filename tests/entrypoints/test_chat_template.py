"""Chat templates render in the environment real GLM templates are written against (HF's):
``tojson`` with ``json.dumps``'s keywords and no HTML escaping, ``raise_exception``, loop
controls, ``{% do %}``; the request's tools and tool calls reach the template as it expects them
(arguments as objects)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.entrypoints.chat_templates import GLM_STYLE_TEMPLATE
from vllm.entrypoints.openai.chat_utils import ChatParsers, template_kwargs, template_message
from vllm.tokenizer import Tokenizer

ASSETS = Path(__file__).resolve().parents[2] / "vllm/model_executor/tiny/assets"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city, e.g. Zürich (never <0 K)",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich and Bern?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "reasoning_content": "Two calls.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "days": 2}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Bern"}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "sunny"}]},
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(str(ASSETS), chat_template=GLM_STYLE_TEMPLATE)


def _render(tok, messages, tools=None, tool_choice="auto", **kwargs):
    kw = template_kwargs(tools, tool_choice, kwargs, ChatParsers())
    return tok.apply_chat_template([template_message(m) for m in messages], **kw)


def test_glm_style_conversation_with_tools(tok):
    got = _render(tok, CONVERSATION, tools=[WEATHER])
    assert got == (
        "[gMASK]<sop><|system|>\n# Functions\nYou may call the functions below. Each is one JSON "
        'object:\n{"type": "function", "function": {"name": "get_weather", "description": '
        '"Weather in a city, e.g. Zürich (never <0 K)", "parameters": {"type": "object", '
        '"properties": {"city": {"type": "string"}}}}}\nCall one as <tool_call>NAME<arg_key>KEY'
        "</arg_key><arg_value>VALUE</arg_value></tool_call>.<|system|>\nBe brief.<|user|>\n"
        "Weather in Zürich and Bern?<|assistant|><think>Two calls.</think>Checking."
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich</arg_value><arg_key>days"
        "</arg_key><arg_value>2</arg_value></tool_call><tool_call>get_weather<arg_key>city"
        "</arg_key><arg_value>Bern</arg_value></tool_call><|observation|><tool_response>"
        '{"temp": 21}</tool_response><tool_response>sunny</tool_response><|assistant|><think>'
    )


def test_enable_thinking_false_closes_the_block(tok):
    got = _render(tok, CONVERSATION[:2], enable_thinking=False)
    assert got.endswith("Weather in Zürich and Bern?<|assistant|></think>")
    assert "# Functions" not in got  # no tools, no tools section


def test_tools_left_out_when_tool_choice_none_if_the_server_says_so(tok):
    msgs = CONVERSATION[:2]
    assert "get_weather" in _render(tok, msgs, tools=[WEATHER], tool_choice="none")
    kw = template_kwargs(
        [WEATHER], "none", None, ChatParsers(exclude_tools_when_tool_choice_none=True)
    )
    assert "get_weather" not in tok.apply_chat_template(msgs, **kw)


def test_raise_exception_is_a_400_message(tok):
    with pytest.raises(ValueError, match="chat template failed: unknown role wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])


@pytest.mark.parametrize(
    "template,want",
    [
        ("{{ x | tojson }}", '{"b": [1, 2], "a": "é<>&"}'),
        ("{{ x | tojson(ensure_ascii=True) }}", '{"b": [1, 2], "a": "\\u00e9<>&"}'),
        ("{{ x | tojson(sort_keys=True) }}", '{"a": "é<>&", "b": [1, 2]}'),
        ("{{ x | tojson(separators=(',', ':')) }}", '{"b":[1,2],"a":"é<>&"}'),
        ("{{ x.b | tojson(indent=2) }}", "[\n  1,\n  2\n]"),
        (
            "{% for i in [1, 2, 3] %}{% if i == 2 %}{% continue %}{% endif %}{{ i }}{% endfor %}",
            "13",
        ),
        ("{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}", "1"),
        ("{% set ns = namespace(n=0) %}{% do ns.n %}{% set ns.n = ns.n + 1 %}{{ ns.n }}", "1"),
        ("{{ strftime_now('%Y') | length }}", "4"),
    ],
)
def test_template_environment(tok, template, want):
    assert tok.apply_chat_template([], chat_template=template, x={"b": [1, 2], "a": "é<>&"}) == want


def test_tojson_of_an_undefined_value_is_a_400_message(tok):
    with pytest.raises(ValueError, match="chat template failed"):
        tok.apply_chat_template([], chat_template="{{ nothing | tojson }}")


@pytest.mark.parametrize(
    "arguments,want",
    [('{"a": 1}', {"a": 1}), ("", {}), (None, {}), ({"a": 1}, {"a": 1})],
)
def test_tool_call_arguments_reach_the_template_as_objects(arguments, want):
    m = {"role": "assistant", "content": None}
    m["tool_calls"] = [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    ]
    assert template_message(m)["tool_calls"][0]["function"]["arguments"] == want
