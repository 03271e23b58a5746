"""`vllm plan`: capacity and cost of a deployment, from a model config and a hardware description.

    vllm plan                                   # built-in GLM-5.3, DP8xEP8 / TP8 / PCP8xEP8 / PCP8xDCP8xEP8
    vllm plan ./ckpt --pcp 8 --dcp 8 --hisparse --context 1M
    vllm plan --layouts DP8+HS PCP8xDCP8+HS --host-pool-gib 48 --json

The arithmetic lives in `vllm.plan`; this module parses flags, validates them and prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from vllm.model_executor.weight_bytes import KINDS
from vllm.plan import (
    DEFAULT_LAYOUTS,
    H200,
    Layout,
    PlanInputs,
    load_arch,
    make_plan,
    parse_layout,
    parse_tokens,
)

DESCRIPTION = (
    "Capacity and cost model for serving a sparse-MLA model: weights per GPU (FP8 and bf16) and "
    "whether they fit, KV bytes per token, longest context, concurrency, sparse-MLA FLOP/byte, "
    "indexer crossover and PCP/DCP all-gather traffic, for one or several layouts (DP/TP/PCP/DCP/"
    "EP, with or without HiSparse)."
)


def _fill_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "model",
        nargs="?",
        default="glm-5.3",
        help="folder holding config.json, or 'glm-5.3' for the built-in config (default)",
    )
    g = p.add_argument_group("layout")
    g.add_argument(
        "--layouts",
        nargs="+",
        metavar="LAYOUT",
        help="layouts to compare, e.g. DP8xEP8 TP8 PCP8xDCP8xEP8 (commas also separate); "
        "'+HS' turns HiSparse on for one layout (default: " + ",".join(DEFAULT_LAYOUTS) + ")",
    )
    for flag, name in (("--dp", "data"), ("--tp", "tensor"), ("--pcp", "prefill context")):
        g.add_argument(flag, type=int, help=f"{name} parallel size of a single layout")
    g.add_argument("--dcp", type=int, help="decode context parallel size (reuses TP/PCP ranks)")
    g.add_argument(
        "--ep",
        type=int,
        help="expert parallel size of a single layout: 1 or DP·TP·PCP (experts over every GPU)",
    )
    g.add_argument("--hisparse", action="store_true", help="HiSparse on for every layout")
    g.add_argument("--host-pool-gib", type=float, default=48.0, help="HiSparse pool per GPU")
    w = p.add_argument_group("workload")
    w.add_argument("--context", default="128K", help="tokens per request (e.g. 131072, 1M)")
    w.add_argument("--prefill-chunk", default="2048", help="prefill chunk tokens (PCP gather)")
    w.add_argument("--decode-batch", type=int, default=64, help="requests per decode step")
    w.add_argument("--kv-cache-dtype", default="fp8_ds_mla", help="fp8_ds_mla (default) or auto")
    w.add_argument(
        "--mtp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="count the MTP layer's KV and draft queries (default: on if the model has one)",
    )
    w.add_argument("--num-speculative-tokens", type=int, default=3)
    h = p.add_argument_group("hardware (H200 defaults)")
    h.add_argument("--kv-hbm-gib", type=float, default=H200.kv_gib_per_gpu, help="HBM for KV")
    h.add_argument(
        "--hbm-gib",
        type=float,
        default=H200.hbm_gib_usable,
        help="HBM one process can use per GPU, for the weights check",
    )
    h.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="as the engine's")
    h.add_argument("--host-mem-gib", type=float, default=H200.host_gib_per_gpu, help="per GPU")
    h.add_argument("--link-gbs", type=float, default=H200.nvlink_gbs, help="GB/s each way")
    h.add_argument("--hbm-tbs", type=float, default=H200.hbm_tbs, help="HBM TB/s")
    h.add_argument("--bf16-tflops", type=float, default=H200.bf16_tflops)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `plan` on an argparse subparsers object; `args.func` is `run`."""
    p = subparsers.add_parser("plan", help="capacity and cost model", description=DESCRIPTION)
    _fill_parser(p).set_defaults(func=run)
    return p


def _layouts(args: argparse.Namespace) -> list[Layout]:
    sizes = {a: getattr(args, a) for a in ("dp", "tp", "pcp", "dcp", "ep")}
    given = {a: n for a, n in sizes.items() if n is not None}
    if given and args.layouts:
        raise ValueError("give either --layouts or --dp/--tp/--pcp/--dcp/--ep, not both")
    if given:
        layouts = [Layout(**given)]
    else:
        texts = [t for item in (args.layouts or DEFAULT_LAYOUTS) for t in item.split(",") if t]
        layouts = [parse_layout(t) for t in texts]
    if args.hisparse:
        layouts = [replace(x, hisparse=True) for x in layouts]
    return layouts


def _build(args: argparse.Namespace) -> dict:
    name, arch = load_arch(args.model)
    mtp = arch.num_nextn_predict_layers > 0 if args.mtp is None else args.mtp
    for flag, value in (("--host-pool-gib", args.host_pool_gib), ("--link-gbs", args.link_gbs)):
        if value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    if args.kv_hbm_gib <= 0 or args.decode_batch < 1:
        raise ValueError("--kv-hbm-gib and --decode-batch must be positive")
    if args.num_speculative_tokens < 0:
        raise ValueError("--num-speculative-tokens must be >= 0")
    hw = replace(
        H200,
        kv_gib_per_gpu=args.kv_hbm_gib,
        host_gib_per_gpu=args.host_mem_gib,
        hbm_tbs=args.hbm_tbs,
        bf16_tflops=args.bf16_tflops,
        hbm_gib_usable=args.hbm_gib,
    )
    inputs = PlanInputs(
        context_tokens=parse_tokens(args.context),
        prefill_chunk_tokens=parse_tokens(args.prefill_chunk),
        decode_batch=args.decode_batch,
        cache_dtype=args.kv_cache_dtype,
        mtp=mtp,
        num_speculative_tokens=args.num_speculative_tokens,
        host_pool_gib=args.host_pool_gib,
        link_gbs=args.link_gbs,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    return make_plan(arch, _layouts(args), hw, inputs, model_name=name)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _weights_line(plan: dict) -> str:
    w = plan["weights_gb"]
    total = {k: sum(by.values()) for k, by in w.items()}
    mtp = ", MTP layer included" if plan["arch"]["num_mtp_layers"] else ""
    return (
        f"weights FP8 {total['fp8']:,.0f} GB (routed experts {w['fp8']['routed experts']:,.0f} GB,"
        f" the rest {total['fp8'] - w['fp8']['routed experts']:,.1f} GB), bf16 "
        f"{total['bf16']:,.0f} GB{mtp}; per GPU below, counted as the worker counts them"
    )


def _k(n: int) -> str:
    return f"{n / 1024:g}K" if n < 1 << 20 else f"{n / (1 << 20):g}M"


def format_table(plan: dict) -> str:
    a, hw, inp, rows_in = plan["arch"], plan["hardware"], plan["inputs"], plan["layouts"]
    ctx, chunk = _k(inp["context_tokens"]), _k(inp["prefill_chunk_tokens"])
    queries = inp["decode_batch"] * (1 + (inp["num_speculative_tokens"] if inp["mtp"] else 0))
    link = f"{inp['link_gbs']:g} GB/s"
    room = f" [{hw['hbm_gib_usable']:g}·{inp['gpu_memory_utilization']:g} − weights − 4]"
    lines = [
        f"model {plan['model']}: {a['num_layers']} layers ({a['num_full_indexer_layers']} with an "
        f"indexer) + {a['num_mtp_layers']} MTP, {a['num_attention_heads']} heads, "
        f"top-k {a['index_topk']}, kv cache {inp['cache_dtype']}",
        f"KV per token {plan['kv_bytes_per_token']:,} B (MLA row {plan['mla_row_bytes']} B, "
        f"indexer key {plan['indexer_key_bytes']} B); a {inp['context_tokens']:,}-token request "
        f"needs {plan['request_kv_gib']:.1f} GiB",
        _weights_line(plan),
        f"{hw['name']}: {hw['kv_gib_per_gpu']:g} GiB HBM for KV per GPU, host {hw['host_gib_per_gpu']:g}"
        f" GiB per GPU (HiSparse pool {inp['host_pool_gib']:g}), link {link}, BF16 ridge "
        f"{hw['ridge_flop_per_byte']:.0f} FLOP/B (measured {hw['ridge_flop_per_byte_measured']:.0f})",
        "",
    ]
    spec = [
        ("GPUs (replicas)", lambda r: f"{r['num_gpus']} ({r['replicas']})"),
        ("attention heads per GPU", lambda r: str(r["heads_per_gpu"])),
        ("KV bytes per token per GPU", lambda r: f"{r['kv_bytes_per_token_per_gpu']:,.0f}"),
        (f"KV of a {ctx} request per GPU (GiB)", lambda r: f"{r['request_kv_gib_per_gpu']:.2f}"),
        ("weights per GPU, FP8 (GiB)", lambda r: f"{r['weights_fp8_gib']:.2f}"),
        *[
            (f"  {kind}", lambda r, kind=kind: f"{r['weights_fp8_by_kind_gib'][kind]:.2f}")
            for kind in KINDS
        ],
        ("weights per GPU, bf16 (GiB)", lambda r: f"{r['weights_bf16_gib']:.2f}"),
        (f"HBM left for KV, FP8 (GiB){room}", lambda r: f"{r['kv_room_fp8_gib']:.2f}"),
        ("  bf16 (GiB)", lambda r: f"{r['kv_room_bf16_gib']:.2f}"),
        (
            f"fits an {hw['name'].split()[0]}: FP8 / bf16",
            lambda r: f"{_yes(r['fits_fp8'])} / {_yes(r['fits_bf16'])}",
        ),
        ("longest context (tokens)", lambda r: f"{r['max_context_tokens']:,}"),
        ("  limited by", lambda r: r["max_context_limited_by"]),
        (f"concurrency at {ctx} (requests)", lambda r: f"{r['concurrency']:,}"),
        ("sparse-MLA FLOP/B, prefill", lambda r: f"{r['flop_per_byte_prefill']:.1f}"),
        ("sparse-MLA FLOP/B, decode", lambda r: f"{r['flop_per_byte_decode']:.1f}"),
        ("indexer FLOPs pass MLA at (tokens)", lambda r: f"{r['indexer_crossover_tokens']:,}"),
        (
            f"PCP gather, {chunk} chunk (MB/layer)",
            lambda r: f"{r['pcp_allgather_mb_per_layer']:.2f}",
        ),
        ("  all layers (ms)", lambda r: f"{r['pcp_allgather_ms_per_chunk']:.3f}"),
        (
            f"DCP prefill copy at {ctx} (MB/layer)",
            lambda r: f"{r['dcp_prefill_allgather_mb_per_layer']:.1f}",
        ),
        (
            "  all layers, per chunk (ms)",
            lambda r: f"{r['dcp_prefill_allgather_ms_per_chunk']:.2f}",
        ),
        (
            f"DCP decode, {queries} queries (MB/layer)",
            lambda r: f"{r['dcp_decode_mb_per_layer']:.2f}",
        ),
        ("  all layers, per step (ms)", lambda r: f"{r['dcp_decode_ms_per_step']:.3f}"),
    ]
    width = max(len(label) for label, _ in spec) + 1
    cells = [[r["layout"]] + [fmt(r) for _, fmt in spec] for r in rows_in]
    cols = [max(len(c) for c in col) + 2 for col in cells]
    for i, label in enumerate([""] + [label for label, _ in spec]):
        lines.append(
            label.ljust(width) + "".join(c[i].rjust(w) for c, w in zip(cells, cols, strict=True))
        )
    lines.append("")
    lines.append(
        "(per GPU; gathers = bytes each rank receives per full layer, times = bandwidth only at "
        f"{link}; formulas in vllm/plan.py and docs/plan.md)"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        plan = _build(args)
    except KeyError as e:
        print(f"vllm plan: error: config.json lacks required field {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"vllm plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=2) if args.json else format_table(plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _fill_parser(argparse.ArgumentParser(prog="vllm plan", description=DESCRIPTION))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
