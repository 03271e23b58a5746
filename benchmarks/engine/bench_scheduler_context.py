"""Scheduler host time per decode step against context length: `schedule()` + `update_from_output()`
for B running requests of C tokens each, in steady decode, with a runner stand-in that samples
one token per request (no model: the scheduler's own Python cost only). Per-step work must not
grow with the context (publishing full blocks to the prefix cache, block lists, block hashes).

    python benchmarks/engine/bench_scheduler_context.py --batch 256 --contexts 2048 8192 32768
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from vllm.core.messages import (  # noqa: E402
    EngineCoreRequest,
    KVCachePlan,
    ModelRunnerOutput,
    SamplingOptions,
)
from vllm.core.scheduler import Scheduler  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.tiny import TINY_CONFIG, tiny_state_dict, write_checkpoint  # noqa: E402


def measure(ckpt: str, b: int, ctx: int, steps: int) -> float:
    cfg = EngineArgs(model=ckpt, max_num_batched_tokens=65536, max_num_seqs=b,
                     max_model_len=ctx + 1000).create_engine_config()  # fmt: skip
    s = Scheduler(cfg, KVCachePlan(b * (ctx // 64 + 4)))
    sp = SamplingOptions(temperature=0, max_tokens=500, ignore_eos=True)
    for i in range(b):
        s.add_request(EngineCoreRequest(f"r{i}", [(i + j) % 900 + 3 for j in range(ctx)], sp, [0]))

    def step():
        so = s.schedule()
        ro = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        for rid in so.num_scheduled_tokens:
            r = s.requests[rid]
            if r.num_computed_tokens >= r.num_tokens:
                ro.req_ids.append(rid)
                ro.sampled_token_ids.append([7])
        s.update_from_output(so, ro)
        return so

    while True:  # prefill, until every request decodes one token per step
        so = step()
        if len(so.num_scheduled_tokens) == b and so.total_num_scheduled_tokens == b:
            break
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    ckpt = tempfile.mkdtemp(prefix="bench-sched-")
    write_checkpoint(
        ckpt, dict(TINY_CONFIG), tiny_state_dict(dict(TINY_CONFIG), seed=1), tokenizer=False
    )
    print(f"{'batch':>6} {'context':>8} {'schedule+update ms/step':>24}")
    for ctx in args.contexts:
        print(
            f"{args.batch:>6} {ctx:>8} {measure(ckpt, args.batch, ctx, args.steps):>24.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
