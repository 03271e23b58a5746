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
from vllm.kernels.merge_attn import merge_attn_states
from vllm.kernels.sparse_mla import RowFormat, num_splits, sparse_mla_decode_cost, sparse_mla_ref
from vllm.kernels.triton.sparse_mla_fwd import SparseMLAConfig, default_config, sparse_mla_fwd
from vllm.kernels.triton.utils import resource_report
from vllm.kv_cache_interface import KVCacheLayout

SHAPES = [64, 128, 256, 512, 1024]  # decode queries
CTX, NUM_REQS, TOPK, H = 131072, 16, 2048, 64
# the implementations that read each cache format
READS = {"fp8_ds_mla": ("triton", "cuda"), "auto": ("triton", "ws")}


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


def _call(kernel: str, q, rows, fmt: RowFormat, slots, scale: float, config):
    """One implementation as the op calls it, bf16 output."""
    if kernel == "triton":
        return lambda: sparse_mla_fwd(q, rows, fmt, slots, scale, torch.bfloat16, config)
    if kernel == "cuda":
        from vllm.kernels.sparse_mla_cuda import sparse_mla_fp8_cuda

        return lambda: sparse_mla_fp8_cuda(q, rows, slots, scale, torch.bfloat16)
    from vllm.kernels.sparse_mla_ws import sparse_mla_ws

    splits = num_splits(q.shape[0], q.shape[1], slots.shape[1], q.device)

    def ws():
        part_o, part_l = sparse_mla_ws(q, rows, slots, scale, torch.bfloat16, splits)
        return part_o[0] if splits == 1 else merge_attn_states(part_o, part_l, torch.bfloat16)

    return ws


def bench(
    t: int,
    cache_dtype: str,
    config=None,
    ref=True,
    tag="",
    kernel="triton",
    ctx: int = CTX,
) -> dict:
    layout, cache, slots, q = make_inputs(t, cache_dtype, ctx=ctx)
    scale = 1 / math.sqrt(256)
    rows = cache.view(-1, cache.shape[-1])
    fmt = RowFormat(512, 64, layout.is_fp8)
    run = _call(kernel, q, rows, fmt, slots, scale, config)
    eager_ms = time_ms(run)
    ms = time_ms_graph(run)
    ref_ms = None
    if ref:
        sub = min(t, 64)
        ref_ms = scaled_ref_ms(
            lambda: sparse_mla_ref(q[:sub], cache, slots[:sub], layout, scale), sub, t
        )
    flops, nbytes = sparse_mla_decode_cost(t, H, TOPK, layout.is_fp8, out_bytes=2)
    cfg = config or default_config(t, H, TOPK, q.device)
    note = f"bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} split{cfg.num_splits} "
    note += resource_report("sparse_mla_fwd")
    if kernel == "ws":
        note = f"gluon ws kernel, split{cfg.num_splits}"
        tag = "_ws" + tag
    elif kernel == "cuda":
        note = "cuda c++ kernel (vllm._C)"
        tag = "_cuda" + tag
    note += f"; eager {eager_ms:.3f} ms"
    shape = f"T={t} H=64 topk=2048 ctx={ctx // 1024}K"
    return row(f"sparse_decode_{cache_dtype[:3]}{tag}", shape, ms,
               flops, nbytes, "bf16", ref_ms, note)  # fmt: skip


def main():
    p = parser(__doc__)
    p.add_argument("--ctx", type=int, default=CTX, help="tokens per request (16 requests)")
    args = p.parse_args()
    ctx = args.ctx
    shapes = SHAPES[:2] if args.quick else SHAPES
    kernels = [k for k in args.kernels.split(",") if k == "triton" or ws_available()]
    rows = []
    for kernel in kernels:  # same process, same inputs: the ratio between kernels is direct
        if kernel in READS["fp8_ds_mla"]:
            rows += [
                bench(t, "fp8_ds_mla", kernel=kernel, ref=kernel == "triton", ctx=ctx)
                for t in shapes
            ]
        if kernel in READS["auto"]:
            rows += [
                bench(t, "auto", kernel=kernel, ref=kernel == "triton", ctx=ctx)
                for t in (shapes[0], shapes[-1])
            ]
    if args.sweep:
        for t in (64, 256):
            for bn, warps, stages in ((64, 8, 2), (32, 16, 2), (64, 16, 2), (64, 16, 3)):
                base = default_config(t, H, TOPK, torch.device("cuda"))
                cfg = SparseMLAConfig(64, bn, warps, stages, base.num_splits)
                try:
                    rows.append(bench(t, "fp8_ds_mla", cfg, ref=False, tag="*"))
                except Exception as e:  # e.g. out of shared memory: report, keep going
                    print(f"config {cfg}: {type(e).__name__}: {str(e)[:120]}")
    print_rows(rows)
    dump_json(rows, args.json)


if __name__ == "__main__":
    main()
