"""Engine decode step: wall time against the GPU time of its kernels, with and without CUDA graphs.

The model runner runs in this process on a GLM-5.3-shaped slice (real attention, indexer and
vocabulary; `--layers` layers, random weights, fp8_ds_mla). B requests start with C tokens of
context already in the cache (rows written by the cache-write kernels from random values, so
nothing is prefilled), then decode `--steps` steps. Per step: wall time of `runner.execute` (which
ends with the step's one device->host sync: everything the step does), and, over a profiled
window, the summed device time of the kernels it ran (torch.profiler). Both modes run in the same
process on the same inputs; the fraction of requests decoding the same tokens is reported.

    python benchmarks/engine/bench_decode_step.py --batch 64,256 --context 8192,65536
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

from vllm.config.arch import GLM_5_3  # noqa: E402
from vllm.core.messages import (  # noqa: E402
    CachedRequestData,
    KVCachePlan,
    NewRequestData,
    SamplingOptions,
    SchedulerOutput,
)
from vllm.distributed.parallel_state import ParallelContext  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.kernels.kv_cache import write_indexer_cache, write_mla_cache  # noqa: E402
from vllm.kernels.triton.precompile import CompileWatch  # noqa: E402
from vllm.model_executor.model_loader import build_model  # noqa: E402
from vllm.model_executor.tiny import GLM_SLICE, TINY_CONFIG, tiny_state_dict, write_checkpoint  # noqa: E402
from vllm.worker.gpu.model_runner import ModelRunner  # noqa: E402


def checkpoint(layers: int) -> str:
    d = tempfile.mkdtemp(prefix="glm-slice-")
    cfg = {**TINY_CONFIG, **GLM_SLICE, "vocab_size": 154880, "num_hidden_layers": layers}
    write_checkpoint(d, cfg, tiny_state_dict(cfg, seed=3), tokenizer=False)
    return d


# One GPU's share of GLM-5.3 at EP8 (DP8 attention): every real dimension, 32 of the 256 routed
# experts, and top-8 routing among them, so that B requests put 8·B token-expert pairs on the
# GPU's experts as 8 replicas of B requests do at EP8; every layer MoE (the three dense layers of
# the real model are cheaper), the indexer full on one layer in four as in the real model's
# steady pattern (full at 6, 10, ..., 74). FP8 weights, random (--load-format dummy).
def real_dims_checkpoint(layers: int, mtp: int = 0) -> str:
    """A config-only folder (load it with ``load_format="dummy"``); ``mtp`` MTP layers."""
    d = tempfile.mkdtemp(prefix="glm53-ep8-share-")
    cfg = {
        **GLM_5_3,
        "num_hidden_layers": layers,
        "first_k_dense_replace": 0,
        "indexer_types": (["full", "shared", "shared", "shared"] * layers)[:layers],
        "n_routed_experts": 32,
        "num_experts_per_tok": 8,
        "num_nextn_predict_layers": mtp,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def fill_cache(runner: ModelRunner, num_tokens: int) -> None:
    """Valid rows (written by the production cache writers) in the first num_tokens slots."""
    dev = runner.device
    g = torch.Generator(device=dev).manual_seed(0)
    lay = runner.layout
    step = 1 << 20
    for attn in runner.model.attention_layers():
        for a in range(0, num_tokens, step):
            n = min(step, num_tokens - a)
            slots = torch.arange(a, a + n, device=dev)
            kv = torch.randn(n, lay.kv_lora_rank, device=dev, generator=g)
            pe = torch.randn(n, lay.rope_dim, device=dev, generator=g)
            write_mla_cache(attn.kv_cache, kv, pe, slots, lay)
            if attn.indexer_cache is not None:
                k = torch.randn(n, lay.index_head_dim, device=dev, generator=g)
                write_indexer_cache(attn.indexer_cache, k, slots, lay)
    if dev.type == "cuda":
        torch.cuda.synchronize()


def decode_run(
    path,
    batch,
    context,
    steps,
    graphs: bool,
    top_p: float,
    precompile: bool = True,
    load_format: str = "auto",
    pipelined: bool = False,
    top_n: int | None = 8,
) -> dict:
    """One decode run; ``top_n``: how many kernels (by device time) the result lists, all of
    them if None."""
    per_req_blocks = -(-(context + steps + 8) // 64)
    blocks = batch * per_req_blocks + 1
    cfg = EngineArgs(
        model=path,
        device="cuda",
        kv_cache_dtype="fp8_ds_mla",
        max_num_seqs=batch,
        max_model_len=per_req_blocks * 64,
        max_num_batched_tokens=max(2048, batch),
        num_gpu_blocks_override=blocks,
        kv_cache_memory_bytes=1,
        enforce_eager=not graphs,
        compilation_config={"cudagraph_capture_sizes": [batch]} if graphs else None,
    ).create_engine_config()
    dev = torch.device("cuda")
    model = build_model(path, dtype=cfg.model_config.dtype, device=dev, load_format=load_format)
    runner = ModelRunner(cfg, model, ParallelContext.single(), dev)
    t0 = time.perf_counter()
    runner.initialize_kv_cache(KVCachePlan(blocks))
    capture_s = time.perf_counter() - t0
    # as a worker does: the prefill warm-up and the context-dependent kernel variants compiled
    # before serving, then every compile inside a step counted (each is a stall)
    if precompile:
        runner.warm_up()
    n_pre, pre_s = runner.precompile() if precompile else (0, 0.0)
    fill_cache(runner, blocks * 64)
    watch = CompileWatch().start()
    sampling = SamplingOptions(
        temperature=0.8 if top_p < 1 else 0.0, top_p=top_p, seed=1, max_tokens=10**6
    )
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
    so = SchedulerOutput(
        step=0,
        new_reqs=new,
        num_scheduled_tokens={r: 1 for r in ids},
        total_num_scheduled_tokens=batch,
    )
    walls, tokens, prof_ms, prof, top_kernels = [], [], None, None, []
    held, t_read = None, 0.0
    warm, window = 4, 8
    for s in range(steps + 1):
        if s > 0:
            so = SchedulerOutput(
                step=s,
                cached_reqs=[CachedRequestData(r, [], context - 1 + s) for r in ids],
                num_scheduled_tokens={r: 1 for r in ids},
                total_num_scheduled_tokens=batch,
            )
        if s == warm:
            from torch.profiler import ProfilerActivity, profile

            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        if pipelined:  # as a worker under --async-scheduling: launch step s, then read s - 1
            launched = runner.launch(so)
            if held is not None:
                ro = runner.finish(held)
                now = time.perf_counter()
                walls.append(now - t_read)  # one step's throughput interval
                t_read = now
                tokens.append([t[0] for t in ro.sampled_token_ids])
            else:
                t_read = time.perf_counter()
            held = launched
        else:
            t0 = time.perf_counter()
            ro = runner.execute(so)
            walls.append(time.perf_counter() - t0)
            tokens.append([t[0] for t in ro.sampled_token_ids])
        if s == warm + window - 1:
            prof.__exit__(None, None, None)
            ka = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            prof_ms = sum(e.self_device_time_total for e in ka) / 1e3 / window
            top = sorted(ka, key=lambda e: -e.self_device_time_total)[:top_n]
            top_kernels = [
                (e.key[:80], round(e.self_device_time_total / 1e3 / window, 4), e.count // window)
                for e in top
            ]
    if held is not None:
        ro = runner.finish(held)
        walls.append(time.perf_counter() - t_read)
        tokens.append([t[0] for t in ro.sampled_token_ids])
    watch.stop()
    steady = walls[warm + window :]
    med = statistics.median(steady)
    del runner, model
    gc.collect()  # the runner and its graphs reference each other: refcounts never free them
    torch.cuda.empty_cache()
    return {
        "mode": ("pipe" if pipelined else "graph") if graphs else "eager",
        "batch": batch,
        "context": context,
        "top_p": top_p,
        "capture_s": capture_s,
        "precompiled": n_pre,
        "precompile_s": pre_s,
        "jit_compiles_in_steps": len(watch.compiles),
        "jit_compiles": watch.compiles,
        "step_ms_median": med * 1e3,
        "step_ms_mean": statistics.mean(steady) * 1e3,
        "step_ms_max": max(steady) * 1e3,
        "max_over_median": max(steady) / med,
        "gpu_ms_per_step": prof_ms,
        "wall_over_gpu": med * 1e3 / prof_ms if prof_ms else None,
        "steps_timed": len(steady),
        "top_kernels_ms_per_step": top_kernels,
        "tokens": tokens,
    }


def project(args) -> int:
    """Decode step of one GPU's share of GLM-5.3 (real dimensions, EP8's experts per GPU) at two
    depths (``--project-layers``, default 4 and 8: multiples of four, the indexer's pattern of one
    full layer in four), graphs: the slope is the time per layer, the intercept the fixed part
    (embedding, lm_head, sampling), and 78 layers = intercept + 78 × slope (78 itself as the
    larger depth measures the whole model's share on one GPU: ~105 GiB of FP8 weights). Not
    included: EP's two all-to-alls per MoE layer over NVLink (no multi-GPU machine to measure
    them) and MTP."""
    rows = []
    lo, hi = (int(x) for x in args.project_layers.split(","))
    paths = {n: real_dims_checkpoint(n) for n in (lo, hi)}
    for b in map(int, args.batch.split(",")):
        for c in map(int, args.context.split(",")):
            t = {}
            for n, path in paths.items():
                r = decode_run(path, b, c, args.steps, True, args.top_p, True, "dummy", top_n=None)
                r.pop("tokens")
                t[n] = r
                print("row:", json.dumps({"layers": n, **r}), flush=True)
            # per layer, by kernel: the two depths' device times differenced
            ks = []
            for n in (lo, hi):
                acc: dict[str, float] = {}
                for k, ms, _ in t[n]["top_kernels_ms_per_step"]:
                    acc[k] = acc.get(k, 0.0) + ms
                ks.append(acc)
            diff = sorted(
                ((k, (ks[1][k] - ks[0].get(k, 0.0)) / (hi - lo)) for k in ks[1]),
                key=lambda kv: -kv[1],
            )
            print(f"B={b} C={c}: device ms per layer by kernel (the {hi} - {lo} layer difference)")
            for k, ms in diff[: args.kernels]:
                print(f"  {ms * 1e3:8.1f} us  {k}")
            per_layer = (t[hi]["step_ms_median"] - t[lo]["step_ms_median"]) / (hi - lo)
            fixed = t[lo]["step_ms_median"] - lo * per_layer
            full = fixed + 78 * per_layer
            gpu = (t[hi]["gpu_ms_per_step"] or 0) - (t[lo]["gpu_ms_per_step"] or 0)
            rows.append(dict(batch=b, context=c, layers=(lo, hi), step_lo=t[lo]["step_ms_median"],
                             step_hi=t[hi]["step_ms_median"], ms_per_layer=per_layer,
                             gpu_ms_per_layer=gpu / (hi - lo), fixed_ms=fixed, step78=full,
                             tok_s_user=1e3 / full, tok_s_gpu=b * 1e3 / full))  # fmt: skip
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "glm53_projection", **r}) + "\n")
    print(
        f"B    ctx    {lo:3d}L ms {hi:3d}L ms  ms/layer (gpu)  fixed ms  78L step ms  tok/s/user"
        "  tok/s/GPU"
    )
    for r in rows:
        print(
            f"{r['batch']:<4} {r['context']:<7} {r['step_lo']:6.2f} {r['step_hi']:7.2f} "
            f"{r['ms_per_layer']:6.3f} ({r['gpu_ms_per_layer']:.3f}) {r['fixed_ms']:8.2f} "
            f"{r['step78']:11.1f} {r['tok_s_user']:11.1f} {r['tok_s_gpu']:10.0f}"
        )
    print("(no MTP, no EP all-to-all; the seed: 29.6 tok/s/user at c64 with MTP3 and HiSparse)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="64,256")
    ap.add_argument("--context", default="8192,65536")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--top-p", type=float, default=1.0, help="< 1: sampled rows with top-p")
    ap.add_argument("--max-tokens-in-cache", type=int, default=8 << 20)
    ap.add_argument(
        "--no-precompile",
        action="store_true",
        help="skip the start-up compile of the context-dependent kernels (ModelRunner.precompile)",
    )
    ap.add_argument(
        "--project",
        action="store_true",
        help="GLM-5.3 projection: one GPU's EP8 share at real dimensions (FP8, random weights), "
        "4 and 8 layers with graphs, the per-layer slope scaled to 78 layers",
    )
    ap.add_argument("--project-layers", default="4,8", help="with --project: the two depths")
    ap.add_argument(
        "--kernels", type=int, default=25, help="with --project: kernels listed per layer"
    )
    ap.add_argument(
        "--modes",
        default="eager,graph,pipe",
        help="eager; graph (CUDA graphs); pipe (graphs, step N + 1 launched before step N is "
        "read, as the worker does under --async-scheduling: wall = interval between reads)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.project:
        return project(args)
    path = checkpoint(args.layers)
    modes = args.modes.split(",")
    if not set(modes) <= {"eager", "graph", "pipe"}:
        ap.error(f"--modes: eager, graph, pipe; got {args.modes}")
    rows = []
    for b in map(int, args.batch.split(",")):
        for c in map(int, args.context.split(",")):
            if b * c > args.max_tokens_in_cache:
                print(f"skip B={b} C={c}: {b * c} tokens > --max-tokens-in-cache", flush=True)
                continue
            pair = [
                decode_run(
                    path,
                    b,
                    c,
                    args.steps,
                    m != "eager",
                    args.top_p,
                    not args.no_precompile,
                    pipelined=m == "pipe",
                )
                for m in modes
            ]
            # per request: its whole decoded sequence equal to the first mode's (random weights
            # leave near-ties that a padded batch's GEMMs may break the other way)
            seqs = [list(zip(*r["tokens"], strict=True)) for r in pair]
            for r, q in zip(pair, seqs, strict=True):
                r["rows_equal_first"] = sum(a == b for a, b in zip(seqs[0], q, strict=True)) / len(
                    q
                )
            for r in pair:
                r.pop("tokens")
                rows.append(r)
                print("row:", json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "decode_step", **r}) + "\n")
    hdr = "mode   B    ctx     wall ms  gpu ms  wall/gpu  max/med  capture s  rows=first  jit"
    print(hdr)
    for r in rows:
        print(
            f"{r['mode']:6} {r['batch']:<4} {r['context']:<7} {r['step_ms_median']:7.2f} "
            f"{r['gpu_ms_per_step'] or 0:7.2f} {r['wall_over_gpu'] or 0:8.2f} "
            f"{r['max_over_median']:8.2f} {r['capture_s']:9.2f}  {r['rows_equal_first']:10.2f}  "
            f"{r['jit_compiles_in_steps']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
