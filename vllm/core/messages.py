"""Messages of the scheduler and the workers (msgspec structs, msgpack on the wire).

front end ──EngineCoreRequest──▶ engine core ──SchedulerOutput──▶ workers
front end ◀─EngineCoreOutput──── engine core ◀─ModelRunnerOutput── driver worker

The scheduler takes requests and returns outputs in these types; the engine core wraps its
outputs for the front end in ``vllm.engine.messages.EngineCoreOutputs``.
"""

from __future__ import annotations

import msgspec

from vllm.distributed.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput
from vllm.distributed.kv_transfer.multi_connector import MultiConnectorMetadata
from vllm.distributed.kv_transfer.nixl_params import NixlConnectorMetadata
from vllm.distributed.kv_transfer.offloading_connector import OffloadMetadata
from vllm.structured_output.params import StructuredOutputsParams


class SamplingOptions(msgspec.Struct, omit_defaults=True):
    """What the engine core and the device sampler need of a request's SamplingParams."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None  # the tokenised SamplingParams.bad_words
    structured: StructuredOutputsParams | None = None  # a grammar the output must follow

    @property
    def position_independent(self) -> bool:
        """Each token's sampling depends only on its logits (and seed and position): what
        speculative decoding needs to verify several drafted positions in one step. Penalties,
        bad words, min_tokens and grammars change from one drafted position to the next."""
        return (
            self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
            and self.repetition_penalty == 1.0
            and not self.bad_words_token_ids
            and self.min_tokens == 0
            and self.structured is None
        )


class EngineCoreRequest(msgspec.Struct):
    request_id: str
    # the front end sends int32 bytes (``token_array(...).tobytes()``: a copy, not 64K ints
    # encoded and decoded one by one); a list is accepted too
    prompt_token_ids: bytes | list[int]
    sampling: SamplingOptions
    eos_token_ids: list[int] = []
    arrival_time: float = 0.0
    kv_transfer_params: dict | None = None


class TokenLogprobs(msgspec.Struct, array_like=True):
    """One position: the chosen token's logprob and rank, and the top-n alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


class EngineCoreOutput(msgspec.Struct, omit_defaults=True):
    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    kv_transfer_params: dict | None = None  # with the final output: what a P/D router forwards


class SpecDecodingStats(msgspec.Struct, omit_defaults=True):
    """Speculative decoding since the last report (upstream's counters): a draft is one
    request's proposed tokens in one step; accepted tokens exclude the bonus token."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []  # [num_speculative_tokens]

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # deltas since the last report
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_cudagraph_steps: int = 0  # steps that replayed a decode CUDA graph (deltas)
    num_cudagraph_split_steps: int = 0  # of which mixed steps (their prompt chunks apart)
    num_piecewise_steps: int = 0  # steps with a forward through piecewise graphs (deltas)
    num_jit_compiles: int = 0  # Triton compiles inside steps after start-up: stalls (deltas)
    # --async-scheduling: steps a worker launched before reading the previous step's results
    num_pipelined_steps: int = 0
    spec_decoding: SpecDecodingStats | None = None  # with --speculative-config
    kv_transfer: dict[str, float] = {}  # KV connector counters (deltas, summed over ranks)
    extra: dict = {}


# ---- engine core <-> workers ----------------------------------------------------------------------
class KVPageUpdate(msgspec.Struct, array_like=True):
    """Where a request's pages live, for KV managers that keep pages off the device (HiSparse):
    what the workers must learn since the last update (everything for a new request)."""

    host: list[int]  # host pool page of each new page (appended to the request's table)
    idx: list[int]  # indexer-key page (on the device) of each new page
    dropped: list[int] = []  # page numbers whose device block was dropped (host copy only)
    restore: list[int] = []  # page numbers known only on host whose indexer keys must be restored
    hot: list[int] = []  # device blocks of a newly leased hot buffer
    upload: list[int] = []  # page numbers whose rows landed in the host pool (a remote engine's
    # KV, P/D) and belong on their device block: the partial last page, which decode extends


class KVCachePlan(msgspec.Struct, omit_defaults=True):
    """Blocks of each pool a worker allocated (the minimum over every rank)."""

    num_blocks: int  # device KV blocks (the scheduler's block pool)
    num_host_blocks: int = 0  # HiSparse: pinned host pool pages
    num_idx_blocks: int = 0  # HiSparse: indexer-key pages on the device


class NewRequestData(msgspec.Struct, array_like=True):
    req_id: str
    # every token the worker must compute from (prompt, or prompt + outputs after preemption):
    # int32 bytes from the scheduler (a copy; a 64K-token list took ~1.4 ms to build and encode
    # and ~2.3 ms to decode and convert); a list is accepted too
    token_ids: bytes | list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingOptions
    kv_update: KVPageUpdate | None = None

    @property
    def num_tokens(self) -> int:
        t = self.token_ids
        return len(t) // 4 if isinstance(t, bytes) else len(t)


class CachedRequestData(msgspec.Struct, array_like=True):
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    kv_update: KVPageUpdate | None = None


class SchedulerOutput(msgspec.Struct, omit_defaults=True):
    step: int = 0
    new_reqs: list[NewRequestData] = []
    cached_reqs: list[CachedRequestData] = []
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    finished_req_ids: list[str] = []
    dummy: bool = False  # DP: run an empty step so EP collectives stay matched
    # --async-scheduling: the engine core sends the next step or b"FLUSH" before it waits for
    # this step's results, so a worker may launch that next step before reading this one
    pipelined: bool = False
    # rows that sample under a grammar this step, and their allowed-token bitmasks
    # ([len, ceil(vocab / 32)] int32, C order; bit j of word w allows token 32·w + j)
    grammar_req_ids: list[str] = []
    grammar_bitmask: bytes = b""
    # the KV connector's instructions to the workers (None: no --kv-transfer-config)
    kv_connector_metadata: (
        KVConnectorMetadata
        | NixlConnectorMetadata
        | OffloadMetadata
        | MultiConnectorMetadata
        | None
    ) = None


class ModelRunnerOutput(msgspec.Struct, omit_defaults=True):
    step: int = 0
    stats: dict = {}  # per-step worker counters (e.g. HiSparse hits/misses/bytes)
    req_ids: list[str] = []
    sampled_token_ids: list[list[int]] = []
    logprobs: dict[str, list[TokenLogprobs]] = {}
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
    # this rank's KV transfers (every rank's reaches the scheduler, combined by aggregate_outputs)
    kv_connector_output: KVConnectorOutput | None = None


class WorkerMessage(msgspec.Struct, omit_defaults=True):
    rank: int
    kind: str  # "ready" | "output" | "error" | "result"
    output: ModelRunnerOutput | None = None
    kv_plan: KVCachePlan | None = None  # with "ready"
    info: dict = {}
    error: str | None = None


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder(t) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(t)
