from __future__ import annotations

import enum
import time
from array import array

from vllm.core.messages import EngineCoreRequest
from vllm.utils import token_array


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_REMOTE_KVS = 3  # holds its blocks while a KV connector loads its prompt's KV
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {4: "stop", 5: "length", 6: "abort", 7: "error"}.get(int(self))


class Request:
    """One request as the scheduler tracks it."""

    def __init__(self, req: EngineCoreRequest):
        self.request_id = req.request_id
        # packed int32: no collection ever walks its elements (``vllm.utils.token_array``)
        self.prompt_token_ids: array = token_array(req.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling = req.sampling
        self.eos_token_ids = set(req.eos_token_ids)
        self.max_tokens = req.sampling.max_tokens
        self.arrival_time = req.arrival_time or time.time()
        self.kv_transfer_params = req.kv_transfer_params  # P/D: what the KV connector reads
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes] = []
        self.spec_ok = req.sampling.position_independent  # may verify drafted tokens
        # the workers drafted after this request's last sampled token (every step that samples
        # an eligible request drafts; a preemption drops the drafts with the workers' state)
        self.has_drafts = False
        # --async-scheduling: tokens sampled by steps in flight, not yet appended
        self.num_output_placeholders = 0
        # the scheduler's per-step quick tests (each step looks at every running request):
        # the tokens that may end it (stop tokens count only past min_tokens: checked then),
        # its output count cap, and, kept by the KV manager, the tokens its blocks hold (a step
        # within them allocates nothing) and the computed count at which its next block
        # completes (nothing to publish before); 0: ask the manager
        s = req.sampling
        self.stop_tokens = set(s.stop_token_ids) | (set() if s.ignore_eos else self.eos_token_ids)
        self.max_output = self.max_tokens if self.max_tokens is not None else 1 << 62
        self.prompt_len = len(self.prompt_token_ids)
        self.kv_room = 0
        self.kv_publish_at = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    def all_token_bytes(self) -> bytes:
        """all_token_ids as int32 bytes (what a worker is sent for a new request)."""
        b = self.prompt_token_ids.tobytes()
        return b + array("i", self.output_token_ids).tobytes() if self.output_token_ids else b

    def token_slice(self, a: int, b: int) -> list[int]:
        """all_token_ids[a:b] without building the whole list (a block's tokens, every 64 steps
        of a long request)."""
        n = len(self.prompt_token_ids)
        if b <= n:
            return list(self.prompt_token_ids[a:b])
        if a >= n:
            return self.output_token_ids[a - n : b - n]
        return [*self.prompt_token_ids[a:], *self.output_token_ids[: b - n]]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def use_prefix_cache(self) -> bool:
        return self.sampling.prompt_logprobs is None
