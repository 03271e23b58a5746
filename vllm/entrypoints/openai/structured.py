"""OpenAI request fields that constrain the output, turned into StructuredOutputsParams:
``response_format`` (``json_object``, ``json_schema``), upstream's ``structured_outputs``, and
forced tool calls (``tool_choice`` ``"required"`` or a named function), which upstream vLLM
decodes as JSON: a named function's arguments, or a non-empty array of ``{"name",
"parameters"}`` for ``"required"``. Each error is a ValueError in user terms (a 400)."""

from __future__ import annotations

import json
import secrets

from vllm.structured_output import StructuredOutputsParams

_EMPTY_OBJECT = {"type": "object", "properties": {}}


def structured_params(
    response_format: dict | None,
    structured_outputs: dict | None,
    tools: list[dict] | None = None,
    tool_choice: str | dict | None = None,
) -> StructuredOutputsParams | None:
    """The request's one constraint (None: unconstrained); SamplingParams validates it."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if response_format is not None:
        p = _from_response_format(response_format)
        if p is not None:
            found.append(("response_format", p))
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise ValueError("structured_outputs must be an object")
        fields = set(StructuredOutputsParams.__struct_fields__)
        unknown = sorted(set(structured_outputs) - fields)
        if unknown:
            raise ValueError(f"structured_outputs: unknown fields {unknown}")
        try:
            found.append(("structured_outputs", StructuredOutputsParams(**structured_outputs)))
        except TypeError as e:
            raise ValueError(f"structured_outputs: {e}") from None
    forced = forced_tool_schema(tools, tool_choice)
    if forced is not None:
        found.append(("tool_choice", StructuredOutputsParams(json=forced)))
    if len(found) > 1:
        raise ValueError(
            f"{' and '.join(n for n, _ in found)} each constrain the output: use one of them"
        )
    return found[0][1] if found else None


def _from_response_format(rf) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise ValueError(
            "response_format.type must be 'text', 'json_object' or 'json_schema', got "
            f"{rf.get('type') if isinstance(rf, dict) else rf!r}"
        )
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict | bool):
        raise ValueError(
            "response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}"
        )
    if "name" not in js:
        raise ValueError("response_format.json_schema.name is required")
    schema = js.get("schema", {"type": "object"})
    return StructuredOutputsParams(json=schema if isinstance(schema, dict) else {})


def _tool_names(tools: list[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def _tool_params(tool: dict) -> dict:
    return tool["function"].get("parameters") or _EMPTY_OBJECT


def forced_tool_schema(tools: list[dict] | None, tool_choice) -> dict | None:
    """The JSON schema a forced tool choice decodes under (None when not forced). `tools` and
    `tool_choice` are assumed checked already (shapes, a named tool among `tools`)."""
    if not tools or tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        return {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "name": {"enum": [t["function"]["name"]]},
                            "parameters": _tool_params(t),
                        },
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                    }
                    for t in tools
                ]
            },
        }
    if isinstance(tool_choice, dict):
        name = tool_choice.get("function", {}).get("name")
        for t in tools:
            if t["function"]["name"] == name:
                return _tool_params(t)
        raise ValueError(f"tool_choice names {name!r}, which is not in tools {_tool_names(tools)}")
    return None


def forced_tool_calls(text: str, tool_choice) -> list[dict] | None:
    """The tool calls of a forced choice from the constrained text (None if it is not complete
    JSON, e.g. cut by max_tokens: the text is then returned as content)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if tool_choice == "required":
        if not isinstance(value, list):
            return None
        return [_call(c["name"], c["parameters"]) for c in value]
    return [_call(tool_choice["function"]["name"], value)]


def _call(name: str, arguments) -> dict:
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }
