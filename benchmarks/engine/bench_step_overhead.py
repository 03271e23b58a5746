"""Host overhead per engine step: scheduler + input preparation + sampling, the model forward
excluded, at batch 1, 64 and 256 (decode steady state), plus device→host syncs per step.

    python benchmarks/engine/bench_step_overhead.py                      # CPU, tiny checkpoint
    python benchmarks/engine/bench_step_overhead.py --device cuda --model glm-slice   # H200

`glm-slice` is a GLM-5.3-shaped model (real attention/indexer dims and the real 154,880-token
vocabulary; 2 layers, 4 experts, hidden 1024, random weights). Phases are timed with a device
synchronise around the forward (measurement only); syncs are counted with
torch.cuda.set_sync_debug_mode during the host phases.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from vllm.core.messages import EngineCoreRequest, KVCachePlan, SamplingOptions  # noqa: E402
from vllm.core.scheduler import Scheduler  # noqa: E402
from vllm.distributed.parallel_state import ParallelContext  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.model_loader import build_model  # noqa: E402
from vllm.model_executor.tiny import GLM_SLICE as GLM_SLICE_BASE  # noqa: E402
from vllm.model_executor.tiny import TINY_CONFIG, tiny_state_dict, write_checkpoint  # noqa: E402
from vllm.worker.gpu.input_batch import build_step_inputs  # noqa: E402
from vllm.worker.gpu.model_runner import ModelRunner  # noqa: E402

GLM_SLICE = {**GLM_SLICE_BASE, "vocab_size": 154880, "num_hidden_layers": 2}  # the real vocabulary


def _checkpoint(name: str) -> str:
    d = tempfile.mkdtemp(prefix=f"bench-{name}-")
    cfg = dict(TINY_CONFIG) if name == "tiny" else {**TINY_CONFIG, **GLM_SLICE}
    write_checkpoint(d, cfg, tiny_state_dict(cfg, seed=1), tokenizer=False)
    return d


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def run(
    path: str,
    device: str,
    batch: int,
    steps: int,
    dtype: torch.dtype,
    sampling: str = "topp",
    graphs: bool = False,
    profile: int = 0,
) -> dict:
    dev = torch.device(device)
    cc = {"cudagraph_capture_sizes": sorted({1, batch})} if graphs else None
    cfg = EngineArgs(
        model=path,
        device=device,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch * 16),
        # the graphs' forward reads every row up to this length (a CPU run pays for all of it)
        max_model_len=512,
        kv_cache_memory_bytes=2 * 2**30 if device == "cuda" else 256 * 2**20,
        dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
        enforce_eager=not graphs,
        compilation_config=cc,
    ).create_engine_config()
    model = build_model(path, dtype=cfg.model_config.dtype, device=dev)
    runner = ModelRunner(cfg, model, ParallelContext.single(), dev)
    blocks = cfg.cache_config.kv_cache_memory_bytes // runner.kv_bytes_per_block()
    runner.initialize_kv_cache(KVCachePlan(blocks))
    sched = Scheduler(cfg, KVCachePlan(blocks))
    for i in range(batch):
        sched.add_request(
            EngineCoreRequest(
                str(i),
                list(range(10 + i % 7, 26 + i % 7)),
                SamplingOptions(
                    temperature=0.8 if sampling == "topp" else 0.0,
                    top_p=0.95 if sampling == "topp" else 1.0,
                    seed=i,
                    max_tokens=400,
                    ignore_eos=True,
                ),
                [],
            )
        )
    if graphs:
        with torch.inference_mode():  # as the worker's loop runs
            return _run_graphs(runner, sched, batch, steps, sampling, profile)
    rows = []
    for step in range(steps + 3):
        t0 = time.perf_counter()
        so = sched.schedule()
        t1 = time.perf_counter()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            if dev.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            start_of = runner.update_states(so)
            inp = build_step_inputs(so, runner.states, dev, start_of, runner.staging)
            step_in, meta = runner.prepare(inp)
            if dev.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
            prep_syncs = len([x for x in w if "synchroniz" in str(x.message)])
        _sync(dev)
        t2 = time.perf_counter()
        with torch.inference_mode():
            hidden = runner.forward(step_in, meta)
        _sync(dev)
        t3 = time.perf_counter()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            if dev.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            with torch.inference_mode():
                plan = runner._sampling_plan(inp)
                ro = runner.finish(runner._sample(inp, plan, hidden, so.step))
            if dev.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
            sample_syncs = len([x for x in w if "synchroniz" in str(x.message)])
        t4 = time.perf_counter()
        sched.update_from_output(so, ro)
        t5 = time.perf_counter()
        if step >= 3 and all(n == 1 for n in so.num_scheduled_tokens.values()):
            rows.append(
                dict(
                    schedule=t1 - t0,
                    prep=t2 - t1,
                    forward=t3 - t2,
                    sample=t4 - t3,
                    update=t5 - t4,
                    syncs=prep_syncs + sample_syncs,
                )
            )
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    host = med["schedule"] + med["prep"] + med["sample"] + med["update"]
    return {
        "batch": batch,
        "sampling": sampling,
        "steps": len(rows),
        "host_ms": host * 1e3,
        **{f"{k}_ms": v * 1e3 for k, v in med.items() if k != "syncs"},
        "syncs_per_step": med["syncs"],
    }


def _run_graphs(runner, sched, batch: int, steps: int, sampling: str, profile: int = 0) -> dict:
    """The engine's own step with CUDA graphs: ``runner.launch`` (state update, step inputs,
    sampling plan, the graph's input copy and replay, sampling, the results' copy queued) and
    ``runner.finish`` (the wait, then the output), as the worker calls them. Host time is the
    step's wall time less the graph's forward: on CUDA the device is synchronised after the
    launch and that wait is excluded; on CPU (no capture: the same code runs the graph's
    forward eagerly) the time inside the forward is subtracted."""
    graphs, fwd = runner.graphs, [0.0]
    assert graphs is not None, "no decode graphs: a capture size must cover the batch"
    real = graphs._forward

    def timed(size):
        t = time.perf_counter()
        out = real(size)
        fwd[0] += time.perf_counter() - t
        return out

    graphs._forward = timed
    cuda = runner.device.type == "cuda"
    prof = cProfile.Profile() if profile else None
    sprof = cProfile.Profile() if profile else None  # schedule() and update_from_output()
    rows = []
    for step in range(steps + 3):
        fwd[0] = 0.0
        if sprof is not None and step >= 3:
            sprof.enable()
        t0 = time.perf_counter()
        so = sched.schedule()
        t1 = time.perf_counter()
        if sprof is not None:
            sprof.disable()
        if prof is not None and step >= 3:
            prof.enable()
        pending = runner.launch(so)
        if prof is not None:
            prof.disable()
        t2 = time.perf_counter()
        _sync(runner.device)
        t3 = time.perf_counter()
        out = runner.finish(pending)
        t4 = time.perf_counter()
        if sprof is not None and step >= 3:
            sprof.enable()
        sched.update_from_output(so, out)
        if sprof is not None:
            sprof.disable()
        t5 = time.perf_counter()
        decode = all(n == 1 for n in so.num_scheduled_tokens.values())
        if step >= 3 and decode and pending.stats.get("cudagraph_steps"):
            launch = (t2 - t1) - (0.0 if cuda else fwd[0])
            rows.append(
                dict(schedule=t1 - t0, launch=launch, finish=t4 - t3, update=t5 - t4, fwd=fwd[0])
            )
    assert rows, "no step replayed a graph"
    if prof is not None:
        _print_profile(prof, f"{sampling} B = {batch}", steps, profile)
        _print_profile(sprof, f"scheduler, {sampling} B = {batch}", steps, profile)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {
        "batch": batch,
        "sampling": sampling,
        "graphs": True,
        "steps": len(rows),
        "host_ms": (med["schedule"] + med["launch"] + med["finish"] + med["update"]) * 1e3,
        **{f"{k}_ms": v * 1e3 for k, v in med.items()},
    }


def _print_profile(prof: cProfile.Profile, what: str, steps: int, top: int) -> None:
    """The profiled launches' functions in µs per step: own time and with callees."""
    st = pstats.Stats(prof).stats  # (file, line, name) -> (cc, ncalls, tottime, cumtime, callers)
    total = sum(v[2] for v in st.values())
    print(f"--- profile, {what}: {total / steps * 1e6:.0f} µs/step under cProfile")
    print(f"{'calls/step':>10} {'own µs':>8} {'cum µs':>8}  function")
    rows = sorted(st.items(), key=lambda kv: -kv[1][2])[:top]
    for (file, line, name), (_, n, tt, ct, _) in rows:
        where = f"{os.path.basename(file)}:{line}({name})" if line else name
        print(f"{n / steps:>10.1f} {tt / steps * 1e6:>8.1f} {ct / steps * 1e6:>8.1f}  {where}")
    # where the step's main calls spend it: their callees by time (edges of the call graph)
    for target in (
        "launch",
        "run",
        "_sample",
        "build_step_inputs",
        "_sampling_batch",
        "schedule",
        "update_from_output",
    ):
        parents = [k for k in st if k[2] == target and "vllm" in k[0]]
        for parent in parents:
            edges = [
                (v[4][parent][3], callee)
                for callee, v in st.items()
                if parent in v[4] and v[4][parent][3] / steps > 2e-6
            ]
            edges.sort(reverse=True)
            print(f"  {os.path.basename(parent[0])}:{parent[1]}({target}) calls:")
            for ct, (file, line, name) in edges[:12]:
                where = f"{os.path.basename(file)}:{line}({name})" if line else name
                print(f"    {ct / steps * 1e6:>8.1f} µs  {where}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="tiny", choices=["tiny", "glm-slice"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sampling", nargs="+", default=["greedy", "topp"], choices=["greedy", "topp"])
    ap.add_argument(
        "--graphs",
        action="store_true",
        help="the step as the engine runs it with CUDA graphs (launch + finish, the graph's "
        "forward excluded) instead of the eager phases",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="with --graphs: cProfile the steady launches and print the top N functions",
    )
    args = ap.parse_args()
    path = _checkpoint(args.model)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    res = [
        run(path, args.device, b, args.steps, dtype, sm, args.graphs, args.profile)
        for sm in args.sampling
        for b in args.batches
    ]
    print(f"host overhead per decode step ({args.model}, {args.device}); forward excluded; medians")
    if args.graphs:
        print(
            f"{'sampling':>8} {'batch':>5} {'host ms':>8} {'sched':>7} {'launch':>7} {'finish':>7} {'update':>7} {'fwd ms':>8}"
        )
        for r in res:
            print(
                f"{r['sampling']:>8} {r['batch']:>5} {r['host_ms']:>8.3f} {r['schedule_ms']:>7.3f} {r['launch_ms']:>7.3f}"
                f" {r['finish_ms']:>7.3f} {r['update_ms']:>7.3f} {r['fwd_ms']:>8.2f}"
            )
        _dump(args, res)
        return 0
    print(
        f"{'sampling':>8} {'batch':>5} {'host ms':>8} {'sched':>7} {'prep':>7} {'sample':>7} {'update':>7} {'fwd ms':>8} {'syncs':>5}"
    )
    for r in res:
        print(
            f"{r['sampling']:>8} {r['batch']:>5} {r['host_ms']:>8.3f} {r['schedule_ms']:>7.3f} {r['prep_ms']:>7.3f} {r['sample_ms']:>7.3f}"
            f" {r['update_ms']:>7.3f} {r['forward_ms']:>8.2f} {r['syncs_per_step']:>5}"
        )
    _dump(args, res)
    return 0


def _dump(args, res) -> None:
    if args.json:
        with open(args.json, "a") as f:
            for r in res:
                f.write(
                    json.dumps(
                        {"bench": "step_overhead", "model": args.model, "device": args.device, **r}
                    )
                    + "\n"
                )


if __name__ == "__main__":
    sys.exit(main())
