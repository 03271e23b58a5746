"""MTP speculative decoding at the engine level: decode tokens/s per request with MTP against
without, in one process on the same inputs.

The model runner runs here on a GLM-5.3-shaped slice (real attention, indexer and vocabulary,
`--layers` layers plus one MTP layer, random weights, fp8_ds_mla), as in bench_decode_step.py:
B requests start with C tokens of context in the cache and decode. Random weights accept almost
no drafts, so the MTP runs use the SYNTHETIC acceptance mode (`synthetic_acceptance_length`, the
seed's 2.99 by default): every verification accepts that many tokens on average, whatever the
drafts — the figures are the engine's speed at that acceptance, not a model's. Both runs replay
CUDA graphs (`--eager` for eager steps). Per MTP step, CUDA events split the device time into
the target (verify) forward, the eager sampling + verification, and the drafting.

    python benchmarks/engine/bench_spec_decode.py --batch 1,16,64 --context 8192
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.engine.bench_decode_step import fill_cache, real_dims_checkpoint  # noqa: E402
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
from vllm.model_executor.tiny import GLM_SLICE, TINY_CONFIG, tiny_state_dict, write_checkpoint  # noqa: E402
from vllm.worker.gpu.model_runner import ModelRunner  # noqa: E402


def checkpoint(layers: int) -> str:
    d = tempfile.mkdtemp(prefix="glm-slice-mtp-")
    cfg = {
        **TINY_CONFIG,
        **GLM_SLICE,
        "vocab_size": 154880,
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": 1,
    }
    write_checkpoint(d, cfg, tiny_state_dict(cfg, seed=3), tokenizer=False)
    return d


class Timeline:
    """CUDA events around the graph replay, the sampling/verification and the drafting."""

    def __init__(self, runner: ModelRunner):
        self.rows: list[list[torch.cuda.Event]] = []
        g = runner.graphs
        run, draft = g.run, g.draft

        def timed_run(*a, **kw):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            self.rows.append(ev)
            ev[0].record()
            out = run(*a, **kw)
            ev[1].record()
            return out

        def timed_draft(*a, **kw):
            ev = self.rows[-1]
            ev[2].record()
            draft(*a, **kw)
            ev[3].record()

        g.run, g.draft = timed_run, timed_draft

    def split_ms(self, since: int) -> tuple[float, float, float]:
        torch.cuda.synchronize()
        rows = self.rows[since:]
        med = lambda i, j: statistics.median(r[i].elapsed_time(r[j]) for r in rows)  # noqa: E731
        return med(0, 1), med(1, 2), med(2, 3)


def run(
    path, batch, context, steps, k, length, eager: bool, load_format: str = "auto", profile=0
) -> dict:
    per_req_blocks = -(-(context + (steps + profile) * (k + 1) + 8) // 64)
    blocks = batch * per_req_blocks + 1
    spec = None
    if k:
        spec = {"method": "mtp", "num_speculative_tokens": k}
        spec["synthetic_acceptance_length"] = length
    cfg = EngineArgs(
        model=path,
        device="cuda",
        kv_cache_dtype="fp8_ds_mla",
        max_num_seqs=batch,
        max_model_len=per_req_blocks * 64,
        max_num_batched_tokens=max(2048, batch * (k + 1)),
        num_gpu_blocks_override=blocks,
        kv_cache_memory_bytes=1,
        enforce_eager=eager,
        compilation_config=None if eager else {"cudagraph_capture_sizes": [batch]},
        speculative_config=spec,
    ).create_engine_config()
    dev = torch.device("cuda")
    model = build_model(
        path, dtype=cfg.model_config.dtype, device=dev, load_mtp=bool(k), load_format=load_format
    )
    runner = ModelRunner(cfg, model, ParallelContext.single(), dev)
    runner.initialize_kv_cache(KVCachePlan(blocks))
    fill_cache(runner, blocks * 64)
    timeline = Timeline(runner) if runner.graphs is not None else None
    sampling = SamplingOptions(temperature=0.0, max_tokens=10**6)
    new = [
        NewRequestData(
            str(i),
            [(7 * j + i) % 1000 + 3 for j in range(context)],
            context,
            list(range(i * per_req_blocks, (i + 1) * per_req_blocks)),
            context - 1,
            sampling,
        )
        for i in range(batch)
    ]
    ids = [r.req_id for r in new]
    computed = {r: context - 1 for r in ids}
    drafts = 0  # the first step has none yet (as after a prefill)
    walls, emitted = [], []
    warm = 4
    prof, kernels = None, {}
    for s in range(steps + 1 + profile):  # the profiled steps are not timed
        if profile and s == warm:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            on_gpu = torch.cuda.is_available()
            prof = torch_profile(
                activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]
            )
            prof.__enter__()
        n = {r: 1 + drafts for r in ids}
        if s == 0:
            so = SchedulerOutput(step=0, new_reqs=new, num_scheduled_tokens=n)
        else:
            cached = [CachedRequestData(r, [], computed[r]) for r in ids]
            so = SchedulerOutput(step=s, cached_reqs=cached, num_scheduled_tokens=n)
        so.total_num_scheduled_tokens = sum(n.values())
        if s == warm + profile and timeline is not None:
            since = len(timeline.rows)
        t0 = time.perf_counter()
        ro = runner.execute(so)
        walls.append(time.perf_counter() - t0)
        got = dict(zip(ro.req_ids, ro.sampled_token_ids, strict=True))
        for r in ids:
            computed[r] += len(got[r])
        emitted.append(statistics.mean(len(got[r]) for r in ids))
        drafts = k
        if prof is not None and s == warm + profile - 1:
            prof.__exit__(None, None, None)
            kernels = kernel_ms(prof, profile)
            prof = None
    steady = walls[warm + profile :]
    step_ms = statistics.median(steady) * 1e3
    per_step = statistics.mean(emitted[warm + profile :])
    split = timeline.split_ms(since) if timeline is not None else (None, None, None)
    del runner, model
    gc.collect()  # the runner and its graphs reference each other: refcounts never free them
    torch.cuda.empty_cache()
    return {
        "k": k,
        "synthetic_length": length if k else None,
        "mode": "eager" if eager else "graph",
        "batch": batch,
        "context": context,
        "step_ms": step_ms,
        "tokens_per_step": per_step,
        "tok_s_per_request": per_step / step_ms * 1e3,
        "target_ms": split[0],
        "sample_verify_ms": split[1],
        "draft_ms": split[2],
        "kernels_ms": kernels,
    }


def kernel_ms(prof, steps: int) -> dict[str, float]:
    """Device time per step of each kernel (by name, cut to 70 characters) in a profiled window
    (without CUDA: each op's own CPU time)."""
    out: dict[str, float] = {}
    gpu = torch.cuda.is_available()
    for e in prof.key_averages():
        us = e.self_device_time_total if gpu else e.self_cpu_time_total
        if us > 0 and (not gpu or e.device_type == torch.autograd.DeviceType.CUDA):
            out[e.key[:70]] = out.get(e.key[:70], 0.0) + us / 1e3 / steps
    return out


def print_kernels(base: dict, spec: dict, top: int = 14) -> None:
    """The kernels that take the most device time per step, without MTP and with it."""
    a, b = base["kernels_ms"], spec["kernels_ms"]
    names = sorted(set(a) | set(b), key=lambda n: -max(a.get(n, 0.0), b.get(n, 0.0)))
    print(
        f"B = {base['batch']}, ctx {base['context']}: device ms per step, no MTP / MTP{spec['k']}"
    )
    print(f"  total {sum(a.values()):8.3f} {sum(b.values()):8.3f}")
    for n in names[:top]:
        print(f"  {a.get(n, 0.0):8.3f} {b.get(n, 0.0):8.3f}  {n}")


def f(x: float | None) -> str:
    """A table cell: milliseconds, or a dash where the run had no graph timeline."""
    return f"{x:7.2f}" if x is not None else "      -"


def dump(rows: list[dict], path: str | None, bench: str) -> None:
    if path:
        with open(path, "a") as out:
            for r in rows:
                out.write(json.dumps({"bench": bench, **r}) + "\n")


def project(args) -> int:
    """MTP3 against none at GLM-5.3's depth on one GPU's EP8 share: both runs at two depths
    (real dimensions, random FP8 weights), each step time fitted as fixed + layers × per-layer and
    evaluated at 78 (the drafting's one MTP layer, the lm_head and sampling are in the fixed part).
    Not included, as in bench_decode_step --project: EP's all-to-alls over NVLink."""
    lo, hi = (int(x) for x in args.project.split(","))
    paths = {n: real_dims_checkpoint(n, mtp=1) for n in (lo, hi)}
    out = []
    for b in map(int, args.batch.split(",")):
        for c in map(int, args.context.split(",")):
            t = {}
            for n, path in paths.items():
                for k in (0, args.k):
                    r = run(path, b, c, args.steps, k, args.length, False, "dummy")
                    r.pop("kernels_ms")
                    t[n, k] = r
                    print("row:", json.dumps({"layers": n, **r}), flush=True)

            def at78(k: int, key: str = "step_ms", t=t) -> float | None:
                if t[lo, k][key] is None:  # eager runs (no graph timeline)
                    return None
                slope = (t[hi, k][key] - t[lo, k][key]) / (hi - lo)
                return t[lo, k][key] + (78 - lo) * slope

            none78, mtp78 = at78(0), at78(args.k)
            per_step = statistics.mean(t[n, args.k]["tokens_per_step"] for n in (lo, hi))
            row = dict(
                batch=b, context=c, layers=(lo, hi), k=args.k, synthetic_length=args.length,
                step78_none=none78, step78_mtp=mtp78, target78=at78(args.k, "target_ms"),
                draft_ms=t[hi, args.k]["draft_ms"],
                tok_s_req_none=1e3 / none78, tok_s_req_mtp=per_step * 1e3 / mtp78,
            )  # fmt: skip
            row["speedup"] = row["tok_s_req_mtp"] / row["tok_s_req_none"]
            out.append(row)
    dump(out, args.out, "spec_decode_projection")
    print(f"GLM-5.3 at 78 layers from {lo} and {hi} (one GPU's EP8 share; SYNTHETIC acceptance)")
    print("B    ctx    none ms  MTP ms   target   draft  tok/s/req none -> MTP  speedup")
    for r in out:
        print(
            f"{r['batch']:<4} {r['context']:<6} {r['step78_none']:7.2f} {r['step78_mtp']:7.2f} "
            f"{f(r['target78'])} {f(r['draft_ms'])} {r['tok_s_req_none']:9.1f} -> "
            f"{r['tok_s_req_mtp']:6.1f} {r['speedup']:8.2f}"
        )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--context", default="8192")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--length", type=float, default=2.99, help="synthetic acceptance length")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument(
        "--real-dims",
        action="store_true",
        help="GLM-5.3's real dimensions, one GPU's EP8 share of the experts, FP8, random "
        "weights (--load-format dummy): see bench_decode_step.real_dims_checkpoint",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="profile STEPS steady steps of each run: device time per step by kernel",
    )
    ap.add_argument(
        "--project",
        default=None,
        metavar="LO,HI",
        help="GLM-5.3 projection: --real-dims at two depths (e.g. 4,12), each step's time "
        "fitted as fixed + layers x per-layer, scaled to 78 layers, with MTP and without",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.project:
        return project(args)
    path = real_dims_checkpoint(args.layers, mtp=1) if args.real_dims else checkpoint(args.layers)
    fmt = "dummy" if args.real_dims else "auto"
    rows = []
    for b in map(int, args.batch.split(",")):
        for c in map(int, args.context.split(",")):
            base = run(path, b, c, args.steps, 0, None, args.eager, fmt, args.profile)
            spec = run(path, b, c, args.steps, args.k, args.length, args.eager, fmt, args.profile)
            if args.profile:
                print_kernels(base, spec)
            spec["speedup"] = spec["tok_s_per_request"] / base["tok_s_per_request"]
            for r in (base, spec):
                rows.append(r)
                r["real_dims"] = args.real_dims
                r["layers"] = args.layers
                print("row:", json.dumps(r), flush=True)
    dump(rows, args.out, "spec_decode")
    print("SYNTHETIC acceptance in the MTP rows (not the model's drafts)")
    print("k  mode   B    ctx    step ms  tok/step  tok/s/req  speedup  target  samp+ver  draft")
    for r in rows:
        print(
            f"{r['k']:<2} {r['mode']:6} {r['batch']:<4} {r['context']:<6} {r['step_ms']:7.2f} "
            f"{r['tokens_per_step']:8.2f} {r['tok_s_per_request']:9.1f} "
            f"{r.get('speedup', 1.0):7.2f} {f(r['target_ms'])} {f(r['sample_verify_ms'])} "
            f"{f(r['draft_ms'])}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
