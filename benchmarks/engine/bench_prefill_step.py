"""Engine prefill and mixed steps: wall time, GPU time and where the GPU time goes.

The model runner runs in this process on the GLM-5.3-shaped slice of `bench_decode_step.py`
(real attention, indexer and vocabulary; random weights, fp8_ds_mla). Two step shapes, each timed
over `--reps` repetitions after warm-up (every repetition a new request, the previous finished):

- prefill: `--prefill` requests of `--len` prompt tokens each, from an empty cache;
- mixed: `--decode` requests decoding one token at `--context` tokens of context (rows written by
  the cache writers) and one new request's `--len`-token prompt chunk, in the same step (what a
  server under load runs whenever a request arrives).

Per shape and attention form (the dense MHA form for prompts no longer than index_topk, and the
absorbed MQA form over every causal position, `sparse_mla_force_mqa`): wall time of
`runner.execute` (which ends with the step's device->host read), the profiled device time of its
kernels, prompt tokens per second, and the kernels that took the most device time.

    python benchmarks/engine/bench_prefill_step.py --len 2048 --decode 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_decode_step import checkpoint, fill_cache  # noqa: E402

from vllm.core.messages import (  # noqa: E402
    CachedRequestData,
    KVCachePlan,
    NewRequestData,
    SamplingOptions,
    SchedulerOutput,
)
from vllm.distributed.parallel_state import ParallelContext  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.model_loader import build_model  # noqa: E402
from vllm.worker.gpu.model_runner import ModelRunner  # noqa: E402

BLOCK = 64


def make_runner(path, args, mqa: bool, blocks: int, max_len: int) -> ModelRunner:
    cfg = EngineArgs(
        model=path,
        device=args.device,
        kv_cache_dtype="fp8_ds_mla" if args.device == "cuda" else "auto",
        max_num_seqs=max(args.decode + args.prefill, 1),
        max_model_len=max_len,
        max_num_batched_tokens=args.prefill * args.len + args.decode,
        num_gpu_blocks_override=blocks,
        kv_cache_memory_bytes=1,
        enforce_eager=not args.graphs,
        compilation_config={"cudagraph_capture_sizes": [args.decode]}
        if args.graphs and args.decode
        else None,
        attention_config={"sparse_mla_force_mqa": mqa},
    ).create_engine_config()
    dev = torch.device(args.device)
    model = build_model(path, dtype=cfg.model_config.dtype, device=dev, force_mqa=mqa)
    runner = ModelRunner(cfg, model, ParallelContext.single(), dev)
    runner.initialize_kv_cache(KVCachePlan(blocks))
    return runner


def run_shape(path, args, mqa: bool, mixed: bool) -> dict:
    n_dec = args.decode if mixed else 0
    n_pre = 1 if mixed else args.prefill
    dec_blocks = -(-(args.context + args.reps + 16) // BLOCK)
    pre_blocks = -(-args.len // BLOCK)
    blocks = n_dec * dec_blocks + n_pre * pre_blocks + 1
    max_len = max(dec_blocks, pre_blocks) * BLOCK
    runner = make_runner(path, args, mqa, blocks, max_len)
    if n_dec:
        fill_cache(runner, n_dec * dec_blocks * BLOCK)
    greedy = SamplingOptions(temperature=0.0, max_tokens=10**6)
    dec_ids = [f"d{i}" for i in range(n_dec)]
    base = n_dec * dec_blocks
    g = torch.Generator().manual_seed(1)

    def prompt():
        return torch.randint(3, 1000, (args.len,), generator=g).tolist()

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    walls, prof_ms, top, split, pieces = [], None, [], 0, 0
    total = args.warmup + args.reps
    prev: list[str] = []
    for s in range(total):
        pre = [
            NewRequestData(
                f"p{s}.{j}",
                prompt(),
                args.len,
                list(range(base + j * pre_blocks, base + (j + 1) * pre_blocks)),
                0,
                greedy,
            )
            for j in range(n_pre)
        ]
        new = list(pre)
        cached = []
        if n_dec and s == 0:
            new += [
                NewRequestData(
                    r,
                    [(7 * k + i) % 1000 + 3 for k in range(args.context)],
                    args.context,
                    list(range(i * dec_blocks, (i + 1) * dec_blocks)),
                    args.context - 1,
                    greedy,
                )
                for i, r in enumerate(dec_ids)
            ]
        elif n_dec:
            cached = [CachedRequestData(r, [], args.context - 1 + s) for r in dec_ids]
        sched = {r.req_id: args.len for r in pre} | {r: 1 for r in dec_ids}
        so = SchedulerOutput(
            step=s,
            new_reqs=new,
            cached_reqs=cached,
            num_scheduled_tokens=sched,
            total_num_scheduled_tokens=sum(sched.values()),
            finished_req_ids=prev,
        )
        prev = [r.req_id for r in pre]
        profiling = s == total - 1
        if profiling:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (args.device == "cuda")
            prof = profile(activities=acts)
            prof.__enter__()
        sync()
        t0 = time.perf_counter()
        ro = runner.execute(so)
        sync()
        split += int(ro.stats.get("cudagraph_split_steps", 0))
        pieces += int(ro.stats.get("piecewise_steps", 0))
        if s >= args.warmup and not profiling:
            walls.append(time.perf_counter() - t0)
        if profiling:
            prof.__exit__(None, None, None)
            ka = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            prof_ms = sum(e.self_device_time_total for e in ka) / 1e3
            top = [
                (e.key[:60], round(e.self_device_time_total / 1e3, 3), e.count)
                for e in sorted(ka, key=lambda e: -e.self_device_time_total)[: args.top]
            ]
    del runner
    if args.device == "cuda":
        torch.cuda.empty_cache()
    med = statistics.median(walls)
    tokens = n_pre * args.len
    return {
        "shape": "mixed" if mixed else "prefill",
        "form": "mqa" if mqa else "dense",
        "prefill_tokens": tokens,
        "decode_rows": n_dec,
        "context": args.context if n_dec else 0,
        "step_ms_median": med * 1e3,
        "step_ms_max": max(walls) * 1e3,
        "gpu_ms": prof_ms,
        "wall_over_gpu": med * 1e3 / prof_ms if prof_ms else None,
        "prefill_tok_per_s": tokens / med,
        "split_steps": split,  # mixed steps whose decode rows replayed a graph
        "piecewise_steps": pieces,  # steps whose prompt chunks replayed piecewise graphs
        "top_kernels_ms": top,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--len", type=int, default=2048, help="prompt tokens per prefill request")
    ap.add_argument("--prefill", type=int, default=1, help="prefill requests per prefill step")
    ap.add_argument("--decode", type=int, default=64, help="decode rows in the mixed step")
    ap.add_argument("--context", type=int, default=2048, help="decode rows' context")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--top", type=int, default=10, help="kernels listed per row")
    ap.add_argument("--graphs", action="store_true", help="same as --modes graphs")
    ap.add_argument(
        "--modes",
        default=None,
        help="eager,graphs: graphs = decode graphs for the decode rows and piecewise graphs for "
        "the prompt chunks (FULL_AND_PIECEWISE), in the same process (default: eager)",
    )
    ap.add_argument("--forms", default="dense,mqa")
    ap.add_argument("--shapes", default="prefill,mixed")
    ap.add_argument("--device", default="cuda", help="cpu: a functional check at tiny sizes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = checkpoint(args.layers)
    rows = []
    modes = (args.modes or ("graphs" if args.graphs else "eager")).split(",")
    for mode in modes:
        args.graphs = mode == "graphs"
        for shape in args.shapes.split(","):
            for form in args.forms.split(","):
                r = {"mode": mode, **run_shape(path, args, form == "mqa", shape == "mixed")}
                rows.append(r)
                print("row:", json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "prefill_step", **r}) + "\n")
    for r in rows:
        print(f"\n{r['mode']} {r['shape']} {r['form']}: top kernels (ms, calls)")
        for k, ms, n in r["top_kernels_ms"]:
            print(f"  {ms:8.3f} {n:5d}  {k}")
    print(
        "\nmode   shape   form   tokens  dec  wall ms  max ms  gpu ms  wall/gpu  prefill tok/s  "
        "split  pieces"
    )
    for r in rows:
        print(
            f"{r['mode']:6} {r['shape']:7} {r['form']:6} {r['prefill_tokens']:6} "
            f"{r['decode_rows']:4} {r['step_ms_median']:8.2f} {r['step_ms_max']:7.2f} "
            f"{r['gpu_ms'] or 0:7.2f} {r['wall_over_gpu'] or 0:8.2f} "
            f"{r['prefill_tok_per_s']:13.0f}  {r['split_steps']:5}  {r['piecewise_steps']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
