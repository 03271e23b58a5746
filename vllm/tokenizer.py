"""Tokenizer: an HF `tokenizer.json` (via `tokenizers`) plus `tokenizer_config.json`'s chat
template (rendered with a sandboxed jinja2). Incremental detokenisation for streaming."""

from __future__ import annotations

import datetime
import json
import os

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, path: str, chat_template: str | None = None):
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise ValueError(
                f"no tokenizer.json in {path!r}; pass --tokenizer or --skip-tokenizer-init (token-id prompts only)"
            )
        self.tok = _HFTokenizer.from_file(tj)
        cfg = {}
        tc = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(tc):
            with open(tc) as f:
                cfg = json.load(f)
        self.chat_template = chat_template or cfg.get("chat_template")
        self.bos_token = _tok_str(cfg.get("bos_token"))
        self.eos_token = _tok_str(cfg.get("eos_token"))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        self._env = _template_env()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        t = self.tok.id_to_token(i)
        return "" if t is None else self.decode([i], skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs,
    ) -> str:
        tmpl = chat_template or self.chat_template
        if not tmpl:
            raise ValueError(
                "this model has no chat template; use /v1/completions or pass --chat-template"
            )
        try:
            return self._env.from_string(tmpl).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except (jinja2.TemplateError, TypeError) as e:  # TypeError: tojson of an odd value
            raise ValueError(f"chat template failed: {e}") from e


def _template_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The environment HF's `apply_chat_template` renders in, which real templates (GLM-4.5 to
    5.x among them) are written against: `tojson` with `json.dumps`'s keywords and no HTML
    escaping, `raise_exception`, `strftime_now`, `{% break %}`/`{% continue %}` and `{% do %}`."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, jinja2.ext.do],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def _tojson(
    value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tok_str(v) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v


class IncrementalDetokenizer:
    """Text deltas for a growing list of output ids; holds back incomplete UTF-8 sequences."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tok, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """At the end, emit whatever was held back (even an incomplete character)."""
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""
