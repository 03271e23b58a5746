"""Turn a user prompt + SamplingParams into engine-core requests, validating everything the
engine would otherwise choke on (context length, KV capacity, vocabulary, parameters)."""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass

from vllm.config import VllmConfig
from vllm.core.messages import EngineCoreRequest, SamplingOptions
from vllm.distributed.kv_transfer.nixl_params import source_layout
from vllm.sampling_params import SamplingParams
from vllm.tokenizer import Tokenizer
from vllm.utils import token_array


@dataclass
class ProcessedPrompt:
    prompt: str | None
    # packed int32 (``vllm.utils.token_array``; any sequence of ints is converted): the front
    # end keeps it for the request's lifetime and no collection walks its elements
    prompt_token_ids: array

    def __post_init__(self):
        self.prompt_token_ids = token_array(self.prompt_token_ids)


class InputProcessor:
    def __init__(self, config: VllmConfig, tokenizer: Tokenizer | None, max_request_tokens: int):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = config.model_config.vocab_size
        self.max_model_len = config.model_config.max_model_len
        self.max_request_tokens = max_request_tokens
        self.max_logprobs = config.model_config.max_logprobs
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.eos_ids = list(config.model_config.arch.eos_token_id)

    def tokenize(self, prompt) -> ProcessedPrompt:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return self.check_ids(
                    ProcessedPrompt(prompt.get("prompt"), prompt["prompt_token_ids"])
                )
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "text prompts need a tokenizer; this server runs with --skip-tokenizer-init"
                )
            return ProcessedPrompt(prompt, self.tokenizer.encode(prompt))
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return self.check_ids(ProcessedPrompt(None, prompt))
        raise ValueError(
            "prompt must be a string, a list of token ids, or {'prompt_token_ids': [...]}"
        )

    def check_ids(self, p: ProcessedPrompt) -> ProcessedPrompt:
        for t in p.prompt_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"Token id {t} is out of vocabulary (vocab size {self.vocab_size})"
                )
        return p

    def make_requests(
        self,
        request_id: str,
        p: ProcessedPrompt,
        params: SamplingParams,
        kv_transfer_params: dict | None = None,
    ) -> list[tuple[str, SamplingParams, EngineCoreRequest]]:
        n_prompt = len(p.prompt_token_ids)
        if kv_transfer_params is not None:
            params = self._check_kv_transfer(kv_transfer_params, params)
        if params.n > self.max_num_seqs:  # more than can ever run at once
            raise ValueError(
                f"n must be at most {self.max_num_seqs} (--max-num-seqs), got {params.n}"
            )
        if n_prompt == 0:
            raise ValueError("The prompt is empty; it must contain at least one token")
        limit = self.max_request_tokens
        if n_prompt >= limit:
            raise ValueError(
                self._too_long(n_prompt, 1 if params.max_tokens is None else params.max_tokens)
            )
        if params.max_tokens is None:
            params = params.clone(max_tokens=limit - n_prompt)
        if n_prompt + params.max_tokens > limit:
            raise ValueError(self._too_long(n_prompt, params.max_tokens))
        for name, k in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if k is not None and k > self.max_logprobs:
                raise ValueError(
                    f"Requested {name} of {k}, which is greater than max allowed: {self.max_logprobs}"
                )
        for t in params.stop_token_ids or []:
            if t >= self.vocab_size:
                raise ValueError(f"stop_token_ids: token id {t} is out of vocabulary")
        self._check_vocab(params)
        bad_words = self._bad_words_token_ids(params.bad_words)
        out = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{i}_{request_id}"
            # the i-th sample's seed, wrapped into int64 (the sampler's seed type)
            seed = (
                (params.seed + i + 2**63) % 2**64 - 2**63
                if params.seed is not None
                else random.getrandbits(63)
            )
            opts = SamplingOptions(
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                min_p=params.min_p,
                seed=seed,
                max_tokens=params.max_tokens,
                min_tokens=params.min_tokens,
                stop_token_ids=list(params.stop_token_ids or []),
                ignore_eos=params.ignore_eos,
                logprobs=params.logprobs,
                prompt_logprobs=params.prompt_logprobs,
                presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty,
                repetition_penalty=params.repetition_penalty,
                logit_bias=params.logit_bias or None,
                allowed_token_ids=params.allowed_token_ids,
                bad_words_token_ids=bad_words,
                structured=params.structured_outputs,
            )
            ecr = EngineCoreRequest(
                rid,
                p.prompt_token_ids.tobytes(),
                opts,
                self.eos_ids,
                kv_transfer_params=kv_transfer_params,
            )
            out.append((rid, params, ecr))
        return out

    def _check_kv_transfer(self, kv: dict, params: SamplingParams) -> SamplingParams:
        """kv_transfer_params (P/D disaggregation): refused without --kv-transfer-config or when
        malformed. A prefill request (``do_remote_decode``) computes its prompt and one token, as
        upstream: max_tokens is 1."""
        kvt = self.config.kv_transfer_config
        if not isinstance(kv, dict):
            raise ValueError("kv_transfer_params must be a JSON object")
        if kvt is None:
            if kv.get("do_remote_decode") or kv.get("do_remote_prefill"):
                raise ValueError(
                    "kv_transfer_params need a server started with --kv-transfer-config"
                )
            return params
        if params.n != 1:
            raise ValueError(f"kv_transfer_params need n = 1, got n = {params.n}")
        if kv.get("do_remote_prefill"):
            if not kvt.is_kv_consumer:
                raise ValueError(
                    f"kv_transfer_params do_remote_prefill: this engine's kv_role is {kvt.kv_role}"
                )
            try:
                source_layout(kv)
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"kv_transfer_params: {e}") from e
        if kv.get("do_remote_decode"):
            if not kvt.is_kv_producer:
                raise ValueError(
                    f"kv_transfer_params do_remote_decode: this engine's kv_role is {kvt.kv_role}"
                )
            params = params.clone(max_tokens=1, min_tokens=min(params.min_tokens, 1))
        return params

    def _check_vocab(self, params: SamplingParams) -> None:
        v = self.vocab_size
        bad = sorted(t for t in params.logit_bias or {} if t >= v)
        if bad:
            raise ValueError(
                f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. "
                f"Vocabulary size: {v}"
            )
        for t in params.allowed_token_ids or []:
            if t >= v:
                raise ValueError(
                    f"allowed_token_ids: token id {t} is out of vocabulary (vocab size {v})"
                )

    def _bad_words_token_ids(self, words: list[str] | None) -> list[list[int]] | None:
        """Each word tokenised as it starts the text and, when that gives other tokens of the
        same length, after a space, as upstream does (a word is a different token mid-text)."""
        if not words:
            return None
        if self.tokenizer is None:
            raise ValueError(
                "bad_words need a tokenizer; this server runs with --skip-tokenizer-init"
            )
        out: list[list[int]] = []
        for word in words:
            first = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not first:
                continue
            out.append(first)
            if spaced and spaced[0] != first[0] and len(spaced) == len(first):
                out.append(spaced)
        for ids in out:
            for t in ids:
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"bad_words: token id {t} is out of vocabulary")
        return out

    def _too_long(self, n_prompt: int, max_tokens: int) -> str:
        cap = self.max_request_tokens
        why = (
            f"This model's maximum context length is {self.max_model_len} tokens"
            if cap == self.max_model_len
            else f"The KV cache holds at most {cap} tokens per request at this configuration "
            f"(max context length {self.max_model_len}; a larger --decode-context-parallel-size "
            "or KV budget admits longer requests)"
        )
        return (
            f"{why}. However, you requested {n_prompt + max_tokens} tokens ({n_prompt} in the "
            f"prompt, {max_tokens} in the completion). Please reduce the length of the prompt or completion."
        )
