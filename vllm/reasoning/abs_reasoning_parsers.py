"""The interface of a reasoning parser (one object per generated sequence, fed text deltas) and
the text helper the markup parsers share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class ReasoningParser(ABC):
    """Splits one sequence's text into reasoning and content as it is generated.

    `prompt` is the rendered chat prompt (the template may already have opened or closed the
    thinking block there); `chat_template_kwargs` are the request's (e.g. ``enable_thinking``).
    `feed` takes the next text delta and returns ``(reasoning, content)`` that can be emitted
    now: text that might still turn out to be part of a tag is held back. `finish` returns what
    was held back once the sequence ends. Feeding a text in any number of pieces and finishing
    gives the same concatenated reasoning and content."""

    def __init__(self, prompt: str, chat_template_kwargs: dict[str, Any] | None = None):
        self.prompt = prompt
        self.chat_template_kwargs = chat_template_kwargs or {}

    @abstractmethod
    def feed(self, delta: str) -> tuple[str, str]: ...

    @abstractmethod
    def finish(self) -> tuple[str, str]: ...

    def split(self, text: str) -> tuple[str | None, str | None]:
        """The whole text's reasoning and content, each None when empty."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return (r1 + r2) or None, (c1 + c2) or None


def partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`: text to hold
    back, since it may still become the tag when the next delta arrives."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
