"""Engine-level decode at long context, with and without HiSparse: prefill time of N requests of
`--context` tokens (the first run at a length includes Triton's compiles), then the decode step
time with the context cached: the median interval between the engine's step outputs over a run
of 2 + tokens output tokens (also the mean, the slowest, and the difference of that run and a
2-token one divided by the extra tokens). The run's last interval, the step that finishes every
request at once, is reported apart (``finish_step_ms``), not as a steady step. GLM-5.3-shaped slice (real
attention and indexer dimensions, 4 layers, random weights), fp8_ds_mla.

    python benchmarks/hisparse/bench_engine_decode.py --context 65536 --requests 2 --tokens 32
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.model_executor.tiny import GLM_SLICE, TINY_CONFIG, tiny_state_dict, write_checkpoint  # noqa: E402


def prompt(n: int, salt: int) -> dict:
    return {"prompt_token_ids": [(7 * i + salt) % 1000 + 3 for i in range(n)]}


def run(ckpt, args, hisparse: bool) -> dict:
    kw = {}
    if hisparse:
        kw["attention_config"] = {"hisparse_config": {"host_pool_gib": args.host_pool_gib}}
    if args.dp > 1:
        kw.update(data_parallel_size=args.dp, enable_expert_parallel=True)
    if args.enforce_eager:
        kw["enforce_eager"] = True
    if args.compilation_config:
        kw["compilation_config"] = json.loads(args.compilation_config)
    if args.async_scheduling:
        kw["async_scheduling"] = True
    t0 = time.perf_counter()
    llm = LLM(
        ckpt,
        device=args.device,
        kv_cache_dtype="fp8_ds_mla",
        skip_tokenizer_init=True,
        max_num_batched_tokens=args.chunk,
        **kw,
    )
    start_s = time.perf_counter() - t0
    try:
        reqs = [prompt(args.context, s) for s in range(args.requests)]
        # this process's own collections (torch's objects, the prompts' lists) would delay
        # reading the step outputs, i.e. show as engine steps: kept out of the measurement
        gc.collect()
        gc.freeze()
        t0 = time.perf_counter()
        llm.generate(reqs, SamplingParams(max_tokens=1))
        prefill_s = time.perf_counter() - t0
        # compiles the decode path's kernels for this context (first decode at this length)
        llm.generate(reqs, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        times = []
        for n in (2, args.tokens + 2):  # same prompts again: prefix hits, then decode
            since = len(llm.stats_history)
            t0 = time.perf_counter()
            llm.generate(reqs, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            times.append(time.perf_counter() - t0)
        # decode steps: intervals between the step outputs of the longer run, past its first
        # two (the prefix hit's recomputed last token, then the first decode step)
        at, st = llm.stats_times[since:], llm.stats_history[since:]
        pure = [s.num_cudagraph_steps - s.num_cudagraph_split_steps for s in st]
        if any(pure):
            # graphs: intervals between two decode-only replays (under --async-scheduling a
            # step's results are read after the next one is launched, so "the first two" would
            # not reliably drop the prefix hit's prompt step)
            spans = [(i, at[i] - at[i - 1]) for i in range(1, len(at)) if pure[i] and pure[i - 1]]
        else:
            spans = [(i, at[i] - at[i - 1]) for i in range(3, len(at))]
        # the run's last interval is the step that finishes every request at once (their
        # blocks released, final outputs): a transition, reported apart from the steady steps
        finish_s = spans[-1][1] if len(spans) > 2 else None
        if finish_s is not None:
            spans = spans[:-1]
        steps = sorted(d for _, d in spans)
        step_s = steps[len(steps) // 2]
        # where the slow steps fell (output index within the run, ms): stalls or transitions
        slow = [
            (i, round(d * 1e3, 2), st[i].num_jit_compiles, st[i].num_piecewise_steps)
            for i, d in spans
            if d > 2 * step_s
        ]
        # the hot set's hit rate over the decode run's steps (per-step rates, engine's counters)
        extra = [s.extra or {} for s in llm.stats_history[since:]]
        rates = [e["hisparse_hot_hit_rate"] for e in extra if "hisparse_hot_hit_rate" in e]
        h2d = [
            e.get("hisparse_h2d_bytes_per_step", 0) for e in extra if "hisparse_hot_hit_rate" in e
        ]
        return {
            "hisparse": hisparse,
            "stable_selection": args.stable_selection,
            "async_scheduling": args.async_scheduling,
            "context": args.context,
            "requests": args.requests,
            "dp": args.dp,
            "startup_s": start_s,
            "prefill_s": prefill_s,
            "rehit_2tok_s": times[0],
            "decode_step_ms": step_s * 1e3,  # median
            "decode_step_mean_ms": sum(steps) / len(steps) * 1e3,
            "decode_step_max_ms": steps[-1] * 1e3,  # steady steps
            "finish_step_ms": finish_s * 1e3 if finish_s is not None else None,
            # intervals over twice the median: (output index, ms, Triton compiles, piecewise)
            "slow_steps": slow,
            "decode_steps": len(steps),
            # the difference of the two runs over the extra tokens (prefix hit's cost cancels)
            "decode_step_diff_ms": (times[1] - times[0]) / args.tokens * 1e3,
            "tok_s_per_request": 1 / step_s,
            "hot_hit_rate_mean": sum(rates) / len(rates) if rates else None,
            "hot_hit_rate_min": min(rates) if rates else None,
            "h2d_mb_per_step": sum(h2d) / len(h2d) / 1e6 if h2d else None,
        }
    finally:
        llm.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--host-pool-gib", type=float, default=8)
    ap.add_argument("--modes", default="off,on")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument(
        "--async-scheduling",
        action="store_true",
        help="both modes with --async-scheduling (step N + 1 scheduled and launched before step "
        "N is read)",
    )
    ap.add_argument(
        "--stable-selection",
        action="store_true",
        help="synthetic locality: zero indexer queries, the same top-k every step (hot-set hits)",
    )
    ap.add_argument("--compilation-config", default=None, help="JSON, as vllm serve's")
    args = ap.parse_args()
    ckpt = tempfile.mkdtemp(prefix="glm-slice-")
    cfg = {**TINY_CONFIG, **GLM_SLICE}
    sd = tiny_state_dict(cfg, seed=3)
    if args.stable_selection:
        # the indexer's queries all zero: every key scores the same, so each step selects the
        # same positions (the top-k's tie order) and the hot set serves them after the first
        # fetch. A synthetic stand-in for a trained model's step-to-step locality
        for k in sd:
            if k.endswith("self_attn.indexer.wq_b.weight"):
                sd[k] = sd[k] * 0
    write_checkpoint(ckpt, cfg, sd, tokenizer=False)
    rows = []
    for m in args.modes.split(","):
        rows.append(run(ckpt, args, m == "on"))
        print("row:", json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "engine_decode", **r}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
