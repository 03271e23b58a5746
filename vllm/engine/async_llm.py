"""Asyncio front end over the engine-core client (used by the OpenAI server).

One background thread is the only reader of the engine-core output socket: it hands each request's
outputs to that request's asyncio queue, and each utility reply (control calls such as
``reset_prefix_cache``) to the future waiting for its call id. Requests are generators of
RequestOutput. If the engine dies every open request and call gets the error and `on_dead` is
called (the server then exits non-zero).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from vllm.config import VllmConfig
from vllm.engine.core_client import EngineCoreClient
from vllm.engine.input_processor import InputProcessor, ProcessedPrompt
from vllm.engine.output_processor import OutputProcessor, RequestState
from vllm.metrics import Metrics
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.tokenizer import Tokenizer
from vllm.utils import EngineDeadError, logger


@dataclass
class RequestHandle:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    states: list[RequestState]


@dataclass
class _UtilityCall:
    """A control call waiting for one reply per engine core."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    waiting: int  # engines yet to answer
    answers: dict[int, object]


class AsyncLLM:
    def __init__(
        self,
        config: VllmConfig,
        metrics: Metrics | None = None,
        on_dead: Callable[[str], None] | None = None,
    ):
        self.config = config
        mc = config.model_config
        self.tokenizer = None if mc.skip_tokenizer_init else Tokenizer(mc.tokenizer)
        self.client = EngineCoreClient(config)
        try:
            self.inputs = InputProcessor(
                config, self.tokenizer, self.client.info["max_request_tokens"]
            )
        except BaseException:  # SIGINT included: no engine process may outlive this
            self.client.shutdown()
            raise
        self.processor = OutputProcessor(config.scheduler_config.stream_interval)
        self.metrics = metrics
        self.on_dead = on_dead
        self.dead: str | None = None
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, RequestState]] = {}
        self._calls: dict[int, _UtilityCall] = {}
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._pump, name="engine-output", daemon=True)
        self._thread.start()

    # ---- output thread -------------------------------------------------------------------------
    def _pump(self) -> None:
        while not self._stop:
            try:
                batch = self.client.get_output(0.2)
            except EngineDeadError as e:
                self._die(str(e))
                return
            except Exception as e:  # noqa: BLE001 (socket closed at shutdown)
                if not self._stop:
                    self._die(f"engine output channel failed: {e}")
                return
            if batch is None:
                continue
            if batch.stats is not None and self.metrics is not None:
                self.metrics.record_stats(batch.stats)
            if batch.utility is not None:
                self._answer(batch.engine_index, *batch.utility)
            # one wake-up of each event loop per engine batch, not one per request output: each
            # call_soon_threadsafe writes to the loop's self-pipe (a syscall a token a stream)
            puts: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
            for out in batch.outputs:
                with self._lock:
                    entry = self._queues.get(out.request_id)
                if entry is None:
                    continue
                loop, q, st = entry
                ro, abort = self.processor.process(st, out)
                if abort:
                    self.client.abort([st.request_id])
                if st.finished:
                    self._finish(st)
                if ro is not None or st.finished:
                    puts.setdefault(loop, []).append((q, ro if ro is not None else st))
            for loop, items in puts.items():
                loop.call_soon_threadsafe(_put_all, items)

    def _finish(self, st: RequestState) -> None:
        with self._lock:
            self._queues.pop(st.request_id, None)
        self.client.finished(st.request_id)
        if self.metrics is not None:
            self.metrics.record_finished(st)

    def _answer(self, engine: int, call_id: int, result, error: str | None) -> None:
        with self._lock:
            call = self._calls.get(call_id)
            if call is None:  # its caller gave up (timeout): nothing waits for it
                return
            call.waiting -= 1
            call.answers[engine] = RuntimeError(error) if error else result
            done = call.waiting == 0 or error
            if done:
                self._calls.pop(call_id, None)
        if done:
            answer = [call.answers[e] for e in sorted(call.answers)]
            call.loop.call_soon_threadsafe(_settle, call.future, answer)

    def _die(self, why: str) -> None:
        self.dead = why
        logger.error("engine died: %s", why)
        self.fail_open(why)
        if self.on_dead is not None:
            self.on_dead(why)

    def fail_open(self, why: str) -> None:
        """Fail every open request and control call with EngineDeadError(why): the engine died,
        or the server is stopping and does not wait for them."""
        with self._lock:
            entries = list(self._queues.values())
            self._queues.clear()
            calls = list(self._calls.values())
            self._calls.clear()
        for loop, q, _ in entries:
            loop.call_soon_threadsafe(q.put_nowait, EngineDeadError(why))
        for call in calls:
            call.loop.call_soon_threadsafe(_settle, call.future, [EngineDeadError(why)])

    # ---- requests --------------------------------------------------------------------------------
    def tokenize(self, prompt) -> ProcessedPrompt:
        return self.inputs.tokenize(prompt)

    def add(
        self,
        p: ProcessedPrompt,
        params: SamplingParams,
        request_id: str,
        kv_transfer_params: dict | None = None,
    ) -> RequestHandle:
        """Validate and submit (synchronously, so errors surface before any response starts).
        ``kv_transfer_params``: P/D disaggregation's (a router sends them)."""
        if self.dead:
            raise EngineDeadError(self.dead)
        children = self.inputs.make_requests(request_id, p, params, kv_transfer_params)
        h = RequestHandle(asyncio.get_running_loop(), asyncio.Queue(), [])
        for i, (cid, csp, ecr) in enumerate(children):
            st = RequestState(cid, p.prompt, p.prompt_token_ids, csp, self.tokenizer, index=i)
            h.states.append(st)
            with self._lock:
                self._queues[cid] = (h.loop, h.queue, st)
            if self.metrics is not None:
                self.metrics.record_arrival(st)
            self.client.add_request(ecr)
        return h

    async def iterate(self, h: RequestHandle) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yields (choice index, output) for each of the n children as they progress."""
        open_children = len(h.states)
        try:
            while open_children:
                item = await h.queue.get()
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, RequestState):
                    open_children -= 1
                    if item.error:
                        raise ValueError(item.error)
                    continue
                ro: RequestOutput = item
                if ro.metrics.get("error"):
                    raise ValueError(ro.metrics["error"])
                if ro.finished:
                    open_children -= 1
                yield ro.outputs[0].index, ro
        finally:
            self.cancel(h)

    def cancel(self, h: RequestHandle) -> None:
        left = [st for st in h.states if not st.finished]
        if left:
            self.client.abort([st.request_id for st in left])
            for st in left:
                st.finish_reason = "abort"
                self._finish(st)

    async def generate(
        self, p: ProcessedPrompt, params: SamplingParams, request_id: str
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        async for item in self.iterate(self.add(p, params, request_id)):
            yield item

    async def utility(self, name: str, *args, timeout: float = 60.0) -> list:
        """Run a control call on every engine core; returns one answer per engine, in engine
        order. The reply comes back through the output thread, matched by call id, so requests
        in flight are never disturbed."""
        if self.dead:
            raise EngineDeadError(self.dead)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        engines = self.config.parallel_config.data_parallel_size
        with self._lock:  # registered before it is sent: the reply cannot arrive unclaimed
            cid = self.client.next_call_id()
            self._calls[cid] = _UtilityCall(loop, fut, engines, {})
        try:
            self.client.send_utility(name, list(args), call_id=cid)
            return await asyncio.wait_for(fut, timeout)
        finally:
            with self._lock:
                self._calls.pop(cid, None)

    def shutdown(self) -> None:
        """Stop the output thread first (so the engine processes stopped next are not reported
        as a death), then the engine cores and workers, within seconds even mid-step."""
        self._stop = True
        self._thread.join(2)
        self.client.shutdown()


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    """On the event loop: hand one engine batch's outputs to their requests' queues, in order."""
    for q, item in items:
        q.put_nowait(item)


def _settle(fut: asyncio.Future, answer: list) -> None:
    """Resolve a utility call's future on its own loop: the first error raises, else the list."""
    if fut.done():
        return
    err = next((a for a in answer if isinstance(a, Exception)), None)
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(answer)


__all__ = ["AsyncLLM", "RequestHandle"]
