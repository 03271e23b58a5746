"""`--tool-call-parser glm47`/`glm45` on GLM-style outputs written from the format's description:
the calls and content of whole texts, then the same texts streamed in random-sized pieces (a
tag may be cut anywhere), whose merged deltas must equal the whole-text result."""

from __future__ import annotations

import json
import random
import re

import pytest

from vllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, Glm4ToolParser, merge_deltas

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "zip": {"type": "string"},
                "metric": {"type": "boolean"},
                "note": {"type": ["string", "null"]},
                "unit": {"enum": ["C", "F"]},
            },
        },
    },
}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, SEARCH]


def _call(name: str, **pairs) -> str:
    """GLM-4.7/5.x markup: no newline after the name."""
    args = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in pairs.items())
    return f"<tool_call>{name}{args}</tool_call>"


NO_NAME = "<tool_call><arg_key>q</arg_key><arg_value>x</arg_value></tool_call>"
# (name, text, expected content, expected [(name, arguments as a dict)])
CASES = [
    ("no markup", "Hello there, no tools needed.", "Hello there, no tools needed.", []),
    ("empty", "", None, []),
    (
        "glm-4.5 layout: newlines after the name and between pairs",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        None,
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (
        "glm-4.7 layout: no newline",
        _call("get_weather", city="Paris", days=3),
        None,
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (
        "content before the call",
        "Let me look that up.\n\n" + _call("get_weather", city="Zürich"),
        "Let me look that up.",
        [("get_weather", {"city": "Zürich"})],
    ),
    (
        "several calls, whitespace between",
        "Checking both.\n"
        + _call("get_weather", city="Oslo")
        + "\n"
        + _call("search", q="fjords", limit=5)
        + "\n",
        "Checking both.",
        [("get_weather", {"city": "Oslo"}), ("search", {"q": "fjords", "limit": 5})],
    ),
    ("a call without arguments", _call("search"), None, [("search", {})]),
    (
        "schema: string-typed parameters stay strings",
        _call("get_weather", city="123", zip="01234", note="null", unit="C"),
        None,
        [("get_weather", {"city": "123", "zip": "01234", "note": None, "unit": "C"})],
    ),
    (
        "schema: a JSON-looking string for a string parameter",
        _call("get_weather", city='{"a": 1}'),
        None,
        [("get_weather", {"city": '{"a": 1}'})],
    ),
    (
        "schema: typed values parse; a value of the wrong type stays text",
        _call("get_weather", days="7", metric="true", note="7"),
        None,
        [("get_weather", {"days": 7, "metric": True, "note": "7"})],
    ),
    (
        "schema: an integer parameter given words",
        _call("get_weather", days="a week"),
        None,
        [("get_weather", {"days": "a week"})],
    ),
    (
        "no schema: JSON values, Python literals, text",
        _call(
            "search",
            n="2.5",
            flags="[1, 2]",
            opts='{"deep": true}',
            exact="True",
            q="plain words",
            none="null",
            big="1e999",
        ),
        None,
        [
            (
                "search",
                {
                    "n": 2.5,
                    "flags": [1, 2],
                    "opts": {"deep": True},
                    "exact": True,
                    "q": "plain words",
                    "none": None,
                    "big": "1e999",
                },
            )
        ],
    ),
    (
        "a tool not in tools is still a call",
        _call("unknown_tool", x="1"),
        None,
        [("unknown_tool", {"x": 1})],
    ),
    (
        "text after the calls is content",
        _call("search", q="x") + "\nDone.",
        "Done.",
        [("search", {"q": "x"})],
    ),
    (
        "multi-line string value kept verbatim",
        _call("search", q="line one\n  line two "),
        None,
        [("search", {"q": "line one\n  line two "})],
    ),
    # ---- malformed or unfinished markup: content, unchanged
    (
        "unfinished call at the end",
        "Sure. <tool_call>get_weather<arg_key>city</arg_key><arg_value>Par",
        "Sure. <tool_call>get_weather<arg_key>city</arg_key><arg_value>Par",
        [],
    ),
    (
        "a value never closed",
        "<tool_call>search<arg_key>q</arg_key><arg_value>x</tool_call>",
        "<tool_call>search<arg_key>q</arg_key><arg_value>x</tool_call>",
        [],
    ),
    (
        "text between the pairs",
        "<tool_call>search<arg_key>q</arg_key>oops<arg_value>x</arg_value></tool_call>",
        "<tool_call>search<arg_key>q</arg_key>oops<arg_value>x</arg_value></tool_call>",
        [],
    ),
    ("no name", NO_NAME, NO_NAME, []),
    (
        "an unclosed call before a good one",
        "<tool_call>search oops " + _call("search", q="y"),
        "<tool_call>search oops",
        [("search", {"q": "y"})],
    ),
    (
        "a partial tag in plain text",
        "a < b and <tool_ca",
        "a < b and <tool_ca",
        [],
    ),
    (
        "a good call, then an unfinished one",
        _call("search", q="1") + "<tool_call>search<arg_key>q",
        "<tool_call>search<arg_key>q",
        [("search", {"q": 1})],
    ),
]


def _check_calls(calls, expected):
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (n, a) for n, a in expected
    ]
    for c in calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) and c["type"] == "function"
    assert len({c["id"] for c in calls}) == len(calls)


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[c[0] for c in CASES])
def test_whole_text(name, text, content, calls):
    got_content, got_calls = Glm4ToolParser(TOOLS).extract(text)
    assert got_content == content
    _check_calls(got_calls, calls)


def _streamed(text: str, seed: int) -> list[dict]:
    rng = random.Random(seed)
    p, deltas, pos = Glm4ToolParser(TOOLS), [], 0
    while pos < len(text):
        n = rng.randint(1, 12)
        deltas += p.feed(text[pos : pos + n])
        pos += n
    return deltas + p.finish()


def _without_ids(calls):
    return [{**c, "id": None} for c in calls]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[c[0] for c in CASES])
def test_streamed_in_random_pieces_equals_whole(name, text, content, calls, seed):
    deltas = _streamed(text, seed)
    whole_content, whole_calls = Glm4ToolParser(TOOLS).extract(text)
    got_content, got_calls = merge_deltas(deltas)
    assert got_content == whole_content
    assert _without_ids(got_calls) == _without_ids(whole_calls)
    _check_calls(got_calls, calls)
    # upstream's delta shapes: a call opens with its id, type and name (no arguments), then
    # argument fragments carrying only the index
    seen = set()
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}) and d.get("content") != ""
        for tc in d.get("tool_calls", ()):
            if tc["index"] not in seen:
                seen.add(tc["index"])
                assert set(tc) == {"index", "id", "type", "function"}
                assert set(tc["function"]) == {"name"}
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}


def test_every_split_point_of_a_two_call_text():
    text = "Hi.\n" + _call("get_weather", city="Paris", days=2) + _call("search", q="x")
    want_content, want_calls = Glm4ToolParser(TOOLS).extract(text)
    for i in range(len(text) + 1):
        p = Glm4ToolParser(TOOLS)
        content, calls = merge_deltas([*p.feed(text[:i]), *p.feed(text[i:]), *p.finish()])
        assert content == want_content and _without_ids(calls) == _without_ids(want_calls), i


def test_a_call_is_sent_when_it_closes():
    """Content streams as it comes (minus a possible tag start); a call waits for its end."""
    p = Glm4ToolParser(TOOLS)
    assert p.feed("Sure, ") == [{"content": "Sure,"}]  # trailing space held (a call may follow)
    assert p.feed("checking <tool") == [{"content": " checking"}]
    assert p.feed("_call>get_weather<arg_key>city</arg_key>") == []
    out = p.feed("<arg_value>Rome</arg_value></tool_call>")
    assert [list(d) for d in out] == [["tool_calls"], ["tool_calls"]]
    assert out[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'
    assert p.finish() == []


def test_both_upstream_names_are_registered():
    assert TOOL_PARSERS["glm45"] is TOOL_PARSERS["glm47"] is Glm4ToolParser
