"""Issue 8 in one call: PCP×DCP×EP prefill and DP+EP HiSparse decode on N GPUs (NCCL), against one
GPU, plus PCP scaling, the DCP overhead curve and capacity. Written for `nvidia-h200-x8`
(N = 8); runs at any N, and on CPU (gloo) at toy sizes to check the script itself:

    NCCL_NVLS_ENABLE=0 python benchmarks/multi_gpu/validate.py --ngpu 8            # 8×H200
    python benchmarks/multi_gpu/validate.py --device cpu --ngpu 2 --small          # smoke test

Model: a GLM-5.3-shaped slice (real attention and indexer dims, 4 layers F S S S, 8 experts split by
EP, random weights), written once as a checkpoint. Results: a table on stdout and JSON lines
(`--json`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config.arch import GLM_5_3, ModelArch  # noqa: E402
from vllm.kv_cache_interface import kv_bytes_per_token  # noqa: E402
from vllm.model_executor.tiny import GLM_SLICE, TINY_CONFIG, tiny_state_dict, write_checkpoint  # noqa: E402

SLICE = {**GLM_SLICE, "n_routed_experts": 8}  # 8 experts: one per EP rank at N = 8


def checkpoint(small: bool) -> str:
    d = tempfile.mkdtemp(prefix="glm-slice-")
    cfg = dict(TINY_CONFIG) if small else {**TINY_CONFIG, **SLICE}
    write_checkpoint(d, cfg, tiny_state_dict(cfg, seed=3), tokenizer=False)
    return d


def prompt(n: int, salt: int = 0) -> dict:
    return {"prompt_token_ids": [(7 * i + salt) % 1000 + 3 for i in range(n)]}


def make_llm(ckpt, args, **kw) -> LLM:
    """The slice on args.device with args.kv_cache_dtype, token-id prompts only."""
    return LLM(
        ckpt, device=args.device, kv_cache_dtype=args.kv_cache_dtype, skip_tokenizer_init=True, **kw
    )


def greedy(ckpt, args, prompts, max_tokens, **kw):
    llm = make_llm(ckpt, args, **kw)
    try:
        outs = llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        )
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def ttft(ckpt, args, n_tokens, **kw):
    llm = make_llm(ckpt, args, **kw)
    try:
        # warm-up at the same length with other tokens (no prefix hit): compiles the sparse
        # path's kernels for these shapes and sets up NCCL, outside the timed prefill
        llm.generate(prompt(n_tokens, 99), SamplingParams(max_tokens=1))
        t0 = time.perf_counter()
        llm.generate(prompt(n_tokens), SamplingParams(temperature=0, max_tokens=1))
        return time.perf_counter() - t0, llm.client.info
    finally:
        llm.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ngpu", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny model and lengths (CPU smoke test)")
    ap.add_argument("--kv-cache-dtype", default="fp8_ds_mla")
    ap.add_argument(
        "--kv-gib-per-gpu", type=float, default=15.0, help="per-GPU KV budget for the capacity test"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--only",
        default="correctness,scaling,dcp,capacity,decode",
        help="comma-separated parts to run (default: all)",
    )
    ap.add_argument(
        "--lengths", type=int, nargs="+", default=None, help="PCP scaling prompt lengths"
    )
    ap.add_argument(
        "--contexts", type=int, nargs="+", default=None, help="DCP overhead cached contexts"
    )
    args = ap.parse_args()
    parts = set(args.only.split(","))
    n, rows = args.ngpu, []
    ckpt = checkpoint(args.small)
    lens = args.lengths or ([300, 700] if args.small else [32768, 131072])
    chunk = 64 if args.small else 2048
    ctxs = args.contexts or ([256, 512] if args.small else [16384, 65536, 131072, 253952])

    t_start = time.perf_counter()

    def record(**r):
        r["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        rows.append(r)
        print(json.dumps(r), flush=True)

    if "correctness" in parts:
        correctness(ckpt, args, n, record)
    if "scaling" in parts:
        scaling(ckpt, args, n, lens, record)
    if "dcp" in parts:
        dcp_overhead(ckpt, args, n, ctxs, chunk, record)
    if "capacity" in parts:
        capacity(ckpt, args, n, record)
    if "decode" in parts:
        decode(ckpt, args, n, record)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0 if all(r.get("same_greedy_as_1gpu", True) for r in rows) else 1


def correctness(ckpt, args, n, record):
    probe = [prompt(x, s) for s, x in enumerate([37, 400 if args.small else 5000])]
    ref = greedy(ckpt, args, probe, 16)
    for name, kw in {
        f"PCP{n}xDCP{n}xEP{n} ag_rs": dict(
            prefill_context_parallel_size=n,
            decode_context_parallel_size=n,
            enable_expert_parallel=True,
        ),
        f"PCP{n}xDCP{n}xEP{n} a2a": dict(
            prefill_context_parallel_size=n,
            decode_context_parallel_size=n,
            enable_expert_parallel=True,
            dcp_comm_backend="a2a",
        ),
        f"PCP{n}": dict(prefill_context_parallel_size=n),
        f"DP{n}+EP{n}": dict(data_parallel_size=n, enable_expert_parallel=True),
    }.items():
        record(
            test="correctness",
            config=name,
            same_greedy_as_1gpu=greedy(ckpt, args, probe, 16, **kw) == ref,
        )


def scaling(ckpt, args, n, lens, record):
    """PCP scaling (TTFT)."""
    for length in lens:
        base = None
        for p in [x for x in (1, 2, 4, 8) if x <= n]:
            t, _ = ttft(
                ckpt, args, length, prefill_context_parallel_size=p, max_num_batched_tokens=length
            )
            base = base or t
            record(test="pcp_scaling", prompt=length, pcp=p, ttft_s=t, efficiency=base / (t * p))


def dcp_overhead(ckpt, args, n, ctxs, chunk, record):
    """One chunk after a cached context, DCP n against DCP 1."""
    for ctx in ctxs:
        for dcp in (1, n):
            llm = make_llm(
                ckpt,
                args,
                prefill_context_parallel_size=n,
                decode_context_parallel_size=dcp,
                max_num_batched_tokens=chunk,
            )
            try:
                llm.generate(prompt(ctx), SamplingParams(max_tokens=1))  # caches the context
                times = []
                for fill in range(5, 9):  # the first is a warm-up (kernels for these shapes)
                    t0 = time.perf_counter()
                    llm.generate(
                        {"prompt_token_ids": prompt(ctx)["prompt_token_ids"] + [fill] * chunk},
                        SamplingParams(max_tokens=1),
                    )
                    times.append(time.perf_counter() - t0)
                record(
                    test="dcp_overhead",
                    context=ctx,
                    dcp=dcp,
                    chunk_s=min(times[1:]),
                    chunk_s_all=[round(t, 4) for t in times],
                )
            finally:
                llm.shutdown()


def capacity(ckpt, args, n, record):
    """The longest prompt with the per-GPU KV budget GLM-5.3 leaves on an H200."""
    # --kv-gib-per-gpu is GLM-5.3's budget: scaled by the slice's KV bytes per token against
    # GLM-5.3's, so the slice holds as many tokens per GPU as the full model would
    full = kv_bytes_per_token(ModelArch.from_dict(GLM_5_3), args.kv_cache_dtype)
    part = kv_bytes_per_token(ModelArch.from_dict({**TINY_CONFIG, **SLICE}), args.kv_cache_dtype)
    budget = int(args.kv_gib_per_gpu * 2**30 * part / full) if not args.small else 8 << 20
    for dcp in (1, n):
        llm = make_llm(
            ckpt,
            args,
            prefill_context_parallel_size=n,
            decode_context_parallel_size=dcp,
            kv_cache_memory_bytes=budget,
            max_num_batched_tokens=64 if args.small else 8192,
        )
        try:
            cap = llm.client.info["max_request_tokens"]
            target = min(cap - 1, 1 << 20) if not args.small else cap - 1
            t0 = time.perf_counter()
            llm.generate(prompt(target), SamplingParams(max_tokens=1))
            record(
                test="capacity",
                pcp=n,
                dcp=dcp,
                kv_bytes_per_gpu=budget,
                longest_prompt=cap,
                prefilled=target,
                prefill_s=time.perf_counter() - t0,
                million_ok=target >= (1 << 20),
            )
        finally:
            llm.shutdown()


def decode(ckpt, args, n, record):
    """DP + EP + HiSparse at long context."""
    llm = make_llm(
        ckpt,
        args,
        data_parallel_size=n,
        enable_expert_parallel=True,
        attention_config={"hisparse_config": {"host_pool_gib": 0.05 if args.small else 48}},
    )
    try:
        ctx = 1000 if args.small else 131072
        reqs = [prompt(ctx, s) for s in range(2 * n)]
        llm.generate(reqs, SamplingParams(max_tokens=1))  # prefill (prefix-cached afterwards)
        # compiles the decode path's kernels for this context; then the decode rate is the
        # difference of two runs over the same cached prompts (each re-admits them: prefix hits
        # from the host pool, indexer keys restored), divided by the extra tokens
        sp = lambda m: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)  # noqa: E731
        llm.generate(reqs, sp(4))
        times = []
        for m in (4, 68):
            t0 = time.perf_counter()
            llm.generate(reqs, sp(m))
            times.append(time.perf_counter() - t0)
        step = (times[1] - times[0]) / 64
        record(
            test="decode_hisparse",
            dp=n,
            context=ctx,
            requests=len(reqs),
            readmit_4tok_s=times[0],
            decode_step_ms=step * 1e3,
            tok_s_per_gpu=len(reqs) / step / n,
            tok_s_per_request=1 / step,
        )
    finally:
        llm.shutdown()


if __name__ == "__main__":
    sys.exit(main())
