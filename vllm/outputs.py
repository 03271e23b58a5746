"""Request outputs with upstream vLLM's field names."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    # a list from LLM.generate (upstream's type); inside the server the prompt's packed int32
    # array (``vllm.utils.token_array``), not copied for each streamed delta
    prompt_token_ids: list[int] | array
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    kv_transfer_params: dict | None = None  # P/D: the prefill engine's, for the decode engine
