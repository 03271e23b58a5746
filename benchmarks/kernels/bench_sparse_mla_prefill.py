"""Sparse MLA prefill (MQA form) at GLM-5.3 shapes: H=64, d_qk=576, d_v=512, top-k 2048 random
rows of a flat bf16 context of S tokens. FLOP-bound: the floor is 50 % of the measured bf16 peak."""

from __future__ import annotations

import torch

from benchmarks.kernels.common import (
    dump_json,
    parser,
    print_rows,
    row,
    scaled_ref_ms,
    time_ms,
    ws_available,
)
from vllm.kernels.sparse_mla import RowFormat, sparse_mla_prefill_cost, sparse_mla_prefill_ref
from vllm.kernels.triton.sparse_mla_fwd import SparseMLAConfig, sparse_mla_fwd
from vllm.kernels.triton.utils import resource_report

SHAPES = [(8192, 32768), (32768, 131072), (131072, 131072)]  # (queries, context)
TOPK, H = 2048, 64


def bench(t: int, s: int, config=None, ref=True, tag="", kernel="triton", topk=TOPK) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, H, 576, device="cuda", generator=g).to(torch.bfloat16)
    kv = torch.randn(s, 576, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.randint(0, s, (t, topk), device="cuda", generator=g, dtype=torch.int32)
    scale = 576**-0.5
    fmt = RowFormat(512, 64, False)
    if kernel == "ws":
        from vllm.kernels.sparse_mla_ws import sparse_mla_ws

        run = lambda: sparse_mla_ws(q, kv, idx, scale, torch.bfloat16, 1)  # noqa: E731
    else:
        run = lambda: sparse_mla_fwd(q, kv, fmt, idx, scale, torch.bfloat16, config)  # noqa: E731
    ms = time_ms(run)
    ref_ms = None
    if ref:
        sub = 128
        ref_ms = scaled_ref_ms(
            lambda: sparse_mla_prefill_ref(q[:sub], kv, idx[:sub], scale, 512), sub, t
        )
    flops, nbytes = sparse_mla_prefill_cost(t, H, topk, out_bytes=2)
    note = "" if config is None else f"bn{config.block_n} w{config.num_warps} s{config.num_stages} "
    note += resource_report("sparse_mla_fwd")
    if kernel == "ws":
        note, tag = "gluon ws kernel", "_ws" + tag
    return row(f"sparse_prefill{tag}", f"T={t} S={s} H=64 topk={topk}", ms, flops, nbytes, "bf16",
               ref_ms, note)  # fmt: skip


def main():
    ap = parser(__doc__)
    ap.add_argument(
        "--topks",
        default="2048",
        help="top-k sizes, comma-separated (2048 is "
        "GLM-5.3's; others separate the per-token fixed cost from the per-block one)",
    )
    args = ap.parse_args()
    shapes = SHAPES[:1] if args.quick else SHAPES
    kernels = [
        k for k in args.kernels.split(",") if k == "triton" or (k == "ws" and ws_available())
    ]
    topks = [int(x) for x in args.topks.split(",")]
    rows = [bench(t, s, kernel=k, ref=k == "triton" and kk == TOPK, topk=kk)
            for k in kernels for t, s in shapes for kk in topks]  # fmt: skip
    if args.sweep:
        for bn, warps, stages in ((32, 8, 2), (32, 8, 3), (64, 16, 2), (32, 16, 3)):
            cfg = SparseMLAConfig(64, bn, warps, stages, 1)
            try:
                rows.append(bench(8192, 32768, cfg, ref=False, tag="*"))
            except Exception as e:  # e.g. out of shared memory: report, keep going
                print(f"config {cfg}: {type(e).__name__}: {str(e)[:120]}")
    print_rows(rows)
    dump_json(rows, args.json)


if __name__ == "__main__":
    main()
