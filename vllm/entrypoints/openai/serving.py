"""/v1/completions and /v1/chat/completions on top of AsyncLLM: request → SamplingParams, outputs
→ OpenAI response bodies, streaming as server-sent events."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

import msgspec

from vllm.engine.async_llm import AsyncLLM
from vllm.engine.input_processor import ProcessedPrompt
from vllm.entrypoints.openai.chat_output import ChatOutputs, ChoiceOutput
from vllm.entrypoints.openai.chat_utils import (
    ChatParsers,
    check_messages,
    check_tool_choice_served,
    check_tools,
    effective_tool_choice,
    template_kwargs,
    template_message,
)
from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_unsupported,
    error_body,
)
from vllm.entrypoints.openai.structured import structured_params
from vllm.outputs import Logprob
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.structured_output import StructuredOutputsParams


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLM,
        served_model_name: str,
        enable_prompt_tokens_details: bool,
        parsers: ChatParsers | None = None,
    ):
        self.engine = engine
        self.model_name = served_model_name
        self.details = enable_prompt_tokens_details
        self.tokenizer = engine.tokenizer
        self.parsers = parsers or ChatParsers()

    # ---- shared ------------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> dict | None:
        if name is not None and name != self.model_name:
            return error_body(f"The model `{name}` does not exist.", "NotFoundError", 404, "model")
        return None

    def sampling_params(self, req, logprobs: int | None, stream: bool) -> SamplingParams:
        check_unsupported(req)
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}.")
        if req.best_of is not None and req.best_of != req.n:
            raise ValueError(
                f"best_of={req.best_of} is not supported: this engine returns every one of the n "
                f"samples (best_of may only equal n, {req.n})"
            )
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=req.prompt_logprobs,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=req.logit_bias,
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
            structured_outputs=self._structured(req),
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        )

    def _structured(self, req) -> StructuredOutputsParams | None:
        p = structured_params(
            req.response_format,
            req.structured_outputs,
            # tools are chat's (checked in chat_prompt); a completion's are ignored, as upstream
            req.tools if isinstance(req, ChatCompletionRequest) else None,
            req.tool_choice if isinstance(req, ChatCompletionRequest) else None,
        )
        if p is not None and self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer (--skip-tokenizer-init is set)")
        return p

    def _usage(self, n_prompt: int, n_completion: int, cached: int) -> dict:
        u = {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_completion,
            "total_tokens": n_prompt + n_completion,
        }
        if self.details:
            u["prompt_tokens_details"] = {"cached_tokens": cached}
        return u

    def _decode(self, tid: int) -> str:
        return self.tokenizer.id_to_token(tid) if self.tokenizer is not None else f"token_id:{tid}"

    # ---- prompts -----------------------------------------------------------------------------------
    def completion_prompts(self, req: CompletionRequest) -> list[ProcessedPrompt]:
        p = req.prompt
        if p is None or p == [] or p == "":
            raise ValueError(
                "prompt must be a non-empty string, list of strings, or list of token ids"
            )
        if isinstance(p, str):
            items = [p]
        elif all(isinstance(x, int) for x in p):
            items = [p]
        else:
            items = list(p)
        out = []
        for item in items:
            if isinstance(item, str) and self.tokenizer is not None and not req.add_special_tokens:
                out.append(
                    ProcessedPrompt(item, self.tokenizer.encode(item, add_special_tokens=False))
                )
            else:
                out.append(self.engine.tokenize(item))
        return out

    def chat_prompt(self, req: ChatCompletionRequest) -> ProcessedPrompt:
        if self.tokenizer is None:
            raise ValueError(
                "chat completions need a tokenizer; this server runs with --skip-tokenizer-init"
            )
        check_messages(req.messages)
        check_tools(req.tools, req.tool_choice)
        tool_choice = effective_tool_choice(req.tools, req.tool_choice)
        check_tool_choice_served(tool_choice, self.parsers)
        text = self.tokenizer.apply_chat_template(
            [template_message(m) for m in req.messages],
            add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            chat_template=req.chat_template,
            **template_kwargs(req.tools, tool_choice, req.chat_template_kwargs, self.parsers),
        )
        return ProcessedPrompt(
            text, self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        )

    # ---- render (upstream's /v1/*/render: the token-in request a prompt becomes) ---------------
    def render(self, req, p: ProcessedPrompt, request_id: str, logprobs: int | None) -> dict:
        """Upstream's ``GenerateRequest``: what the engine would run for ``req`` (routers such as
        vllm-router's cache-aware policy read ``token_ids``); nothing is generated."""
        sp = self.sampling_params(req, logprobs, bool(req.stream))
        return {
            "request_id": request_id,
            "token_ids": p.prompt_token_ids.tolist(),
            "sampling_params": _sampling_json(sp),
            "model": self.model_name,
            "stream": bool(req.stream),
            "stream_options": req.stream_options.model_dump() if req.stream_options else None,
            "cache_salt": None,
            "priority": 0,
            "kv_transfer_params": req.kv_transfer_params,
            "token_offsets": None,
        }

    def render_completion(self, req: CompletionRequest, request_id: str) -> list[dict]:
        prompts = self.completion_prompts(req)
        return [self.render(req, p, f"cmpl-{request_id}", req.logprobs) for p in prompts]

    def render_chat(self, req: ChatCompletionRequest, request_id: str) -> dict:
        p = self.chat_prompt(req)
        k = (req.top_logprobs or 0) if req.logprobs else None
        # ours beside upstream's fields: the templated prompt text
        return {**self.render(req, p, f"chatcmpl-{request_id}", k), "prompt": p.prompt}

    # ---- completions -----------------------------------------------------------------------------
    def _completion_logprobs(
        self, lps: list[dict[int, Logprob]], ids: list[int], offset0: int
    ) -> dict:
        tokens, tlp, top, offs = [], [], [], []
        pos = offset0
        for tid, d in zip(ids, lps, strict=False):
            t = self._decode(tid)
            tokens.append(t)
            tlp.append(d[tid].logprob)
            top.append({self._decode(i): lp.logprob for i, lp in d.items()})
            offs.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": tlp, "top_logprobs": top, "text_offset": offs}

    @staticmethod
    def _prompt_logprobs_json(plp) -> list | None:
        if plp is None:
            return None
        return [
            None
            if d is None
            else {
                str(i): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                for i, lp in d.items()
            }
            for d in plp
        ]

    async def completion(self, req: CompletionRequest, request_id: str, stream: bool):
        prompts = self.completion_prompts(req)
        params = self.sampling_params(req, req.logprobs, stream)
        created = int(time.time())
        rid = f"cmpl-{request_id}"
        if req.kv_transfer_params is not None and len(prompts) > 1:
            raise ValueError("kv_transfer_params need a single prompt")
        handles = []
        try:
            for i, p in enumerate(prompts):
                handles.append(
                    self.engine.add(
                        p,
                        params,
                        f"{request_id}-{i}" if len(prompts) > 1 else request_id,
                        req.kv_transfer_params,
                    )
                )
        except Exception:
            for h in handles:
                self.engine.cancel(h)
            raise
        gens = [self.engine.iterate(h) for h in handles]
        if stream:
            return self._completion_stream(req, rid, created, prompts, params, gens, handles)
        try:
            return await self._completion_full(req, rid, created, prompts, params, gens)
        except BaseException:  # the client left (cancelled), or an error: abort every prompt
            for h in handles:
                self.engine.cancel(h)
            raise

    async def _completion_full(self, req, rid, created, prompts, params, gens) -> dict:
        choices, n_completion, cached, kv_params = [], 0, 0, None
        for pi, (p, g) in enumerate(zip(prompts, gens, strict=True)):
            async for idx, ro in g:
                c = ro.outputs[0]
                kv_params = ro.kv_transfer_params or kv_params
                n_completion += len(c.token_ids)
                cached += ro.num_cached_tokens if idx == 0 else 0
                text = (p.prompt or "") + c.text if req.echo else c.text
                choices.append(
                    {
                        "index": pi * params.n + idx,
                        "text": text,
                        "logprobs": self._completion_logprobs(c.logprobs, c.token_ids, 0)
                        if c.logprobs is not None
                        else None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                        "prompt_logprobs": self._prompt_logprobs_json(ro.prompt_logprobs),
                    }
                )
        choices.sort(key=lambda c: c["index"])
        n_prompt = sum(len(p.prompt_token_ids) for p in prompts)
        return _with_kv_params(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": choices,
                "usage": self._usage(n_prompt, n_completion, cached),
            },
            kv_params,
        )

    async def _completion_stream(
        self, req, rid, created, prompts, params, gens, handles
    ) -> AsyncIterator[str]:
        try:
            async for x in self._completion_events(req, rid, created, prompts, params, gens):
                yield x
        finally:  # client went away: stop every prompt's requests, not only the current one
            for h in handles:
                self.engine.cancel(h)

    async def _completion_events(
        self, req, rid, created, prompts, params, gens
    ) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        n_completion, cached = 0, 0
        offsets: dict[int, int] = {}
        try:
            for pi, (p, g) in enumerate(zip(prompts, gens, strict=True)):
                async for idx, ro in g:
                    c = ro.outputs[0]
                    index = pi * params.n + idx
                    n_completion += len(c.token_ids)
                    if idx == 0 and ro.num_cached_tokens:
                        cached = max(cached, ro.num_cached_tokens)
                    text = c.text
                    if req.echo and index not in offsets:
                        text = (p.prompt or "") + text
                    lp = None
                    if c.logprobs is not None:
                        lp = self._completion_logprobs(
                            c.logprobs, c.token_ids, offsets.get(index, 0)
                        )
                    offsets[index] = offsets.get(index, 0) + len(text)
                    if not text and not c.token_ids and c.finish_reason is None:
                        continue
                    chunk = {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": self.model_name,
                        "choices": [
                            {
                                "index": index,
                                "text": text,
                                "logprobs": lp,
                                "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason,
                            }
                        ],
                    }
                    _with_kv_params(chunk, ro.kv_transfer_params)  # on the final chunk
                    yield f"data: {json.dumps(chunk)}\n\n"
            if include_usage:
                n_prompt = sum(len(p.prompt_token_ids) for p in prompts)
                chunk = {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": self.model_name,
                    "choices": [],
                    "usage": self._usage(n_prompt, n_completion, cached),
                }
                yield f"data: {json.dumps(chunk)}\n\n"
        except ValueError as e:
            yield f"data: {json.dumps(error_body(str(e)))}\n\n"
        except Exception as e:  # noqa: BLE001 (engine died mid-stream)
            yield f"data: {json.dumps(error_body(str(e), 'InternalServerError', 500))}\n\n"
        yield "data: [DONE]\n\n"

    # ---- chat ------------------------------------------------------------------------------------------
    def _chat_logprobs(self, lps, ids) -> dict:
        content = []
        for tid, d in zip(ids, lps, strict=False):
            tok = self._decode(tid)
            top = sorted(d.items(), key=lambda kv: kv[1].rank or 0)
            content.append(
                {
                    "token": tok,
                    "logprob": d[tid].logprob,
                    "bytes": list(tok.encode()),
                    "top_logprobs": [
                        {
                            "token": self._decode(i),
                            "logprob": lp.logprob,
                            "bytes": list(self._decode(i).encode()),
                        }
                        for i, lp in top
                        if lp.rank is not None and lp.rank <= (self._top_n or 0) and i in d
                    ],
                }
            )
        return {"content": content}

    async def chat(self, req: ChatCompletionRequest, request_id: str, stream: bool):
        p = self.chat_prompt(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        self._top_n = req.top_logprobs or 0
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, k, stream)
        created = int(time.time())
        rid = f"chatcmpl-{request_id}"
        outputs = ChatOutputs(
            self.parsers,
            p.prompt or "",
            req.tools,
            effective_tool_choice(req.tools, req.tool_choice),
            req.chat_template_kwargs,
            req.parallel_tool_calls,
        )
        gen = self.engine.iterate(self.engine.add(p, params, request_id, req.kv_transfer_params))
        if stream:
            return self._chat_stream(req, rid, created, p, outputs, gen)
        choices, n_completion, cached, kv_params = [], 0, 0, None
        async for idx, ro in gen:
            c = ro.outputs[0]
            kv_params = ro.kv_transfer_params or kv_params
            n_completion += len(c.token_ids)
            cached = max(cached, ro.num_cached_tokens)
            out = outputs.new_choice()
            message = out.message(c.text)  # first: the finish reason depends on the calls found
            choices.append(
                {
                    "index": idx,
                    "message": message,
                    "logprobs": self._chat_logprobs(c.logprobs, c.token_ids)
                    if c.logprobs is not None
                    else None,
                    "finish_reason": out.finish_reason(c.finish_reason),
                    "stop_reason": c.stop_reason,
                }
            )
        choices.sort(key=lambda c: c["index"])
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": self._usage(len(p.prompt_token_ids), n_completion, cached),
            "prompt_logprobs": None,
        }
        return _with_kv_params(body, kv_params)

    async def _chat_stream(
        self, req, rid, created, p, outputs: ChatOutputs, gen
    ) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        started: dict[int, ChoiceOutput] = {}
        n_completion, cached = 0, 0

        def chunk(choices, kv_params=None, **kw):
            body = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            body.update(kw)
            _with_kv_params(body, kv_params)  # on the final chunk
            return f"data: {json.dumps(body)}\n\n"

        try:
            async for idx, ro in gen:
                c = ro.outputs[0]
                cached = max(cached, ro.num_cached_tokens)
                if idx not in started:
                    started[idx] = outputs.new_choice()
                    yield chunk(
                        [
                            {
                                "index": idx,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
                n_completion += len(c.token_ids)
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                lp = (
                    self._chat_logprobs(c.logprobs, c.token_ids) if c.logprobs is not None else None
                )
                out = started[idx]
                deltas = out.feed(c.text) + (out.finish() if c.finish_reason is not None else [])
                finish = out.finish_reason(c.finish_reason)
                if not deltas and finish is None and lp is None:
                    continue  # text held back (a partial character or tag): nothing to send yet
                # an empty delta carries logprobs or the finish reason when there is no text
                for k, delta in enumerate(deltas or [{"content": ""} if finish is None else {}]):
                    last = k == max(len(deltas), 1) - 1
                    yield chunk(
                        [
                            {
                                "index": idx,
                                "delta": delta,
                                "logprobs": lp if k == 0 else None,
                                "finish_reason": finish if last else None,
                                "stop_reason": c.stop_reason if last else None,
                            }
                        ],
                        ro.kv_transfer_params if last else None,
                    )
            if include_usage:
                yield chunk([], usage=self._usage(len(p.prompt_token_ids), n_completion, cached))
        except ValueError as e:
            yield f"data: {json.dumps(error_body(str(e)))}\n\n"
        except Exception as e:  # noqa: BLE001
            yield f"data: {json.dumps(error_body(str(e), 'InternalServerError', 500))}\n\n"
        yield "data: [DONE]\n\n"


def new_request_id() -> str:
    return uuid.uuid4().hex


def _sampling_json(sp: SamplingParams) -> dict:
    """The sampling parameters as JSON (upstream's ``SamplingParams`` field names)."""
    out = {}
    for k in sp.__dataclass_fields__:
        v = getattr(sp, k)
        if k == "all_stop_token_ids":
            continue
        if k == "structured_outputs" and v is not None:
            v = msgspec.to_builtins(v)
        elif k == "output_kind":
            v = int(v)
        out[k] = v
    return out


def _with_kv_params(body: dict, kv_transfer_params: dict | None) -> dict:
    """Upstream's top-level ``kv_transfer_params`` (on the response, or a stream's final
    chunk): what a P/D router forwards from the prefill engine to the decode engine."""
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return body
