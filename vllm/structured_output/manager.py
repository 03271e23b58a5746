"""The engine core's grammars: compiled with xgrammar on a background thread (cached by
constraint), one matcher per request, the step's bitmask rows, the sampled tokens accepted.

A request whose grammar is still compiling waits (the scheduler skips it without losing its
place); one whose grammar failed to compile finishes with an error. Matchers follow the output
tokens, which preemption keeps, so a recomputed request resumes with the same matcher.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from vllm.structured_output.params import StructuredOutputsParams, _short

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)


class StructuredOutputManager:
    def __init__(self, tokenizer_path: str, vocab_size: int, eos_ids: list[int]):
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        # importing xgrammar and reading the vocabulary take seconds: off the step loop
        self._compiler: Future = self._pool.submit(
            _make_compiler, tokenizer_path, vocab_size, eos_ids
        )
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._pending: dict[str, Future] = {}
        self._matchers: dict[str, object] = {}

    # ---- per request ----------------------------------------------------------------------------
    def add(self, req_id: str, params: StructuredOutputsParams) -> None:
        key = params.key()
        fut = self._cache.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self._pool.submit(_compile, self._compiler, params)
            self._cache[key] = fut
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        self._pending[req_id] = fut

    def ready(self, req_id: str) -> bool | str:
        """True when the request's matcher exists (or it has no grammar), False while compiling,
        or the compile error's message."""
        fut = self._pending.get(req_id)
        if fut is None:
            return True
        if not fut.done():
            return False
        del self._pending[req_id]
        err = fut.exception()
        if err is not None:
            return f"structured output: {_short(err)}"
        import xgrammar as xgr

        self._matchers[req_id] = xgr.GrammarMatcher(fut.result())
        return True

    def has(self, req_id: str) -> bool:
        return req_id in self._matchers

    def remove(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
        self._matchers.pop(req_id, None)

    # ---- per step ---------------------------------------------------------------------------------
    def bitmask(self, req_ids: list[str]) -> np.ndarray:
        """[len(req_ids), ceil(V/32)] int32: the tokens each request's grammar allows next."""
        import torch
        import xgrammar as xgr

        out = xgr.allocate_token_bitmask(len(req_ids), self.vocab_size)
        for i, rid in enumerate(req_ids):
            self._matchers[rid].fill_next_token_bitmask(out, i)
        return out.numpy() if isinstance(out, torch.Tensor) else np.asarray(out)

    def accept(self, req_id: str, token: int) -> bool:
        """Advance the request's grammar by a sampled token; False if the grammar refuses it (a
        token sampled outside the mask: an engine bug, reported as an error)."""
        m = self._matchers.get(req_id)
        return True if m is None else bool(m.accept_token(token))

    def terminated(self, req_id: str) -> bool:
        m = self._matchers.get(req_id)
        return m is not None and m.is_terminated()


def _make_compiler(tokenizer_path: str, vocab_size: int, eos_ids: list[int]):
    import xgrammar as xgr
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tokenizer_path}/tokenizer.json")
    encoded = [""] * vocab_size  # ids past the tokenizer's (padding rows): never allowed
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    for text, i in tok.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and i not in special:
            encoded[i] = text
    try:
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
        vocab_type, prefix_space = meta["vocab_type"], meta["add_prefix_space"]
    except Exception:  # noqa: BLE001 (GLM's tokenizers are byte-level BPE)
        vocab_type, prefix_space = xgr.VocabType.BYTE_LEVEL, False
    info = xgr.TokenizerInfo(
        encoded,
        vocab_type=vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=list(eos_ids),
        add_prefix_space=prefix_space,
    )
    return xgr.GrammarCompiler(info, max_threads=1)


def _compile(compiler_future: Future, p: StructuredOutputsParams):
    c = compiler_future.result()
    kind = p.kind()
    ws = not p.disable_any_whitespace
    if kind == "json":
        schema = p.json if isinstance(p.json, str) else json.dumps(p.json)
        return c.compile_json_schema(schema, any_whitespace=ws)
    if kind == "json_object":
        return c.compile_json_schema('{"type": "object"}', any_whitespace=ws)
    if kind == "regex":
        return c.compile_regex(p.regex)
    if kind == "choice":
        return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in p.choice))
    if kind == "grammar":
        return c.compile_grammar(p.grammar)
    return c.compile_structural_tag(p.structural_tag)
