"""`--tool-call-parser glm47` (also `glm45`): GLM-4.5 to 5.x tool-call markup.

A call is ``<tool_call>NAME`` then zero or more ``<arg_key>KEY</arg_key><arg_value>VALUE
</arg_value>`` pairs, closed by ``</tool_call>``; whitespace may separate the parts (GLM-4.5
puts a newline after the name, 4.7/5.x may not). Several calls may follow each other. A value is
a string unless it reads as JSON (or a Python literal: ``True``, ``'x'``) of a type the tool's
parameter schema allows; a parameter typed ``string`` always stays a string.

Text outside calls is content; whitespace touching a call is dropped. A call is emitted once its
``</tool_call>`` arrives (its name, then one arguments fragment per pair), so markup that is
malformed or cut off by the end of the sequence comes back unchanged, as content, streamed or not.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ToolParser,
    make_tool_call_id,
)
from vllm.reasoning.abs_reasoning_parsers import partial_tag_len

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"


class Glm4ToolParser(ToolParser):
    def __init__(self, tools: list[dict]):
        super().__init__(tools)
        self.param_types = {
            t["function"]["name"]: _param_types(t["function"].get("parameters")) for t in tools
        }
        self.buf = ""  # text not yet emitted: a partial tag, or an open call
        self.in_call = False  # buf starts with CALL_START
        self.held_ws = ""  # trailing whitespace of the content: dropped if a call follows
        self.after_call = False  # a call was just emitted: leading whitespace is dropped
        self.num_calls = 0

    def feed(self, delta: str) -> list[dict]:
        self.buf += delta
        out: list[dict] = []
        while True:
            if not self.in_call:
                i = self.buf.find(CALL_START)
                cut = i if i >= 0 else len(self.buf) - partial_tag_len(self.buf, CALL_START)
                self._content(out, self.buf[:cut])
                self.buf = self.buf[cut:]
                if i < 0:
                    return out
                self.in_call = True
                continue
            end = self.buf.find(CALL_END)
            if end < 0:
                return out
            body = self.buf[len(CALL_START) : end]
            nested = body.find(CALL_START)
            if nested >= 0:  # a call opens inside an unclosed one: the first was not a call
                self._content(out, self.buf[: len(CALL_START) + nested])
                self.buf = self.buf[len(CALL_START) + nested :]
                continue
            parsed = self._parse_call(body)
            stop = end + len(CALL_END)
            raw, self.buf, self.in_call = self.buf[:stop], self.buf[stop:], False
            if parsed is None:
                self._content(out, raw)
            else:
                out.extend(self._call_deltas(*parsed))
                self.held_ws, self.after_call = "", True

    def finish(self) -> list[dict]:
        out: list[dict] = []
        rest, self.buf, self.in_call = self.buf, "", False
        self._content(out, rest)
        if self.held_ws:
            out.append({"content": self.held_ws})
            self.held_ws = ""
        return out

    def _content(self, out: list[dict], text: str) -> None:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        core = text.rstrip()
        if core:
            out.append({"content": self.held_ws + core})
            self.held_ws = ""
        self.held_ws += text[len(core) :]

    def _parse_call(self, body: str) -> tuple[str, list[tuple[str, Any]]] | None:
        """A call's name and arguments from the text between its tags; None if malformed."""
        k = body.find(KEY_START)
        name = (body if k < 0 else body[:k]).strip()
        if not name or any(c in name for c in "<>\n"):
            return None
        rest, pos, args = body[len(body) if k < 0 else k :], 0, []
        while True:
            pos = _skip_ws(rest, pos)
            if pos == len(rest):
                return name, args
            key = _tagged(rest, pos, KEY_START, KEY_END)
            if key is None:
                return None
            pos = _skip_ws(rest, key[1])
            value = _tagged(rest, pos, VALUE_START, VALUE_END)
            if value is None:
                return None
            pos = value[1]
            args.append((key[0].strip(), self._value(name, key[0].strip(), value[0])))

    def _value(self, tool: str, key: str, raw: str) -> Any:
        types = self.param_types.get(tool, {}).get(key)
        if types == {"string"}:
            return raw
        value = _literal(raw.strip())
        if value is None and raw.strip() not in ("null", "None"):
            return raw
        if types is not None and not (_json_types(value) & types):
            return raw
        return value

    def _call_deltas(self, name: str, args: list[tuple[str, Any]]) -> list[dict]:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        first = {"index": index, "id": make_tool_call_id(), "type": "function"}
        out = [{"tool_calls": [{**first, "function": {"name": name}}]}]
        pairs = [
            f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
            for k, v in args
        ]
        fragments = [("{" if i == 0 else ", ") + p for i, p in enumerate(pairs)] or ["{"]
        fragments[-1] += "}"
        for f in fragments:
            out.append({"tool_calls": [{"index": index, "function": {"arguments": f}}]})
        return out


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _tagged(text: str, pos: int, start: str, end: str) -> tuple[str, int] | None:
    """The text between `start` at `pos` and the next `end`, and the position after `end`."""
    if not text.startswith(start, pos):
        return None
    stop = text.find(end, pos + len(start))
    if stop < 0:
        return None
    return text[pos + len(start) : stop], stop + len(end)


def _literal(text: str) -> Any:
    """`text` as JSON, else as a Python literal of JSON's kinds (models write ``True``); None if
    it is neither (or reads as null/None)."""
    try:
        value = json.loads(text)
    except ValueError:
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return None
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):  # a tuple key, a set, bytes, inf, NaN
        return None
    return value


def _json_types(value: Any) -> set[str]:
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"} | ({"integer"} if value.is_integer() else set())
    if isinstance(value, str):
        return {"string"}
    if isinstance(value, list):
        return {"array"}
    if isinstance(value, dict):
        return {"object"}
    return {"null"}


def _param_types(parameters: dict | None) -> dict[str, set[str]]:
    """Parameter name -> the JSON types its schema allows (absent: not stated)."""
    props = (parameters or {}).get("properties")
    out = {}
    for key, schema in (props if isinstance(props, dict) else {}).items():
        types = _schema_types(schema)
        if types:
            out[key] = types
    return out


def _schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return set().union(*(_json_types(v) for v in schema["enum"]))
    for alt in ("anyOf", "oneOf"):
        subs = [_schema_types(s) for s in schema.get(alt) or ()]
        if subs and all(subs):
            return set().union(*subs)
    return set()
