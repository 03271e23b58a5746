"""Workloads for `vllm bench agentic`: synthetic AgentX sessions (weka_trace) and Mooncake slices.

A weka_trace session is one JSON file, `{id, models[], block_size, hash_id_scope: "local",
tool_tokens, system_tokens, requests[]}`; a request is `{t, type, model, in, out, hash_ids[],
think_time, api_time, stop}` and a sub-agent is a `{type: "subagent", ..., requests[]}` entry whose
inner requests run before the parent's next turn. `hash_ids` name the `block_size`-token blocks of
the prompt: equal ids at the same position are a reusable KV prefix. The AgentX harness rebuilds
prompts from them, so prefix sharing in the trace becomes prefix-cache hits on the server.

The synthesiser follows AgentX's published shape (replayed Claude Code sessions): a median of ~43
turns, a tools + system prefix, tool outputs appended every turn with >95 % of each turn's input
shared with the previous turn, a few hundred output tokens per turn, think times between turns,
compaction when the context passes a cap, and sub-agents in some sessions. `TraceShape.scaled`
shrinks tokens, outputs, turns and times independently, so a tiny model on a CPU replays the
same shape in minutes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import statistics
from dataclasses import dataclass

from vllm.benchmarks import BenchmarkError


@dataclass(frozen=True)
class TraceShape:
    """Every dimension of a synthetic session. Lengths in tokens, times in seconds."""

    turns_median: float = 43.0
    turns_sigma: float = 0.5  # lognormal spread of turns per session
    min_turns: int = 3
    tool_tokens: int = 16_000  # tool schemas: the first blocks of every request (and sub-agent)
    system_tokens: int = 12_000
    first_user_tokens: int = 12_000  # task, CLAUDE.md-style context, first files
    tool_output_median: float = 4_000.0  # appended every turn (file reads, command output, ...)
    tool_output_sigma: float = 1.0
    output_median: float = 444.0
    output_sigma: float = 0.6
    max_output_tokens: int = 4_096
    max_context: int = 256_000  # past this the session compacts to prefix + summary
    compact_tokens: int = 24_000
    min_shared_fraction: float = 0.95  # tool output is clamped so a turn shares this much
    think_median_s: float = 3.0
    think_sigma: float = 1.0
    subagent_session_fraction: float = 0.3
    max_subagents: int = 3
    subagent_turns_median: float = 12.0
    subagent_system_tokens: int = 6_000
    subagent_prompt_tokens: int = 800
    block_size: int = 64
    # Only used to write plausible `api_time`s (the harness turns t - (t_prev + api_prev) into
    # the think time before each turn).
    prefill_tok_s: float = 20_000.0
    decode_tok_s: float = 60.0

    def scaled(
        self,
        tokens: float = 1.0,
        outputs: float | None = None,
        turns: float = 1.0,
        time: float = 1.0,
        block_size: int | None = None,
    ) -> TraceShape:
        """The same shape with input lengths x `tokens`, output lengths x `outputs` (default:
        `tokens`), turn counts x `turns` and times x `time`."""
        outputs = tokens if outputs is None else outputs
        if min(tokens, outputs, turns, time) <= 0:
            raise BenchmarkError("trace scales must be > 0")

        def t(n: float) -> int:
            return max(1, round(n * tokens))

        return dataclasses.replace(
            self,
            turns_median=max(2.0, self.turns_median * turns),
            tool_tokens=t(self.tool_tokens),
            system_tokens=t(self.system_tokens),
            first_user_tokens=t(self.first_user_tokens),
            tool_output_median=max(1.0, self.tool_output_median * tokens),
            output_median=max(2.0, self.output_median * outputs),
            max_output_tokens=max(2, round(self.max_output_tokens * outputs)),
            max_context=t(self.max_context),
            compact_tokens=t(self.compact_tokens),
            think_median_s=self.think_median_s * time,
            subagent_turns_median=max(2.0, self.subagent_turns_median * turns),
            subagent_system_tokens=t(self.subagent_system_tokens),
            subagent_prompt_tokens=t(self.subagent_prompt_tokens),
            block_size=block_size or self.block_size,
            prefill_tok_s=self.prefill_tok_s * tokens / time,
            decode_tok_s=self.decode_tok_s * outputs / time,
        )


AGENTX = TraceShape()
SHAPES: dict[str, TraceShape] = {
    # Full scale: what a GPU sweep replays.
    "agentx": AGENTX,
    # The CPU sweep: same turn counts, 1/16 of the input tokens, 1/8 of the output, 1/10 of the time.
    "cpu": AGENTX.scaled(tokens=1 / 16, outputs=1 / 8, time=0.1, block_size=16),
    # The CI end-to-end test: short sessions that a 2-core machine replays in seconds.
    "tiny": AGENTX.scaled(tokens=1 / 32, outputs=1 / 16, turns=0.5, time=0.05, block_size=16),
}


def get_shape(name: str) -> TraceShape:
    if name not in SHAPES:
        raise BenchmarkError(f"unknown trace shape {name!r} (choose from {', '.join(SHAPES)})")
    return SHAPES[name]


class _Context:
    """A growing prompt: full blocks named by hash ids, plus a partial tail of unnamed tokens."""

    def __init__(self, shape: TraceShape, rng: random.Random, next_id: list[int]):
        self.shape, self.rng, self._next_id = shape, rng, next_id
        self.num_tokens = 0
        self.hash_ids: list[int] = []

    def fresh(self) -> int:
        self._next_id[0] += 1
        return self._next_id[0] - 1

    def extend(self, num_new: int) -> None:
        # The old partial tail becomes a full block with new content, so it gets a fresh id.
        self.num_tokens += num_new
        bs = self.shape.block_size
        while len(self.hash_ids) < self.num_tokens // bs:
            self.hash_ids.append(self.fresh())

    def truncate(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        del self.hash_ids[num_tokens // self.shape.block_size :]


def _lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> int:
    return int(min(hi, max(lo, round(median * math.exp(rng.gauss(0.0, sigma))))))


class _Agent:
    """One agent's (the main session's or a sub-agent's) sequence of requests."""

    def __init__(self, shape, rng, next_id, model, prefix_ids, prefix_tokens, first_tokens):
        self.shape, self.rng, self.model = shape, rng, model
        self.ctx = _Context(shape, rng, next_id)
        self.ctx.hash_ids = list(prefix_ids)
        self.ctx.num_tokens = len(prefix_ids) * shape.block_size
        self.prefix_tokens = prefix_tokens
        self.ctx.extend(prefix_tokens + first_tokens - self.ctx.num_tokens)
        self.prev: dict | None = None

    def _output_len(self) -> int:
        s = self.shape
        return _lognormal(self.rng, s.output_median, s.output_sigma, 1, s.max_output_tokens)

    def _api_time(self, num_new_in: int, num_out: int) -> float:
        s = self.shape
        return num_new_in / s.prefill_tok_s + num_out / s.decode_tok_s

    def think(self) -> float:
        s = self.shape
        return s.think_median_s * math.exp(self.rng.gauss(0.0, s.think_sigma))

    def next_request(self, t: float, appended: int | None, think: float) -> dict:
        """The next request at time `t`, after appending the previous output and `appended`
        tool-output tokens (None: draw one)."""
        s, ctx = self.shape, self.ctx
        compacted = False
        if self.prev is not None:
            shared = (self.prev["in"] // s.block_size) * s.block_size
            if appended is None:
                appended = _lognormal(
                    self.rng, s.tool_output_median, s.tool_output_sigma, 1, s.max_context
                )
                limit = int(shared / s.min_shared_fraction) - ctx.num_tokens - self.prev["out"]
                appended = max(0, min(appended, limit))
            grown = ctx.num_tokens + self.prev["out"] + appended
            if grown > s.max_context:
                ctx.truncate(self.prefix_tokens)
                ctx.extend(s.compact_tokens + appended)
                compacted = True
            else:
                ctx.extend(self.prev["out"] + appended)
        num_out = self._output_len()
        num_new = ctx.num_tokens - (
            0
            if self.prev is None or compacted
            else (self.prev["in"] // s.block_size) * s.block_size
        )
        req = {
            "t": round(t, 3),
            "type": "s",
            "model": self.model,
            "in": ctx.num_tokens,
            "out": num_out,
            "hash_ids": list(ctx.hash_ids),
            "think_time": round(think, 3),
            "api_time": round(self._api_time(num_new, num_out), 3),
            "stop": "tool_use",
        }
        self.prev = req
        return req

    def run(self, t: float, num_turns: int) -> tuple[list[dict], float]:
        """`num_turns` requests from time `t`; returns them and the time the last one ends."""
        reqs: list[dict] = []
        for _ in range(num_turns):
            think = self.think() if reqs else 0.0
            t = t + think
            reqs.append(self.next_request(t, None, think))
            t += reqs[-1]["api_time"]
        reqs[-1]["stop"] = "end_turn"
        return reqs, t


def synthesize_session(shape: TraceShape, session_id: str, seed: int, model: str) -> dict:
    """One weka_trace session (a JSON-ready dict)."""
    rng = random.Random(f"{seed}:{session_id}")
    next_id = [0]
    s = shape
    num_turns = max(s.min_turns, round(s.turns_median * math.exp(rng.gauss(0.0, s.turns_sigma))))
    prefix_tokens = s.tool_tokens + s.system_tokens
    main = _Agent(s, rng, next_id, model, [], prefix_tokens, s.first_user_tokens)
    tool_blocks = main.ctx.hash_ids[: s.tool_tokens // s.block_size]

    spawn_turns: set[int] = set()
    if num_turns > 3 and rng.random() < s.subagent_session_fraction:
        k = rng.randint(1, min(s.max_subagents, num_turns - 3))
        spawn_turns = set(rng.sample(range(1, num_turns - 1), k))

    requests: list[dict] = []
    t, appended = 0.0, None
    for turn in range(num_turns):
        think = main.think() if turn else 0.0
        t += think
        req = main.next_request(t, appended, think)
        requests.append(req)
        t += req["api_time"]
        appended = None
        if turn in spawn_turns:
            entry, t = _subagent(s, rng, next_id, model, tool_blocks, t)
            entry["agent_id"] = f"agent_{sum(r['type'] == 'subagent' for r in requests):03d}"
            requests.append(entry)
            appended = entry["requests"][-1]["out"]  # the sub-agent's answer is a tool result
    requests[-1]["stop"] = "end_turn"  # sub-agents are never spawned by the last turn
    return {
        "id": session_id,
        "models": [model],
        "block_size": s.block_size,
        "hash_id_scope": "local",
        "tool_tokens": s.tool_tokens,
        "system_tokens": s.system_tokens,
        "requests": requests,
    }


def _subagent(s: TraceShape, rng, next_id, model, tool_blocks, t_spawn) -> tuple[dict, float]:
    # A sub-agent shares the parent's tool schemas, then has its own system prompt and task.
    agent = _Agent(
        s,
        rng,
        next_id,
        model,
        tool_blocks,
        s.tool_tokens + s.subagent_system_tokens,
        s.subagent_prompt_tokens,
    )
    num_turns = max(2, round(s.subagent_turns_median * math.exp(rng.gauss(0.0, s.turns_sigma))))
    t0 = t_spawn + 0.001
    reqs, t_end = agent.run(t0, num_turns)
    entry = {
        "t": round(t0, 3),
        "type": "subagent",
        "agent_id": "",
        "subagent_type": "Explore",
        "duration_ms": int(round((t_end - t0) * 1000)),
        "total_tokens": sum(r["in"] + r["out"] for r in reqs),
        "tool_use_count": num_turns - 1,
        "status": "completed",
        "requests": reqs,
        "models": [model],
        "tool_tokens": s.tool_tokens,
        "system_tokens": s.subagent_system_tokens,
    }
    return entry, t_end + 0.001


def synthesize(
    out_dir: str, shape: TraceShape, num_sessions: int, seed: int = 0, model: str = "glm-5.3"
) -> list[str]:
    """Write `num_sessions` weka_trace files into `out_dir`; returns their paths."""
    if num_sessions < 1:
        raise BenchmarkError("--sessions must be >= 1")
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for i in range(num_sessions):
        sid = f"agentx-synth-{seed}-{i:04d}"
        path = os.path.join(out_dir, f"{sid}.json")
        with open(path, "w") as f:
            json.dump(synthesize_session(shape, sid, seed, model), f, separators=(",", ":"))
        paths.append(path)
    return paths


def _main_requests(session: dict) -> list[dict]:
    return [r for r in session["requests"] if r["type"] != "subagent"]


def summarize(sessions: list[dict]) -> dict:
    """The statistics the synthesiser is meant to match (main-agent turns; sub-agents counted)."""
    turns, inputs, outputs, shared = [], [], [], []
    num_sub = 0
    for sess in sessions:
        bs = sess["block_size"]
        reqs = _main_requests(sess)
        num_sub += sum(r["type"] == "subagent" for r in sess["requests"])
        turns.append(len(reqs))
        for prev, cur in zip(reqs, reqs[1:], strict=False):
            lcp = 0
            for a, b in zip(prev["hash_ids"], cur["hash_ids"], strict=False):
                if a != b:
                    break
                lcp += 1
            if lcp * bs >= (prev["in"] // bs) * bs:  # not a compaction turn
                shared.append(lcp * bs / cur["in"])
        inputs += [r["in"] for r in reqs]
        outputs += [r["out"] for r in reqs]
    return {
        "sessions": len(sessions),
        "sessions_with_subagents": sum(
            any(r["type"] == "subagent" for r in s["requests"]) for s in sessions
        ),
        "subagents": num_sub,
        "turns_median": statistics.median(turns),
        "input_tokens_median": statistics.median(inputs),
        "input_tokens_max": max(inputs),
        "output_tokens_median": statistics.median(outputs),
        "shared_with_previous_turn_mean": statistics.fmean(shared) if shared else 0.0,
        "turns_sharing_95pct": sum(x >= 0.95 for x in shared) / len(shared) if shared else 0.0,
    }


def load_sessions(trace_dir: str) -> list[dict]:
    files = sorted(f for f in os.listdir(trace_dir) if f.endswith(".json"))
    out = []
    for name in files:
        with open(os.path.join(trace_dir, name)) as f:
            out.append(json.load(f))
    return out


# --- Mooncake (FAST'25) traces: single-turn, 512-token hash blocks -------------------------------


def scale_mooncake(
    src: str,
    dst: str,
    *,
    max_requests: int,
    block_to: int = 16,
    block_from: int = 512,
    output_scale: float = 1 / 16,
    time_scale: float = 1.0,
) -> int:
    """Write the first `max_requests` lines of a Mooncake trace with every block shrunk from
    `block_from` to `block_to` tokens (hash ids, hence prefix reuse, unchanged), output lengths
    x `output_scale` and timestamps x `time_scale`. Returns the number of requests written."""
    if not os.path.isfile(src):
        raise BenchmarkError(f"Mooncake trace {src!r}: no such file")
    n = 0
    with open(src) as fin, open(dst, "w") as fout:
        for line in fin:
            if n >= max_requests:
                break
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                ids = list(r["hash_ids"])
                last = r["input_length"] - (len(ids) - 1) * block_from
            except (ValueError, KeyError, TypeError) as e:
                raise BenchmarkError(f"{src}:{n + 1}: not a Mooncake trace line ({e})") from None
            last = min(block_to, max(1, math.ceil(last * block_to / block_from)))
            rec = {
                "timestamp": int(r["timestamp"] * time_scale),
                "input_length": max(1, (len(ids) - 1) * block_to + last),
                "output_length": max(1, math.ceil(r["output_length"] * output_scale)),
                "hash_ids": ids,
            }
            fout.write(json.dumps(rec, separators=(",", ":")) + "\n")
            n += 1
    if n == 0:
        raise BenchmarkError(f"Mooncake trace {src!r} is empty")
    return n
