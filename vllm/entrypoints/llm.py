"""Offline inference: `LLM(model=..., **engine_args).generate(prompts, sampling_params)`.

Same processes as the server (engine core + one worker per rank); the caller's process is the
front end.
"""

from __future__ import annotations

import itertools
import time

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.core_client import EngineCoreClient
from vllm.engine.input_processor import InputProcessor
from vllm.engine.output_processor import OutputProcessor, RequestState
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.tokenizer import Tokenizer
from vllm.utils import init_logging


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        init_logging()
        self.engine_args = EngineArgs.from_kwargs(model, **kwargs)
        self.config = self.engine_args.create_engine_config()
        mc = self.config.model_config
        self.tokenizer = None if mc.skip_tokenizer_init else Tokenizer(mc.tokenizer)
        self.client = EngineCoreClient(self.config)
        self.inputs = InputProcessor(
            self.config, self.tokenizer, self.client.info["max_request_tokens"]
        )
        self.outputs = OutputProcessor()
        self._ids = itertools.count()
        self.stats_history: list = []  # SchedulerStats of every step (engine-side counters)
        # when each of those steps' outputs arrived here (time.perf_counter): step intervals
        self.stats_times: list[float] = []

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        order, groups, reqs = [], {}, []
        for prompt, sp in zip(prompts, plist, strict=True):
            rid = str(next(self._ids))
            p = self.inputs.tokenize(prompt)
            sp = sp.clone(output_kind=RequestOutputKind.FINAL_ONLY)
            children = self.inputs.make_requests(rid, p, sp)
            groups[rid] = []
            for i, (cid, csp, ecr) in enumerate(children):
                st = RequestState(cid, p.prompt, p.prompt_token_ids, csp, self.tokenizer, index=i)
                groups[rid].append(st)
                reqs.append(ecr)
            order.append(rid)
        # all at once: the engine admits the whole batch in one iteration (reproducible steps)
        self.client.add_requests(reqs)
        self._run({st.request_id: st for sts in groups.values() for st in sts}, use_tqdm)
        results = []
        for rid in order:
            sts = groups[rid]
            outs = [self.outputs._make_output(st) for st in sts]
            first = outs[0]
            first.request_id = rid
            first.prompt_token_ids = list(first.prompt_token_ids)  # upstream's type
            first.outputs = [o.outputs[0] for o in outs]
            results.append(first)
        return results

    def _run(self, states: dict[str, RequestState], use_tqdm: bool) -> None:
        pending = set(states)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(pending), desc="Processed prompts")
        while pending:
            batch = self.client.get_output(1.0)
            if batch is None:
                continue
            if batch.stats is not None:
                self.stats_history.append(batch.stats)
                self.stats_times.append(time.perf_counter())
            for out in batch.outputs:
                st = states.get(out.request_id)
                if st is None or st.finished:
                    continue
                _, abort = self.outputs.process(st, out)
                if abort:
                    self.client.abort([st.request_id])
                if st.finished:
                    if st.error:
                        raise ValueError(st.error)
                    pending.discard(st.request_id)
                    self.client.finished(st.request_id)
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (not available with skip_tokenizer_init)")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(c, add_generation_prompt, chat_template)
            for c in convs
        ]
        ids = [
            {"prompt": t, "prompt_token_ids": self.tokenizer.encode(t, add_special_tokens=False)}
            for t in prompts
        ]
        return self.generate(ids, sampling_params, use_tqdm)

    def reset_prefix_cache(self) -> bool:
        """Drop every engine's cached prefix blocks; False if some were in use (nothing then
        changes on that engine)."""
        return all(self.client.call_utility("reset_prefix_cache"))

    def shutdown(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.shutdown()
            self.client = None

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


__all__ = ["LLM"]
