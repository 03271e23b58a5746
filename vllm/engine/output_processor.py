"""Front-end side of a request: detokenisation, stop strings, logprobs, RequestOutput assembly.

Runs in the front-end process (API server or LLM). Stop strings are matched here, on text; when one
matches, the request is finished here and the caller aborts it in the engine.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

from vllm.core.messages import EngineCoreOutput, TokenLogprobs
from vllm.outputs import CompletionOutput, Logprob, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: array  # see ProcessedPrompt
    params: SamplingParams
    tokenizer: Tokenizer | None
    index: int = 0  # child index for n > 1
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent_text_len: int = 0
    sent_ids_len: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    detok: IncrementalDetokenizer | None = None
    error: str | None = None
    itls: list[float] = field(default_factory=list)
    kv_transfer_params: dict | None = None

    def __post_init__(self) -> None:
        if self.tokenizer is not None and self.params.detokenize:
            self.detok = IncrementalDetokenizer(self.tokenizer, self.params.skip_special_tokens)
        if self.params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _lp_dict(e: TokenLogprobs, tok: Tokenizer | None) -> dict[int, Logprob]:
    def dec(i: int) -> str | None:
        return tok.id_to_token(i) if tok is not None else None

    d = {
        i: Logprob(v, r + 1, dec(i))
        for r, (i, v) in enumerate(zip(e.top_ids, e.top_logprobs, strict=True))
    }
    if e.token_id not in d:
        d[e.token_id] = Logprob(e.logprob, e.rank, dec(e.token_id))
    else:
        d[e.token_id].rank = e.rank
    return d


class OutputProcessor:
    def __init__(self, stream_interval: int = 1):
        # delta (streamed) outputs: the first token at once, then every stream_interval tokens,
        # and whatever is left when the request finishes (upstream's --stream-interval)
        self.stream_interval = stream_interval

    def process(self, st: RequestState, out: EngineCoreOutput) -> tuple[RequestOutput | None, bool]:
        """Apply one engine output. Returns (output to emit or None, whether the engine must abort
        the request because a stop string matched)."""
        now = time.monotonic()
        abort = False
        st.num_cached_tokens = out.num_cached_tokens
        if out.error:
            st.error, st.finish_reason = out.error, "error"
        if out.kv_transfer_params is not None:
            st.kv_transfer_params = out.kv_transfer_params
        if out.prompt_logprobs and st.prompt_logprobs is not None:
            st.prompt_logprobs.extend(_lp_dict(e, st.tokenizer) for e in out.prompt_logprobs)
        new_ids = list(out.new_token_ids)
        if new_ids:
            if st.last_token_time is not None:
                st.itls.append(now - st.last_token_time)
            st.first_token_time = st.first_token_time or now
            st.last_token_time = now
        if out.new_logprobs and st.logprobs is not None:
            for e in out.new_logprobs:
                st.logprobs.append(_lp_dict(e, st.tokenizer))
                st.cumulative_logprob += e.logprob
        st.output_ids.extend(new_ids)
        if st.detok is not None and new_ids:
            prev = len(st.text)
            st.text += st.detok.add(new_ids)
            if out.finish_reason is not None:
                st.text += st.detok.flush()
            if st.params.stop and not st.finished:
                abort = self._check_stop_strings(st, prev)
        if out.finish_reason is not None and st.finish_reason is None:
            st.finish_reason, st.stop_reason = out.finish_reason, out.stop_reason
        return self._make_output(st), abort

    def _check_stop_strings(self, st: RequestState, prev_len: int) -> bool:
        longest = max(len(s) for s in st.params.stop)
        start = max(0, prev_len - longest + 1)
        best = None
        for s in st.params.stop:
            i = st.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        st.text = st.text[: i + len(s)] if st.params.include_stop_str_in_output else st.text[:i]
        st.finish_reason, st.stop_reason = "stop", s
        return True

    def _make_output(self, st: RequestState) -> RequestOutput | None:
        kind = st.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not st.finished:
            return None
        if kind == RequestOutputKind.DELTA:
            text, ids = st.text[st.sent_text_len :], st.output_ids[st.sent_ids_len :]
            lps = st.logprobs[st.sent_ids_len :] if st.logprobs is not None else None
            if not st.finished and st.sent_ids_len and len(ids) < self.stream_interval:
                return None  # held for the next chunk (at 1: only an empty delta is held)
        else:
            text, ids, lps = st.text, list(st.output_ids), st.logprobs
        plp = (
            st.prompt_logprobs
            if (kind != RequestOutputKind.DELTA or st.sent_ids_len == 0)
            else None
        )
        st.sent_text_len, st.sent_ids_len = len(st.text), len(st.output_ids)
        comp = CompletionOutput(
            st.index, text, ids, st.cumulative_logprob, lps, st.finish_reason, st.stop_reason
        )
        return RequestOutput(
            request_id=st.request_id,
            prompt=st.prompt,
            prompt_token_ids=st.prompt_token_ids,
            prompt_logprobs=plp,
            outputs=[comp],
            finished=st.finished,
            num_cached_tokens=st.num_cached_tokens,
            kv_transfer_params=st.kv_transfer_params if st.finished else None,
            metrics={
                "arrival": st.arrival,
                "first_token": st.first_token_time,
                "last_token": st.last_token_time,
                "error": st.error,
            },
        )
