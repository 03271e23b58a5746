"""`--reasoning-parser glm45`: GLM-4.5 to 5.x think in ``<think>…</think>`` before answering.

Where the sequence starts is read from the rendered prompt: GLM-4.7/5.x templates open the block
themselves (the prompt ends with ``<think>``, the output starts inside the reasoning without the
tag), and with ``enable_thinking: false`` they close it (the prompt ends with ``</think>`` or
``<think></think>``: everything generated is content). Otherwise (GLM-4.5) the output says so
itself: it is reasoning if it opens with ``<think>`` (after whitespace), content if not. In the
reasoning, ``</think>`` ends it; what follows is content, tags and all."""

from __future__ import annotations

from vllm.reasoning.abs_reasoning_parsers import ReasoningParser, partial_tag_len

THINK_START, THINK_END = "<think>", "</think>"


class Glm45ReasoningParser(ReasoningParser):
    def __init__(self, prompt: str, chat_template_kwargs: dict | None = None):
        super().__init__(prompt, chat_template_kwargs)
        tail = prompt.rstrip()
        if self.chat_template_kwargs.get("enable_thinking") is False or tail.endswith(THINK_END):
            self.state = "content"
        elif tail.endswith(THINK_START):
            self.state = "reasoning"
        else:
            self.state = "undecided"
        self.buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning = ""
        while True:
            if self.state == "undecided":
                head = self.buf.lstrip()
                if head.startswith(THINK_START):
                    self.buf, self.state = head[len(THINK_START) :], "reasoning"
                elif THINK_START.startswith(head):  # blank, or a beginning of the tag: wait
                    return reasoning, ""
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                i = self.buf.find(THINK_END)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf, self.state = self.buf[i + len(THINK_END) :], "content"
                    continue
                keep = len(self.buf) - partial_tag_len(self.buf, THINK_END)
                reasoning, self.buf = reasoning + self.buf[:keep], self.buf[keep:]
                return reasoning, ""
            else:
                content, self.buf = self.buf, ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        return (rest, "") if self.state == "reasoning" else ("", rest)
