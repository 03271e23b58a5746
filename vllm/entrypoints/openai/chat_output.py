"""The response side of chat completions: one choice's generated text, streamed or whole, into
OpenAI's message and delta shapes: ``reasoning_content`` (the reasoning parser's), ``content``
and ``tool_calls`` (the tool parser's, on the content part, under ``tool_choice: "auto"``), with
``finish_reason`` ``"tool_calls"`` when calls were made. Under a forced choice the text is the
grammar's JSON (`structured.py`) from its first token, so it gets no reasoning split. The server
builds every chat response through `ChatOutputs`; tests feed it text directly."""

from __future__ import annotations

from vllm.entrypoints.openai.chat_utils import ChatParsers
from vllm.entrypoints.openai.structured import forced_tool_calls
from vllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser, merge_deltas
from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import make_tool_call_id
from vllm.reasoning import REASONING_PARSERS, ReasoningParser


class ChoiceOutput:
    """One choice, fed the engine's text deltas. `feed` and `finish` return the chat deltas to
    send (``{"reasoning_content"}``, ``{"content"}`` or ``{"tool_calls": [one]}``); `message`
    is the whole text's assistant message, equal to the merged deltas of any streaming of it."""

    def __init__(self, parse: bool = False):
        self.parse = parse  # False: the text is the content, as it comes
        self.reasoning: ReasoningParser | None = None
        self.num_tool_calls = 0

    def feed(self, text: str) -> list[dict]:
        return [{"content": text}] if text else []

    def finish(self) -> list[dict]:
        return []

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if engine_reason is not None and self.num_tool_calls:
            return "tool_calls"
        return engine_reason

    def message(self, text: str) -> dict:
        if not self.parse:
            return {"role": "assistant", "content": text}
        deltas = [*self.feed(text), *self.finish()]
        content, tool_calls = merge_deltas(deltas)
        msg = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
            msg["reasoning_content"] = reasoning or None
        if tool_calls:
            msg["tool_calls"] = tool_calls
        return msg


class ParsedChoice(ChoiceOutput):
    """Reasoning split off first, then tool calls found in the content (either may be absent);
    with ``parallel_tool_calls: false`` only the first call is kept."""

    def __init__(
        self, reasoning: ReasoningParser | None, tools: ToolParser | None, max_tool_calls: int
    ):
        super().__init__(parse=True)
        self.reasoning, self.tools, self.max_tool_calls = reasoning, tools, max_tool_calls

    def feed(self, text: str) -> list[dict]:
        r, c = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        return self._deltas(r, c, final=False)

    def finish(self) -> list[dict]:
        r, c = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return self._deltas(r, c, final=True)

    def _deltas(self, reasoning: str, content: str, final: bool) -> list[dict]:
        out = [{"reasoning_content": reasoning}] if reasoning else []
        if self.tools is None:
            return out + ([{"content": content}] if content else [])
        for d in [*self.tools.feed(content), *(self.tools.finish() if final else ())]:
            if "tool_calls" in d:
                index = d["tool_calls"][0]["index"]
                if index >= self.max_tool_calls:
                    continue
                self.num_tool_calls = max(self.num_tool_calls, index + 1)
            out.append(d)
        return out


class NamedToolChoice(ChoiceOutput):
    """``tool_choice`` naming a function: the text is its arguments (JSON, constrained), streamed
    as argument fragments after a first delta with the call's id and name. ``finish_reason``
    stays the engine's, as OpenAI's for a named choice."""

    def __init__(self, name: str):
        super().__init__(parse=True)
        self.name, self.started = name, False

    def feed(self, text: str) -> list[dict]:
        out = []
        if not self.started:
            self.started = True
            call = {"index": 0, "id": make_tool_call_id(), "type": "function"}
            out.append({"tool_calls": [{**call, "function": {"name": self.name}}]})
        if text:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return out

    def finish(self) -> list[dict]:
        return [] if self.started else self.feed("")

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return engine_reason


class RequiredToolChoice(ChoiceOutput):
    """``tool_choice: "required"``: the text is a JSON array of ``{"name", "parameters"}``
    (constrained); the calls are sent when it is complete, and a text that is not (cut by
    max_tokens) comes back as content."""

    def __init__(self):
        super().__init__(parse=True)
        self.text = ""

    def feed(self, text: str) -> list[dict]:
        self.text += text
        return []

    def finish(self) -> list[dict]:
        calls = forced_tool_calls(self.text, "required")
        if calls is None:
            return [{"content": self.text}] if self.text else []
        self.num_tool_calls = len(calls)
        out = []
        for i, c in enumerate(calls):
            first = {"index": i, "id": c["id"], "type": "function"}
            out.append({"tool_calls": [{**first, "function": {"name": c["function"]["name"]}}]})
            args = {"index": i, "function": {"arguments": c["function"]["arguments"]}}
            out.append({"tool_calls": [args]})
        return out


class ChatOutputs:
    """The parsing one chat request gets, chosen from the server's parsers and the request:
    `new_choice()` for each of its choices."""

    def __init__(
        self,
        parsers: ChatParsers,
        prompt: str,
        tools: list[dict] | None,
        tool_choice: str | dict,
        chat_template_kwargs: dict | None = None,
        parallel_tool_calls: bool | None = True,
    ):
        self.parsers, self.prompt, self.tools = parsers, prompt, tools or []
        self.tool_choice, self.kwargs = tool_choice, chat_template_kwargs or {}
        self.max_tool_calls = 1 if parallel_tool_calls is False else 1 << 30

    def new_choice(self) -> ChoiceOutput:
        if isinstance(self.tool_choice, dict):
            return NamedToolChoice(self.tool_choice["function"]["name"])
        if self.tool_choice == "required":
            return RequiredToolChoice()
        reasoning = tools = None
        if self.parsers.reasoning_parser is not None:
            cls = REASONING_PARSERS[self.parsers.reasoning_parser]
            reasoning = cls(self.prompt, self.kwargs)
        if self.tool_choice == "auto" and self.parsers.tool_call_parser is not None:
            tools = TOOL_PARSERS[self.parsers.tool_call_parser](self.tools)
        if reasoning is None and tools is None:
            return ChoiceOutput()
        return ParsedChoice(reasoning, tools, self.max_tool_calls)
