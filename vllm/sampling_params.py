"""Sampling parameters, with upstream vLLM's field names and validation messages."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum

from vllm.structured_output import StructuredOutputsParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output when the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (tokenised by the engine)
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output follows
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # filled by the engine
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.logit_bias is not None:
            self.logit_bias = _token_id_keys(self.logit_bias)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.verify()

    def verify(self) -> None:
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        for name in ("n", "top_k", "min_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name} must be an integer, got {v!r}.")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}.")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
        ):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers.")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        self._verify_token_lists()
        if self.seed is not None and (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not INT64_MIN <= self.seed <= INT64_MAX
        ):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}.")

    def _verify_token_lists(self) -> None:
        for t, b in (self.logit_bias or {}).items():
            if t < 0:
                raise ValueError(f"logit_bias: token id {t} is out of vocabulary.")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                raise ValueError(
                    f"logit_bias: the bias of token {t} must be in [-100, 100], got {b!r}."
                )
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids.")
            for t in self.allowed_token_ids:
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise ValueError(f"allowed_token_ids: {t!r} is not a valid token id.")
        for w in self.bad_words or []:
            if not isinstance(w, str) or not w.strip():
                raise ValueError(f"bad_words must be non-blank strings, got {w!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **kw) -> SamplingParams:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "all_stop_token_ids"}
        d.update(kw)
        return SamplingParams(**d)


def _token_id_keys(bias: dict) -> dict[int, float]:
    """logit_bias keyed by int token ids (JSON sends them as strings, as OpenAI's API does)."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must map token ids to biases, got {type(bias).__name__}.")
    out = {}
    for k, v in bias.items():
        try:
            if isinstance(k, bool) or isinstance(k, float):
                raise ValueError
            out[int(k)] = v
        except ValueError:
            raise ValueError(f"logit_bias: key {k!r} is not a token id.") from None
    return out
