"""`--reasoning-parser glm45`: where the thinking starts (the prompt's generation prompt, or the
output's own ``<think>``), where it ends, and the same split however the text is streamed."""

from __future__ import annotations

import pytest

from vllm.reasoning import REASONING_PARSERS, Glm45ReasoningParser

OPENED = "<|user|>\nhi<|assistant|><think>"  # GLM-4.7/5.x: the template opens the block
CLOSED = "<|user|>\nhi<|assistant|></think>"  # ... and closes it with enable_thinking false
CLOSED_45 = "<|user|>\nhi<|assistant|>\n<think></think>"  # GLM-4.5's closed block
NEUTRAL = "<|user|>\nhi<|assistant|>"  # GLM-4.5 with thinking: the output opens it

# (name, prompt, chat_template_kwargs, output, reasoning, content)
CASES = [
    (
        "opened in the prompt",
        OPENED,
        None,
        "Let me see.</think>It is 4.",
        "Let me see.",
        "It is 4.",
    ),
    ("opened, with newlines", OPENED + "\n", None, "\nhm\n</think>\n\n4", "\nhm\n", "\n\n4"),
    (
        "opened, never closed",
        OPENED,
        None,
        "thinking until max_tokens",
        "thinking until max_tokens",
        None,
    ),
    ("opened, closed at once", OPENED, None, "</think>Just 4.", None, "Just 4."),
    ("opened, a partial end tag at the end", OPENED, None, "hmm </thi", "hmm </thi", None),
    ("output opens it", NEUTRAL, None, "<think>a</think>b", "a", "b"),
    ("output opens it after whitespace", NEUTRAL, None, "\n <think>a</think>b", "a", "b"),
    ("output without the tag: content", NEUTRAL, None, "just an answer", None, "just an answer"),
    ("output with a stray end tag: content", NEUTRAL, None, "x</think>y", None, "x</think>y"),
    ("output: a partial start tag only", NEUTRAL, None, " <thi", None, " <thi"),
    ("output: blank", NEUTRAL, None, "\n\n", None, "\n\n"),
    ("closed by the template", CLOSED, None, "<think>a</think>b", None, "<think>a</think>b"),
    ("closed by GLM-4.5's template", CLOSED_45, None, "answer", None, "answer"),
    ("enable_thinking false", OPENED, {"enable_thinking": False}, "a</think>b", None, "a</think>b"),
    ("enable_thinking true", NEUTRAL, {"enable_thinking": True}, "<think>a</think>b", "a", "b"),
    (
        "a second block stays content",
        OPENED,
        None,
        "a</think>b<think>c</think>",
        "a",
        "b<think>c</think>",
    ),
    (
        "tool-call markup after thinking",
        OPENED,
        None,
        "plan</think><tool_call>f</tool_call>",
        "plan",
        "<tool_call>f</tool_call>",
    ),
    ("empty output", OPENED, None, "", None, None),
]
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("name,prompt,kwargs,text,reasoning,content", CASES, ids=IDS)
def test_whole_text(name, prompt, kwargs, text, reasoning, content):
    assert Glm45ReasoningParser(prompt, kwargs).split(text) == (reasoning, content)


def _stream(prompt, kwargs, pieces) -> tuple[str, str, list[tuple[str, str]]]:
    p = Glm45ReasoningParser(prompt, kwargs)
    outs = [p.feed(x) for x in pieces] + [p.finish()]
    return "".join(r for r, _ in outs), "".join(c for _, c in outs), outs


@pytest.mark.parametrize("name,prompt,kwargs,text,reasoning,content", CASES, ids=IDS)
def test_split_at_every_position(name, prompt, kwargs, text, reasoning, content):
    for i in range(len(text) + 1):
        r, c, _ = _stream(prompt, kwargs, [text[:i], text[i:]])
        assert (r or None, c or None) == (reasoning, content), i


@pytest.mark.parametrize("name,prompt,kwargs,text,reasoning,content", CASES, ids=IDS)
def test_one_character_at_a_time(name, prompt, kwargs, text, reasoning, content):
    r, c, outs = _stream(prompt, kwargs, list(text))
    assert (r or None, c or None) == (reasoning, content)
    # reasoning never follows content: the deltas come in the response's order
    first_content = next((i for i, (_, c) in enumerate(outs) if c), len(outs))
    assert not any(r for r, _ in outs[first_content + 1 :])


def test_reasoning_streams_before_the_end_tag():
    p = Glm45ReasoningParser(OPENED)
    assert p.feed("step one, ") == ("step one, ", "")
    assert p.feed("step two </th") == ("step two ", "")  # a possible tag start is held
    assert p.feed("ink>\nAnswer") == ("", "\nAnswer")
    assert p.finish() == ("", "")


def test_registered_under_upstreams_name():
    assert REASONING_PARSERS["glm45"] is Glm45ReasoningParser
