"""Parsing of the JSON-valued CLI flags (``--attention-config``, ``--compilation-config``, ...)."""

from __future__ import annotations

import json


def parse_json_flag(value, flag: str) -> dict:
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return dict(value)
    try:
        out = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} must be a JSON object: {e}") from e
    if not isinstance(out, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(out).__name__}")
    return out
