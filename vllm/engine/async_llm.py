"""Asyncio front end over the engine-core client (used by the OpenAI server).

A background thread reads engine outputs and hands each to its request's asyncio queue; requests
are generators of RequestOutput. If the engine dies every open request gets the error and
`on_dead` is called (the server then exits non-zero).
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
        self.inputs = InputProcessor(config, self.tokenizer, self.client.info["max_request_tokens"])
        self.processor = OutputProcessor()
        self.metrics = metrics
        self.on_dead = on_dead
        self.dead: str | None = None
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, RequestState]] = {}
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
                    loop.call_soon_threadsafe(q.put_nowait, ro if ro is not None else st)

    def _finish(self, st: RequestState) -> None:
        with self._lock:
            self._queues.pop(st.request_id, None)
        self.client.finished(st.request_id)
        if self.metrics is not None:
            self.metrics.record_finished(st)

    def _die(self, why: str) -> None:
        self.dead = why
        logger.error("engine died: %s", why)
        with self._lock:
            entries = list(self._queues.values())
            self._queues.clear()
        for loop, q, _ in entries:
            loop.call_soon_threadsafe(q.put_nowait, EngineDeadError(why))
        if self.on_dead is not None:
            self.on_dead(why)

    # ---- requests --------------------------------------------------------------------------------
    def tokenize(self, prompt) -> ProcessedPrompt:
        return self.inputs.tokenize(prompt)

    def add(self, p: ProcessedPrompt, params: SamplingParams, request_id: str) -> RequestHandle:
        """Validate and submit (synchronously, so errors surface before any response starts)."""
        if self.dead:
            raise EngineDeadError(self.dead)
        children = self.inputs.make_requests(request_id, p, params)
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

    async def utility(self, name: str, *args):
        return await asyncio.get_running_loop().run_in_executor(
            None, self.client.call_utility, name, *args
        )

    def shutdown(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.client.shutdown()


__all__ = ["AsyncLLM", "RequestHandle"]
