"""The request side of chat completions: the server's parser choice (`ChatParsers`, fixed at
start-up), the checks of ``messages``, ``tools`` and ``tool_choice`` as OpenAI and upstream vLLM
make them, and the messages and variables the chat template receives. Each user mistake is a
ValueError in the request's terms (a 400). Turning generated text into response bodies is
`chat_output.py`'s."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from vllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllm.reasoning import REASONING_PARSERS


@dataclass(frozen=True)
class ChatParsers:
    """`--enable-auto-tool-choice`, `--tool-call-parser`, `--reasoning-parser`,
    `--exclude-tools-when-tool-choice-none`; names already checked against the registries."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ChatParsers:
        tool = getattr(args, "tool_call_parser", None)
        reasoning = getattr(args, "reasoning_parser", None)
        auto = bool(getattr(args, "enable_auto_tool_choice", False))
        if tool is not None and tool not in TOOL_PARSERS:
            raise ValueError(
                f"--tool-call-parser {tool!r} is not one of {', '.join(sorted(TOOL_PARSERS))}"
            )
        if reasoning is not None and reasoning not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser {reasoning!r} is not one of "
                f"{', '.join(sorted(REASONING_PARSERS))}"
            )
        if auto and tool is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser to be set")
        return cls(
            tool, auto, reasoning, bool(getattr(args, "exclude_tools_when_tool_choice_none", False))
        )


def add_chat_parser_args(g) -> None:
    """The flags of `ChatParsers`, under upstream vLLM's names (an unknown parser name is refused
    by argparse, naming the flag)."""
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto": parse tool calls out of the text with --tool-call-parser',
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="the markup the model writes tool calls in (glm47: GLM-4.7/5.x, glm45: GLM-4.5/4.6)",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split <think>...</think> off the answer into reasoning_content",
    )
    g.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='do not render tools into the prompt when tool_choice is "none"',
    )


# ---- messages ------------------------------------------------------------------------------------
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_messages(messages) -> None:
    """Chat messages as OpenAI's API defines them: a role the template knows and content that is
    text or a list of text parts (None only for an assistant message that calls tools); a tool
    result names the call it answers (``tool_call_id``); an assistant's ``tool_calls`` name their
    function and give its arguments as a JSON object (or its text)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be an object with a 'role'")
        if m["role"] not in CHAT_ROLES:
            raise ValueError(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m['role']!r}"
            )
        if m["role"] == "tool" and not (
            isinstance(m.get("tool_call_id"), str) and m["tool_call_id"]
        ):
            raise ValueError(f"messages[{i}].tool_call_id is required in a tool message")
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise ValueError(f"messages[{i}].tool_calls is only allowed on assistant messages")
            _check_message_tool_calls(i, m["tool_calls"])
        _check_content(i, m)


def _check_content(i: int, m: dict) -> None:
    content = m.get("content")
    if content is None:
        if m["role"] == "assistant" and m.get("tool_calls"):
            return
        raise ValueError(f"messages[{i}].content is required")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ValueError(f"messages[{i}].content must be a string or a list of content parts")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise ValueError(
                f"messages[{i}].content[{j}] must be a text part ({{'type': 'text', "
                "'text': ...}}); other content types are not supported"
            )
        if not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{i}].content[{j}].text must be a string")


def _check_message_tool_calls(i: int, tool_calls) -> None:
    if not isinstance(tool_calls, list):
        raise ValueError(f"messages[{i}].tool_calls must be a list")
    for j, tc in enumerate(tool_calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{where} must be {{'function': {{'name': ..., 'arguments': ...}}}}")
        _template_arguments(where, fn.get("arguments"))


def _template_arguments(where: str, arguments) -> dict | list:
    """A call's arguments as the template iterates them (upstream passes a dict: the templates
    call ``.items()``), from OpenAI's JSON text."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, dict | list):
        return arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            value = None
        if isinstance(value, dict | list):
            return value
    raise ValueError(f"{where}.function.arguments must be a JSON object (as a string)")


def template_message(m: dict) -> dict:
    """A checked message as the chat template takes it: text parts joined by newlines into one
    string, tool-call arguments parsed into objects."""
    if isinstance(m.get("content"), list):
        m = {**m, "content": "\n".join(part["text"] for part in m["content"])}
    if m.get("tool_calls"):
        m = {
            **m,
            "tool_calls": [
                {
                    **tc,
                    "function": {
                        **tc["function"],
                        "arguments": _template_arguments("", tc["function"].get("arguments")),
                    },
                }
                for tc in m["tool_calls"]
            ],
        }
    return m


# ---- tools ---------------------------------------------------------------------------------------
_NAMED_USAGE = 'use {"type": "function", "function": {"name": "my_function"}}'


def check_tools(tools: list[dict] | None, tool_choice) -> None:
    """`tools` a list of ``{"type": "function", "function": {"name", "description"?,
    "parameters"?}}``; `tool_choice` ``"none"``, ``"auto"``, ``"required"`` or a function among
    `tools`, and only with `tools` (``"none"`` excepted)."""
    for i, t in enumerate(tools or ()):
        if t.get("type") != "function":
            raise ValueError(f"tools[{i}].type must be 'function', got {t.get('type')!r}")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"tools[{i}].function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name or any(c.isspace() or c in "<>" for c in name):
            raise ValueError(
                f"tools[{i}].function.name must be a non-empty string without whitespace, "
                f"'<' or '>', got {name!r}"
            )
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"tools[{i}].function.description must be a string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    if tool_choice is None or tool_choice == "none":
        return
    if tools is None:
        raise ValueError("When using `tool_choice`, `tools` must be set.")
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "required"):
            raise ValueError(
                f"Invalid value for `tool_choice`: {tool_choice!r}. Only named tools, "
                '"none", "auto" or "required" are supported.'
            )
        return
    fn = tool_choice.get("function")
    if tool_choice.get("type") != "function" or not isinstance(fn, dict):
        raise ValueError(f"Invalid value for `tool_choice`: {tool_choice!r}; {_NAMED_USAGE}")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"`tool_choice.function.name` must be a non-empty string; {_NAMED_USAGE}")
    if name not in [t["function"]["name"] for t in tools]:
        raise ValueError(
            f"The tool specified in `tool_choice` ({name!r}) does not match any of the "
            "specified `tools`"
        )


def effective_tool_choice(tools: list[dict] | None, tool_choice) -> str | dict:
    """`tool_choice` with OpenAI's defaults: "auto" when tools are given, else "none"; an empty
    `tools` makes "required" "none" (as upstream)."""
    if not tools:
        return "none"
    return "auto" if tool_choice is None else tool_choice


def check_tool_choice_served(tool_choice, parsers: ChatParsers) -> None:
    if tool_choice == "auto" and not parsers.enable_auto_tool_choice:
        raise ValueError(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        )


# variables the server sets; chat_template_kwargs may set any other
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt", "chat_template"})


def template_kwargs(
    tools: list[dict] | None, tool_choice, chat_template_kwargs: dict[str, Any] | None, parsers
) -> dict[str, Any]:
    """The template's variables besides the messages: ``tools`` (None when there are none, or
    when ``tool_choice`` is "none" under --exclude-tools-when-tool-choice-none) and the request's
    ``chat_template_kwargs`` (e.g. ``enable_thinking``)."""
    kw = dict(chat_template_kwargs or {})
    bad = sorted(_RESERVED_TEMPLATE_VARS & set(kw))
    if bad:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(bad)}")
    exclude = tool_choice == "none" and parsers.exclude_tools_when_tool_choice_none
    kw["tools"] = None if exclude or not tools else tools
    return kw
