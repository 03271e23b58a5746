"""The envelope of the engine core's replies to the front end (msgspec, msgpack on the wire); the
requests and outputs inside it are the scheduler's types (``vllm.core.messages``)."""

from __future__ import annotations

import msgspec

from vllm.core.messages import EngineCoreOutput, SchedulerStats


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    stats: SchedulerStats | None = None
    ready: dict | None = None  # the start-up handshake
    utility: list | None = None  # [call_id, result, error]
    fatal: str | None = None  # the engine is dying: every request fails with this
