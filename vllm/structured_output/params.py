"""What a request asks to be constrained to; travels inside SamplingOptions (msgpack)."""

from __future__ import annotations

import json
import re

import msgspec

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True):
    """Exactly one of the fields is set (upstream's names). ``json`` is a JSON schema (object or
    its JSON text); ``json_object`` any JSON object; ``choice`` one of the strings, verbatim;
    ``grammar`` EBNF (GBNF style, as xgrammar reads it); ``structural_tag`` xgrammar's JSON."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = True  # compact JSON: no runs of whitespace between tokens

    def kind(self) -> str:
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(
                "structured_outputs: set exactly one of "
                + ", ".join(KINDS)
                + (f" (got {', '.join(set_)})" if set_ else " (got none)")
            )
        return set_[0]

    def key(self) -> tuple[str, str, bool]:
        """Cache key of the compiled grammar."""
        k = self.kind()
        v = getattr(self, k)
        if k == "json" and not isinstance(v, str):
            v = json.dumps(v, sort_keys=True)
        elif k == "choice":
            v = json.dumps(v)
        return k, str(v), self.disable_any_whitespace

    def validate(self) -> None:
        """Raise ValueError (a 400 at the server) when the constraint is not one the grammar
        library accepts: a schema that is not JSON or not a schema, a bad regex or EBNF, an empty
        choice. Needs no tokenizer; the engine compiles against the vocabulary later."""
        k = self.kind()
        xgr = _xgrammar()
        try:
            if k == "json":
                schema = self.json if isinstance(self.json, str) else json.dumps(self.json)
                parsed = json.loads(schema)
                if not isinstance(parsed, dict | bool):
                    raise ValueError("a JSON schema is an object")
                xgr.Grammar.from_json_schema(schema, any_whitespace=False)
            elif k == "regex":
                xgr.Grammar.from_regex(self.regex)
            elif k == "choice":
                if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                    raise ValueError("choice must be a non-empty list of non-empty strings")
            elif k == "grammar":
                xgr.Grammar.from_ebnf(self.grammar)
            elif k == "structural_tag":
                xgr.Grammar.from_structural_tag(self.structural_tag)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{k}: {_short(e)}") from None
        except Exception as e:  # noqa: BLE001 (xgrammar raises RuntimeError/TypeError on bad input)
            raise ValueError(f"structured_outputs.{k}: {_short(e)}") from None


def _short(e: Exception) -> str:
    """The library's message without its source location prefix ("[time] file.cc:N: ")."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[0])[:300]


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover (a declared dependency)
        raise ValueError(
            f"structured outputs need the xgrammar package ({e}): pip install 'vllm[structured]'"
        ) from None
    return xgrammar
