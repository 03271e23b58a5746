"""Sparse MLA decode at GLM-5.3 shapes: H=64, d_qk=576, d_v=512, top-k 2048, fp8_ds_mla (656-byte
rows) and bf16 caches. Queries belong to 16 requests of 128K tokens each (a 2M-token cache, far
beyond L2); each query's top-k are random slots of its own request.

A row's time is the GPU time per call: 20 calls captured in a CUDA graph and replayed
(:func:`benchmarks.kernels.common.time_ms_graph`; the engine's decode steps run as graphs). At 64
queries a call takes ~0.1 ms, about what the host needs to launch its kernels from Python, so
the eager time (in the note) measures the host there. ``--ctx N`` shrinks each request to N tokens
(a diagnostic: at 2K tokens the whole cache sits in L2, so the gap to 128K is what HBM costs)."""

from __future__ import annotations

import math

import torch

from benchmarks.kernels.common import (
    dump_json,
    parser,
    print_rows,
    row,
    scaled_ref_ms,
    time_ms,
    time_ms_graph,
    ws_available,
)
from vllm.kernels.sparse_mla import sparse_mla_decode, sparse_mla_decode_cost, sparse_mla_ref
from vllm.kernels.triton.sparse_mla_fwd import SparseMLAConfig, default_config
from vllm.kernels.triton.utils import resource_report
from vllm.kv_cache_interface import KVCacheLayout

SHAPES = [64, 128, 256, 512, 1024]  # decode queries
CTX, NUM_REQS, TOPK, H = 131072, 16, 2048, 64


def make_inputs(t: int, cache_dtype: str, seed: int = 0, ctx: int = CTX):
    g = torch.Generator(device="cuda").manual_seed(seed)
    layout = KVCacheLayout(cache_dtype, torch.bfloat16, 512, 64, 128)
    nb = NUM_REQS * ctx // layout.block_size
    if layout.is_fp8:  # random valid rows: e4m3 values, positive scales, bf16 rope
        cache = torch.randint(0, 256, layout.mla_cache_shape(nb), device="cuda", dtype=torch.uint8)
        cache[..., :512] &= 0x77  # no NaN patterns, moderate magnitudes
        sc = torch.rand(nb, 64, 4, device="cuda", generator=g) * 0.01 + 1e-3
        cache[..., 512:528] = sc.view(torch.uint8).view(nb, 64, 16)
        rope = torch.randn(nb, 64, 64, device="cuda", generator=g).to(torch.bfloat16)
        cache[..., 528:] = rope.view(torch.uint8).view(nb, 64, 128)
    else:
        cache = torch.randn(layout.mla_cache_shape(nb), device="cuda", generator=g)
        cache = cache.to(torch.bfloat16)
    req = torch.arange(t, device="cuda") % NUM_REQS
    slots = torch.randint(0, ctx, (t, TOPK), device="cuda", generator=g) + (req * ctx)[:, None]
    q = torch.randn(t, H, 576, device="cuda", generator=g).to(torch.bfloat16)
    return layout, cache, slots.to(torch.int32), q


def bench(
    t: int,
    cache_dtype: str,
    config=None,
    int_dequant=False,
    ref=True,
    tag="",
    kernel="triton",
    ctx: int = CTX,
) -> dict:
    layout, cache, slots, q = make_inputs(t, cache_dtype, ctx=ctx)
    scale = 1 / math.sqrt(256)

    def run():
        return sparse_mla_decode(
            q, cache, slots, layout, scale, torch.bfloat16, config, int_dequant, kernel=kernel
        )

    eager_ms = time_ms(run)
    ms = time_ms_graph(run)
    ref_ms = None
    if ref:
        sub = min(t, 64)
        ref_ms = scaled_ref_ms(
            lambda: sparse_mla_ref(q[:sub], cache, slots[:sub], layout, scale), sub, t
        )
    flops, nbytes = sparse_mla_decode_cost(t, H, TOPK, layout.is_fp8, out_bytes=2)
    cfg = config or default_config(t, H, TOPK, layout.is_fp8, q.device)
    note = f"bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} split{cfg.num_splits}"
    note += (" int-deq " if int_dequant else " ") + resource_report("sparse_mla_fwd")
    if kernel == "ws":
        note = f"gluon ws kernel, split{cfg.num_splits}"
        tag = "_ws" + tag
    elif kernel == "cuda":
        from vllm.kernels import sparse_mla_cuda

        note = f"cuda c++ kernel, grid {sparse_mla_cuda.NUM_CTAS or 'default'}"
        tag = "_cuda" + tag
    note += f"; eager {eager_ms:.3f} ms"
    shape = f"T={t} H=64 topk=2048 ctx={ctx // 1024}K"
    return row(f"sparse_decode_{cache_dtype[:3]}{tag}", shape, ms,
               flops, nbytes, "bf16", ref_ms, note)  # fmt: skip


def main():
    p = parser(__doc__)
    p.add_argument(
        "--cuda-defines",
        default="",
        help="';'-separated build variants of the CUDA kernel, each 'NAME=V,...' (its -D knobs)",
    )
    p.add_argument("--ctx", type=int, default=CTX, help="tokens per request (16 requests)")
    p.add_argument(
        "--cuda-attrs",
        default="",
        help="';'-separated launcher settings of the CUDA kernel to time, each 'NAME=V,...' "
        "(attributes of vllm.kernels.sparse_mla_cuda, e.g. NUM_CTAS=128)",
    )
    p.add_argument(
        "--cuda-src",
        default="",
        help="';'-separated directories holding another version of the CUDA kernel's sources "
        "(sparse_mla_fp8_sm90.cu and its .cuh files, e.g. exported from an earlier commit) to "
        "time as baselines in the same process",
    )
    args = p.parse_args()
    ctx = args.ctx
    shapes = SHAPES[:2] if args.quick else SHAPES
    kernels = [k for k in args.kernels.split(",") if k != "ws" or ws_available()]
    rows = []
    for kernel in kernels:  # same process, same inputs: the ratio between kernels is direct
        rows += [
            bench(t, "fp8_ds_mla", kernel=kernel, ref=kernel == "triton", ctx=ctx) for t in shapes
        ]
        if kernel != "cuda":  # the CUDA kernel reads fp8_ds_mla rows only
            rows += [
                bench(t, "auto", kernel=kernel, ref=kernel == "triton", ctx=ctx)
                for t in (shapes[0], shapes[-1])
            ]
    if args.sweep:
        for t in (64, 256):
            for bn, warps, stages in ((64, 8, 2), (32, 16, 2), (64, 16, 2), (64, 16, 3)):
                base = default_config(t, H, TOPK, True, torch.device("cuda"))
                cfg = SparseMLAConfig(64, bn, warps, stages, base.num_splits)
                try:
                    rows.append(bench(t, "fp8_ds_mla", cfg, False, ref=False, tag="*"))
                except Exception as e:  # e.g. out of shared memory: report, keep going
                    print(f"config {cfg}: {type(e).__name__}: {str(e)[:120]}")
    if args.cuda_defines:  # build variants of the CUDA kernel, same process and inputs
        from vllm.kernels import sparse_mla_cuda

        for spec in args.cuda_defines.split(";"):
            sparse_mla_cuda.DEFINES = sparse_mla_cuda.parse_defines(spec)
            for t in shapes:
                rows.append(
                    bench(t, "fp8_ds_mla", kernel="cuda", ref=False, tag=f"[{spec}]", ctx=ctx)
                )
        sparse_mla_cuda.DEFINES = {}
    if args.cuda_attrs:  # launcher settings of the CUDA kernel (grid size...), same inputs
        from vllm.kernels import sparse_mla_cuda

        for spec in args.cuda_attrs.split(";"):
            attrs = sparse_mla_cuda.parse_defines(spec)
            saved = {k: getattr(sparse_mla_cuda, k) for k in attrs}
            for k, v in attrs.items():
                setattr(sparse_mla_cuda, k, v)
            for t in shapes:
                rows.append(
                    bench(t, "fp8_ds_mla", kernel="cuda", ref=False, tag=f"[{spec}]", ctx=ctx)
                )
            for k, v in saved.items():
                setattr(sparse_mla_cuda, k, v)
    if args.cuda_src:  # other versions of the kernel's sources, same process and inputs
        from pathlib import Path

        from vllm.kernels import sparse_mla_cuda

        saved_src = sparse_mla_cuda.SRC
        for d in args.cuda_src.split(";"):
            sparse_mla_cuda.SRC = Path(d) / saved_src.name
            sparse_mla_cuda.clear_caches()
            for t in shapes:
                rows.append(
                    bench(t, "fp8_ds_mla", kernel="cuda", ref=False, tag=f"[src={d}]", ctx=ctx)
                )
        sparse_mla_cuda.SRC = saved_src
        sparse_mla_cuda.clear_caches()
    print_rows(rows)
    dump_json(rows, args.json)


if __name__ == "__main__":
    main()
