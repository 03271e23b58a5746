"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Each step gives running decodes their next token first, then unfinished prompt chunks, then
admits waiting requests while the token budget (`--max-num-batched-tokens`), the seat cap
(`--max-num-seqs`) and the block pool allow. When blocks run out for a running request the most
recently admitted unscheduled one is preempted: its blocks are freed and it is recomputed later.

Fairness: while requests wait for a seat, a running prefill leaves them room in the step (what
the first waiting ones would compute, up to half the budget), so a short prompt gets its first
token the step after it arrives instead of after a long prompt's whole prefill (not yet under
HiSparse: see `schedule`). A prefill chunk
is also capped per request at `--long-prefill-token-threshold` when that is set (upstream's
meaning). Alone, a long prompt takes the whole budget.
"""

from __future__ import annotations

from collections import deque

from vllm.config import VllmConfig
from vllm.core.kv_cache_manager import DeviceKVCacheManager, KVCacheManager
from vllm.core.kv_connector_state import PARKED, KVConnectorScheduler
from vllm.core.messages import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreRequest,
    KVCachePlan,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
    SpecDecodingStats,
)
from vllm.core.request import Request, RequestStatus

_FINISHED = RequestStatus.FINISHED_STOPPED  # statuses from here on are final


def make_kv_manager(config: VllmConfig, plan: KVCachePlan) -> KVCacheManager:
    """The KV manager of this engine, chosen once from the configuration."""
    block_size, caching = config.scheduler_block_size, config.cache_config.enable_prefix_caching
    if config.attention_config.hisparse is not None:
        from vllm.hisparse.manager import HiSparseKVManager

        return HiSparseKVManager(
            plan.num_blocks,
            plan.num_host_blocks,
            plan.num_idx_blocks,
            block_size,
            config.hot_buffer_rows,
            caching,
        )
    return DeviceKVCacheManager(plan.num_blocks, block_size, caching)


class Scheduler:
    def __init__(self, config: VllmConfig, plan: KVCachePlan):
        self.config = config
        sc = config.scheduler_config
        self.max_num_batched_tokens = sc.max_num_batched_tokens
        self.max_num_seqs = sc.max_num_seqs
        self.chunked_prefill = sc.enable_chunked_prefill
        self.long_prefill_threshold = sc.long_prefill_token_threshold
        self.max_model_len = config.model_config.max_model_len
        self.block_size = config.scheduler_block_size
        self.kv = make_kv_manager(config, plan)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_ids: list[str] = []  # to tell the workers
        self._stuck: list[Request] = []  # requests that can never be allocated (reported as errors)
        self._errors: list[EngineCoreOutput] = []  # requests failed for other reasons
        self._grammar = None  # StructuredOutputManager, made at the first structured request
        # e.g. HiSparse: a prefill chunk's pages must fit in the GPU pool next to the hot buffer
        self.max_chunk = self.kv.max_chunk_tokens() or 1 << 62
        self.step = 0
        self.num_spec_tokens = config.num_spec_tokens
        self._spec: dict[str, int] = {}  # drafted tokens verified this step, per request
        self._stats = self._new_stats()
        self._worker_stats: dict[str, float] = {}
        self.kv_connector = KVConnectorScheduler(config, self.kv, self.waiting)
        self.async_scheduling = sc.async_scheduling
        self._placeholders: dict[int, list[str]] = {}  # step -> requests it samples (async)

    # ---- admission ------------------------------------------------------------------------
    @property
    def max_request_tokens(self) -> int:
        """Longest request (prompt + output) the engine can hold: the smaller of --max-model-len
        and the KV capacity."""
        return min(self.max_model_len, self.kv.capacity_tokens)

    def add_request(self, ecr: EngineCoreRequest) -> EngineCoreOutput | None:
        """Queue a request; returns an immediate error output if it can never run."""
        req = Request(ecr)
        need = req.num_prompt_tokens + (req.max_tokens or 0)
        if req.num_prompt_tokens == 0:
            return EngineCoreOutput(req.request_id, finish_reason="error", error="prompt is empty")
        if need > self.max_request_tokens:
            return EngineCoreOutput(
                req.request_id,
                finish_reason="error",
                error=(
                    f"request needs {need} tokens of context (prompt {req.num_prompt_tokens} + "
                    f"max_tokens {req.max_tokens}), more than this engine holds per request "
                    f"({self.max_request_tokens}: max_model_len {self.max_model_len}, KV capacity "
                    f"{self.kv.capacity_tokens})"
                ),
            )
        if ecr.sampling.structured is not None:
            self.grammars.add(req.request_id, ecr.sampling.structured)
        self.requests[req.request_id] = req
        self.waiting.append(req)
        return None

    @property
    def grammars(self):
        """The structured-output matchers (xgrammar loads on a background thread at first use)."""
        if self._grammar is None:
            from vllm.structured_output.manager import StructuredOutputManager

            mc = self.config.model_config
            self._grammar = StructuredOutputManager(
                mc.tokenizer, mc.vocab_size, list(mc.arch.eos_token_id)
            )
        return self._grammar

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                self._finish(req, RequestStatus.FINISHED_ABORTED)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running) or self.kv_connector.has_pending()

    # ---- scheduling -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step += 1
        budget = self.max_num_batched_tokens
        num_sched: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        preempted: list[Request] = []
        updates: list[tuple[Request, bool, list[int] | None, int]] = []

        # decodes first, then unfinished prompts (chunks), each in admission order; what each
        # request has left: nothing another request's scheduling changes (inlined: this runs for
        # every running request every step)
        lefts = [
            (
                r,
                r.prompt_len
                + len(r.output_token_ids)
                + r.num_output_placeholders
                - r.num_computed_tokens,
            )
            for r in self.running
        ]
        if self.async_scheduling:  # a request whose last token is in flight has nothing to do
            emitted_all = self._emitted_all
            lefts = [(r, 0 if emitted_all(r) else left) for r, left in lefts]
        order = [x for x in lefts if x[1] <= 1]
        order += [x for x in lefts if x[1] > 1]
        fair = self.chunked_prefill
        reserve = self._newcomer_reserve() if fair else 0
        allocate, spec_on, running = (
            self.kv.allocate_slots,
            self.num_spec_tokens,
            RequestStatus.RUNNING,
        )
        # a manager that tells the workers where pages live (HiSparse) builds every message
        # after the step's last allocation; otherwise a running request's is built at once
        page_updates = type(self.kv).worker_update is not KVCacheManager.worker_update
        async_on = self.async_scheduling
        samples: list[str] = []  # requests this step samples (async scheduling)
        admitted: list[tuple[Request, int]] = []  # (newly running request, its tokens)
        for req, left in order:
            if budget <= 0:
                break
            if req.status != running:  # preempted earlier in this step
                continue
            assert left > 0 or self.async_scheduling, f"{req.request_id} has nothing to compute"
            if left <= 0:
                continue
            if left == 1:  # a decode (budget >= 1 here): verify the drafts proposed last step too
                n = 1 + self._num_drafts(req, budget - 1) if spec_on else 1
            else:
                n = min(left, budget - reserve, self.max_chunk, self._prefill_cap(left))
                if n <= 0 or (not self.chunked_prefill and n < left):
                    continue
            # within the blocks it holds: nothing to allocate (the manager keeps kv_room)
            new_blocks = [] if req.num_computed_tokens + n <= req.kv_room else allocate(req, n)
            while new_blocks is None:
                victim = self._victim(num_sched)
                self.running.remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
                new_blocks = self.kv.allocate_slots(req, n)
            if new_blocks is None:
                break
            num_sched[req.request_id] = n
            if left == 1 and n > 1:
                self._spec[req.request_id] = n - 1
            start = req.num_computed_tokens
            if page_updates:
                updates.append((req, False, new_blocks, start))
            else:  # its message now: no later allocation changes what the workers learn
                cached.append(CachedRequestData(req.request_id, new_blocks, start))
            req.num_computed_tokens = start + n
            # a chunk reaching the newest token samples the next one (in flight: a placeholder)
            if async_on and start + n >= req.prompt_len + len(req.output_token_ids) + (
                req.num_output_placeholders
            ):
                req.num_output_placeholders += 1
                samples.append(req.request_id)
            budget -= n

        compiling: list[Request] = []  # waiting for their grammar: keep their place
        while (
            self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted
        ):
            req = self.waiting[0]
            if (
                self._grammar is not None
                and (ready := self._grammar.ready(req.request_id)) is not True
            ):
                self.waiting.popleft()
                if ready is False:
                    compiling.append(req)
                else:
                    self._fail(req, ready)
                continue
            hit = self.kv_connector.lookup(req)  # local prefix hit, or parked for remote KV
            if hit is PARKED:
                self.waiting.popleft()
                continue
            if hit is None:
                break
            hit_blocks, num_hit = hit
            n = req.num_tokens - num_hit
            if n > budget:
                if not self.chunked_prefill:
                    break
                n = budget
            n = min(n, self.max_chunk, self._prefill_cap(n))
            new_blocks = self.kv.allocate_slots(req, n, hit_blocks)
            if new_blocks is None:
                if (
                    not self.running
                ):  # nothing will ever free room for it: fail, do not wait forever
                    self.waiting.popleft()
                    self._stuck.append(req)
                break
            self.waiting.popleft()
            self.kv_connector.allocated(req)
            if req.num_cached_tokens < 0:  # first admission
                req.num_cached_tokens = num_hit
                self.kv.record_prefix_lookup(req, num_hit)
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            updates.append((req, True, None, num_hit))
            admitted.append((req, n))
            num_sched[req.request_id] = n
            budget -= n

        self.waiting.extendleft(reversed(compiling))

        # messages are built after every allocation of the step: a later allocation may have
        # changed an earlier request's pages (HiSparse drops)
        worker_update = self.kv.worker_update
        for req, is_new, new_blocks, start in updates:
            extra = worker_update(req, is_new)
            if is_new:
                new_reqs.append(
                    NewRequestData(
                        req.request_id,
                        req.all_token_bytes(),
                        req.num_prompt_tokens,
                        self.kv.blocks_of(req),
                        start,
                        req.sampling,
                        extra,
                    )
                )
            else:
                cached.append(CachedRequestData(req.request_id, new_blocks, start, extra))
        for req, n in admitted:  # (the running ones were advanced as they were scheduled)
            req.num_computed_tokens += n
            if async_on and req.num_computed_tokens >= (
                req.num_tokens + req.num_output_placeholders
            ):
                req.num_output_placeholders += 1
                samples.append(req.request_id)
        grammar_ids: list[str] = []
        if self._grammar is not None:  # rows that finish their prompt this step sample a token
            grammar_ids = [
                rid
                for rid in num_sched
                if self._grammar.has(rid)
                and self.requests[rid].num_computed_tokens >= self.requests[rid].num_tokens
            ]
        if samples:
            self._placeholders[self.step] = samples
        out = SchedulerOutput(
            step=self.step,
            new_reqs=new_reqs,
            cached_reqs=cached,
            num_scheduled_tokens=num_sched,
            total_num_scheduled_tokens=sum(num_sched.values()),
            finished_req_ids=self.finished_ids,
            grammar_req_ids=grammar_ids,
            grammar_bitmask=self._grammar.bitmask(grammar_ids).tobytes() if grammar_ids else b"",
        )
        self._stats.num_preemptions += len(preempted)
        self.finished_ids = []
        self.kv_connector.build_meta(out)
        return out

    def _emitted_all(self, req: Request) -> bool:
        """Its tokens, those in flight included, reach max_tokens or the context limit."""
        n = req.num_tokens + req.num_output_placeholders
        out = len(req.output_token_ids) + req.num_output_placeholders
        return n >= self.max_request_tokens or (
            req.max_tokens is not None and out >= req.max_tokens
        )

    def can_schedule_ahead(self) -> bool:
        """--async-scheduling: whether the next step may be scheduled before the one in flight
        has reported. Not while a request follows a grammar (its next bitmask needs the token
        in flight): those steps are scheduled after the results, as without the flag."""
        if not self.async_scheduling:
            return False
        return self._grammar is None or not any(
            self._grammar.has(r.request_id) for r in self.running
        )

    def _num_drafts(self, req: Request, room: int) -> int:
        """Drafted tokens to verify with a decode of ``req``: --speculative-config's count, no
        more than the request may still emit after the bonus token or its context can hold."""
        if not self.num_spec_tokens or not req.spec_ok or not req.has_drafts:
            return 0
        k = min(self.num_spec_tokens, room, self.max_request_tokens - req.num_tokens)
        if req.max_tokens is not None:
            k = min(k, req.max_tokens - len(req.output_token_ids) - 1)
        return max(k, 0)

    def _prefill_cap(self, n: int) -> int:
        """--long-prefill-token-threshold: the most prompt tokens one request computes per step."""
        t = self.long_prefill_threshold
        return t if 0 < t < n else n

    def _newcomer_reserve(self) -> int:
        """Budget a running prefill leaves this step to the requests waiting for a free seat: what
        they would compute (without prefix hits), at most half the budget."""
        seats = self.max_num_seqs - len(self.running)
        need = 0
        for req in list(self.waiting)[: max(seats, 0)]:
            need += self._prefill_cap(req.num_tokens - req.num_computed_tokens)
        return min(need, self.max_num_batched_tokens // 2)

    def _victim(self, scheduled: dict[str, int]) -> Request:
        """The most recently admitted running request not yet given tokens this step."""
        for r in reversed(self.running):
            if r.request_id not in scheduled:
                return r
        raise AssertionError("no running request left to preempt")

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.has_drafts = False
        req.block_hashes = req.block_hashes[: req.num_tokens // self.block_size]
        self.waiting.appendleft(req)
        self.finished_ids.append(req.request_id)  # the workers drop their state for it

    # ---- results ------------------------------------------------------------------------------
    def _fail(self, req: Request, error: str) -> None:
        """End a waiting request with an error output (sent with the step's results)."""
        self._errors.append(EngineCoreOutput(req.request_id, finish_reason="error", error=error))
        self.requests.pop(req.request_id, None)
        if self._grammar is not None:
            self._grammar.remove(req.request_id)

    def take_stuck(self) -> list[EngineCoreOutput]:
        out, self._errors = self._errors, []
        for req in self._stuck:
            out.append(
                EngineCoreOutput(
                    req.request_id,
                    finish_reason="error",
                    error=(
                        f"request {req.request_id} cannot be placed in the KV cache even with nothing else "
                        f"running ({req.num_tokens} tokens, {self.kv.pool.num_blocks} blocks of {self.block_size})"
                    ),
                )
            )
            self.requests.pop(req.request_id, None)
            self.kv.free(req)
        self._stuck = []
        return out

    def update_from_output(
        self, so: SchedulerOutput, ro: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for req, error in self.kv_connector.update(ro.kv_connector_output):
            self._finish(req, RequestStatus.FINISHED_ERROR)
            outputs.append(EngineCoreOutput(req.request_id, finish_reason="error", error=error))
        for k, v in ro.stats.items():
            self._worker_stats[k] = self._worker_stats.get(k, 0) + v
        # (request, its tokens) of every scheduled row; a step where every row sampled (a decode
        # step) pairs the runner's lists as they are, without a dict of them
        if len(ro.req_ids) == len(so.num_scheduled_tokens):
            rows = zip(ro.req_ids, ro.sampled_token_ids, strict=True)
        else:
            sampled = dict(zip(ro.req_ids, ro.sampled_token_ids, strict=True))
            rows = ((rid, sampled.get(rid, ())) for rid in so.num_scheduled_tokens)
        for rid in self._placeholders.pop(so.step, ()):
            req = self.requests.get(rid)
            if req is not None:
                req.num_output_placeholders -= 1
        spec, self._spec = self._spec, {}
        max_len = self.max_request_tokens
        # per request, every step: names bound once (B = 256 decode rows went through ~2.3 µs
        # of attribute lookups and property calls each)
        grammar, spec_on = self._grammar, self.num_spec_tokens
        get_req, publish, check_stop = (
            self.requests.get,
            self.kv.cache_full_blocks,
            self._check_stop,
        )
        logprobs, prompt_lps = ro.logprobs, ro.prompt_logprobs
        aborted = RequestStatus.FINISHED_ABORTED
        if grammar is None and not spec_on and not prompt_lps and not spec:
            # one token a sampled row, nothing but the stop rules to apply: the loop below
            # without its branches (the usual decode step)
            for rid, toks in rows:
                req = get_req(rid)
                if req is None or req.status >= _FINISHED:
                    continue
                if req.num_computed_tokens >= req.kv_publish_at:
                    publish(req, req.num_computed_tokens)
                if len(toks) != 1:
                    if not toks:
                        continue
                    raise AssertionError(f"{rid}: {len(toks)} tokens in a step without drafts")
                t = toks[0]
                out_ids = req.output_token_ids
                out_ids.append(t)
                n_out = len(out_ids)
                finished = (
                    t in req.stop_tokens
                    or n_out >= req.max_output
                    or req.prompt_len + n_out >= max_len
                ) and check_stop(req, t, max_len)
                outputs.append(
                    EngineCoreOutput(
                        rid,
                        toks,
                        logprobs[rid][:1] if logprobs and rid in logprobs else None,
                        None,
                        req.status.finish_reason if finished else None,
                        req.stop_reason,
                        req.num_cached_tokens if req.num_cached_tokens > 0 else 0,
                    )
                )
            return self.kv_connector.attach_params(outputs)
        for rid, toks in rows:
            req = get_req(rid)
            if req is None or req.status >= _FINISHED:
                continue
            if spec and rid in spec and req.status == RequestStatus.RUNNING:
                # the KV of rejected drafts is stale: recompute from the first one (overwritten)
                drafted, accepted = spec[rid], max(len(toks) - 1, 0)
                req.num_computed_tokens -= drafted - accepted
                self._stats.spec_decoding.observe(drafted, accepted)
            if toks and spec_on:
                req.has_drafts = True
            if req.num_computed_tokens >= req.kv_publish_at:  # a block may have completed
                publish(req, req.num_computed_tokens)
            if grammar is None:
                new_ids = list(toks)
                out_ids = req.output_token_ids
                stops, cap, plen = req.stop_tokens, req.max_output, req.prompt_len
                for i, t in enumerate(toks):
                    out_ids.append(t)
                    n_out = len(out_ids)
                    # the full test only where it may end (a stop token, a length limit)
                    if (t in stops or n_out >= cap or plen + n_out >= max_len) and check_stop(
                        req, t, max_len
                    ):
                        del new_ids[i + 1 :]
                        break
            else:
                new_ids = self._accept_constrained(req, toks, max_len, outputs)
            status = req.status
            if status == aborted:  # outside its grammar: reported above
                continue
            finished = status >= _FINISHED
            plp = prompt_lps.get(rid) if prompt_lps else None
            if not new_ids and plp is None and not finished:
                continue
            outputs.append(
                EngineCoreOutput(
                    rid,
                    new_ids,
                    logprobs[rid][: len(new_ids)] if logprobs and rid in logprobs else None,
                    plp,
                    status.finish_reason if finished else None,
                    req.stop_reason,
                    req.num_cached_tokens if req.num_cached_tokens > 0 else 0,
                )
            )
        return self.kv_connector.attach_params(outputs)

    def _accept_constrained(
        self, req: Request, toks, max_len: int | None, outputs: list[EngineCoreOutput]
    ) -> list[int]:
        """Append the sampled tokens of a step under structured outputs: each must be allowed
        by the request's grammar (else the request ends with an error output), and a grammar
        that has terminated ends the request. Returns the tokens appended."""
        rid, grammar, new_ids = req.request_id, self._grammar, []
        for t in toks:
            if not grammar.accept(rid, t):
                self._finish(req, RequestStatus.FINISHED_ABORTED)
                outputs.append(
                    EngineCoreOutput(
                        rid,
                        finish_reason="error",
                        error=f"token {t} was sampled outside the request's grammar",
                    )
                )
                break
            req.output_token_ids.append(t)
            new_ids.append(t)
            if self._check_stop(req, t, max_len):
                break
            if grammar.terminated(rid):
                self._finish(req, RequestStatus.FINISHED_STOPPED)  # nothing may follow
                break
        return new_ids

    def _check_stop(self, req: Request, token: int, max_len: int | None = None) -> bool:
        """Whether ``token`` (just appended) ends ``req``; ``max_len``: max_request_tokens."""
        s = req.sampling
        n_out = len(req.output_token_ids)
        if n_out >= s.min_tokens:
            if token in req.eos_token_ids and not s.ignore_eos:
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                return True
            if token in s.stop_token_ids:
                req.stop_reason = token
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                return True
        if max_len is None:
            max_len = self.max_request_tokens
        max_tokens = req.max_tokens
        if (max_tokens is not None and n_out >= max_tokens) or len(
            req.prompt_token_ids
        ) + n_out >= max_len:
            self._finish(req, RequestStatus.FINISHED_LENGTH)
            return True
        return False

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
            self.finished_ids.append(req.request_id)
        elif req in self.waiting:
            self.waiting.remove(req)
        if not self.kv_connector.request_finished(req):  # else leased to a remote engine
            self.kv.free(req)
        self.requests.pop(req.request_id, None)
        if self._grammar is not None:
            self._grammar.remove(req.request_id)

    def stats(self) -> SchedulerStats:
        s = self._stats
        s.num_running, s.num_waiting, s.kv_cache_usage = (
            len(self.running),
            len(self.waiting) + len(self.kv_connector.loading),  # loading: waiting too
            self.kv.usage(),
        )
        s.prefix_cache_queries, s.prefix_cache_hits = self.kv.take_prefix_cache_stats()
        s.extra = self.kv.extra_stats(self._worker_stats)
        s.num_cudagraph_steps = int(self._worker_stats.get("cudagraph_steps", 0))
        s.num_cudagraph_split_steps = int(self._worker_stats.get("cudagraph_split_steps", 0))
        s.num_piecewise_steps = int(self._worker_stats.get("piecewise_steps", 0))
        s.num_jit_compiles = int(self._worker_stats.get("jit_compiles", 0))
        s.num_pipelined_steps = int(self._worker_stats.get("pipelined_steps", 0))
        s.kv_transfer = self.kv_connector.take_stats()
        self._worker_stats = {}
        self._stats = self._new_stats()
        return s

    def _new_stats(self) -> SchedulerStats:
        spec = None
        if self.num_spec_tokens:
            spec = SpecDecodingStats(num_accepted_tokens_per_pos=[0] * self.num_spec_tokens)
        return SchedulerStats(spec_decoding=spec)
