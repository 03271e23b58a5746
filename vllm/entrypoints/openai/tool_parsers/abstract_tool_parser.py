"""The interface of a tool-call parser, and the OpenAI delta shapes both directions share."""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod


def make_tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class ToolParser(ABC):
    """Finds tool calls in one sequence's content as it is generated.

    `tools` is the request's (validated) list, whose parameter schemas may decide how an argument
    is typed. `feed` takes the next text delta and returns the chat-completion deltas that can be
    sent now, each ``{"content": str}`` or ``{"tool_calls": [one delta tool call]}``: a call's
    first delta carries ``index``, ``id``, ``type`` and ``function.name``; the following ones
    ``index`` and an ``function.arguments`` fragment, the fragments of one call concatenating to
    a JSON object. `finish` returns what was held back when the sequence ends. Feeding a text in
    any number of pieces gives the same deltas once merged (`merge_deltas`)."""

    def __init__(self, tools: list[dict]):
        self.tools = tools

    @abstractmethod
    def feed(self, delta: str) -> list[dict]: ...

    @abstractmethod
    def finish(self) -> list[dict]: ...

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        """The whole text's content (None when empty) and tool calls."""
        return merge_deltas([*self.feed(text), *self.finish()])


def merge_deltas(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    """Content and complete tool calls from a sequence of content and tool-call deltas."""
    content, calls = [], {}
    for d in deltas:
        content.append(d.get("content") or "")
        for tc in d.get("tool_calls") or ():
            fn = tc.get("function", {})
            call = calls.setdefault(
                tc["index"],
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            call["id"] = tc.get("id") or call["id"]
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""
    return "".join(content) or None, [calls[i] for i in sorted(calls)]
