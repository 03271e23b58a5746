"""Launch one kernel a few times on benchmark-shaped inputs, for Nsight Compute to profile.

Run it under ``ncu`` (the GPU machine has it; ``--clock-control none`` leaves the clocks alone):

    ncu --clock-control none --kernel-name regex:_collect_kernel --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python3 benchmarks/kernels/profile_ncu.py topk --rows 8192 --cols 131072 --causal

Ops: ``topk`` (random fp32 logits, causal limits as in a prefill chunk, or full rows),
``indexer_write`` (FP8 indexer keys to random or paged slots of a 1M-slot cache) and
``sparse_mla_decode`` (``--rows`` decode queries on bench_sparse_mla_decode's inputs, ``--cache``
fp8_ds_mla or auto, ``--kernel`` triton or ws; ``--ws-set NAME=VALUE,...`` overrides
``sparse_mla_ws`` module defaults, e.g. ``FP8_ONE_WAVE_SCHEDULE=split``). Each launch is
the whole op, so pick the kernel with ``--kernel-name``; ``--launches`` runs it that many times.
"""

from __future__ import annotations

import argparse

import torch


def topk(args):
    from vllm.kernels.topk import indexer_topk

    g = torch.Generator(device="cuda").manual_seed(0)
    t, s = args.rows, args.cols
    logits = torch.randn(t, s, device="cuda", generator=g)
    if args.causal:
        limit = torch.arange(s - t + 1, s + 1, device="cuda")
    else:
        limit = torch.full((t,), s, device="cuda")
    return lambda: indexer_topk(logits, limit, 2048)


def indexer_write(args):
    from vllm.attention.kv_cache import KVCacheLayout
    from vllm.kernels.kv_write import write_indexer_cache

    g = torch.Generator(device="cuda").manual_seed(0)
    n, slots_total = args.rows, 1 << 20
    layout = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, 128)
    nb = slots_total // 64
    if args.paged:
        blocks = torch.randperm(nb, device="cuda", generator=g)[: n // 64]
        slots = (blocks.unsqueeze(1) * 64 + torch.arange(64, device="cuda")).flatten()
    else:
        slots = torch.randperm(slots_total, device="cuda", generator=g)[:n]
    k = torch.randn(n, 128, device="cuda", generator=g).to(torch.bfloat16)
    cache = layout.allocate_indexer(nb, "cuda")
    return lambda: write_indexer_cache(cache, k, slots, layout)


def sparse_mla_decode(args):
    import math

    from benchmarks.kernels.bench_sparse_mla_decode import make_inputs
    from vllm.kernels import sparse_mla_ws
    from vllm.kernels.sparse_mla_decode import sparse_mla_decode as decode

    for kv in filter(None, args.ws_set.split(",")):
        name, value = kv.split("=")
        if not hasattr(sparse_mla_ws, name):
            raise SystemExit(f"sparse_mla_ws has no {name}")
        setattr(sparse_mla_ws, name, int(value) if value.lstrip("-").isdigit() else value)
    if args.cuda_defines:
        from vllm.kernels import sparse_mla_cuda

        sparse_mla_cuda.DEFINES.update(sparse_mla_cuda.parse_defines(args.cuda_defines))
    layout, cache, slots, q = make_inputs(args.rows, args.cache)
    scale = 1 / math.sqrt(256)
    return lambda: decode(q, cache, slots, layout, scale, torch.bfloat16, kernel=args.kernel)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("op", choices=["topk", "indexer_write", "sparse_mla_decode"])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=131072)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--paged", action="store_true")
    p.add_argument("--launches", type=int, default=2)
    p.add_argument("--cache", default="fp8_ds_mla", choices=["fp8_ds_mla", "auto"])
    p.add_argument("--kernel", default="ws", choices=["triton", "ws", "cuda"])
    p.add_argument("--cuda-defines", default="", help="the CUDA kernel's build knobs, NAME=V,...")
    p.add_argument("--ws-set", default="", help="sparse_mla_ws module defaults, NAME=VALUE,...")
    args = p.parse_args()
    ops = {"topk": topk, "indexer_write": indexer_write, "sparse_mla_decode": sparse_mla_decode}
    fn = ops[args.op](args)
    for _ in range(args.launches):
        fn()
    torch.cuda.synchronize()
    print(f"{args.op}: {args.launches} launches done")


if __name__ == "__main__":
    main()
