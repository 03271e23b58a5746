"""Tile/partition sweep of the warp-specialised Gluon sparse-MLA kernel (sm_90) on the decode
(fp8_ds_mla and bf16 cache) and MQA-prefill shapes of bench_sparse_mla_decode/prefill, with the
Triton kernel timed in the same process as the baseline. Prints TFLOP/s and the fraction of the
bf16 matmul peak measured in the same run."""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.kernels.bench_sparse_mla_decode import make_inputs
from benchmarks.kernels.common import measure_peaks, time_ms, time_ms_graph
from vllm.kernels.sparse_mla_fwd import RowFormat, default_config, sparse_mla_flops, sparse_mla_fwd
from vllm.kernels.sparse_mla_ws import sparse_mla_ws


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--decode-t", default="64,1024")
    ap.add_argument("--fp8-rows", default="8,16,32")
    ap.add_argument("--producer-regs", default="56,88,120")
    ap.add_argument("--dequant", default="0,1", help="FP8 dequant variant(s), see sparse_mla_ws")
    ap.add_argument("--schedules", default="split,seesaw", help="consumer schedule(s)")
    ap.add_argument("--staged", default="0,1", help="FP8 rows staged through shared memory (0/1)")
    ap.add_argument(
        "--configs",
        default="",
        help="explicit FP8 configs dequant:regs:rows,... "
        "(instead of the product of the three lists)",
    )
    ap.add_argument(
        "--tunes",
        default="",
        help="other launch_config knobs for the FP8 configs: "
        "sets separated by ';', each k=v,... (integers), e.g. ';consumer_expand=1'",
    )
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (decode)")
    ap.add_argument("--prefill", default="8192x32768", help="TxS prefill shapes, comma-separated")
    args = ap.parse_args()
    peaks = measure_peaks()
    print(f"# peaks: copy {peaks.copy_tbps:.2f} TB/s, bf16 {peaks.bf16_tflops:.0f} TFLOP/s")
    print(f"{'case':<34}{'config':<34}{'ms':>9}{'TFLOP/s':>9}{'%peak':>7}{'vs triton':>10}")
    for t in [int(x) for x in args.decode_t.split(",")]:
        for cache_dtype in ("fp8_ds_mla", "auto"):
            layout, cache, slots, q = make_inputs(t, cache_dtype)
            fmt = RowFormat(512, 64, layout.is_fp8)
            rows = cache.view(-1, cache.shape[-1])
            cfg = default_config(t, 64, 2048, layout.is_fp8, q.device)
            flops = sparse_mla_flops(t, 64, 2048, 576, 512)
            base = (_time_graph if args.graph else _time)(
                sparse_mla_fwd, q, rows, fmt, slots, 0.06, torch.bfloat16, kernel="triton"
            )
            _print(f"decode {cache_dtype} T={t}", "triton", base, flops, peaks, base)
            if not layout.is_fp8:
                grid = [("0", "40", "16")]
            elif args.configs:
                grid = [c.split(":") for c in args.configs.split(",")]
            else:
                grid = itertools.product(args.dequant.split(","), args.producer_regs.split(","),
                                         args.fp8_rows.split(","))  # fmt: skip
            stg = args.staged.split(",") if layout.is_fp8 else ["0"]
            tunes = [dict((k, int(v) if v.isdigit() else v)
                          for k, v in (kv.split("=") for kv in ts.split(",") if kv))
                     for ts in (args.tunes.split(";") if layout.is_fp8 else [""])]  # fmt: skip
            timer = _time_graph if args.graph else _time
            for (dq, pr, fr), sch, sg, tune in itertools.product(
                list(grid), args.schedules.split(","), stg, tunes
            ):
                kw = dict(dequant=int(dq), producer_regs=int(pr), fp8_rows=int(fr), schedule=sch,
                          fp8_staged=sg == "1", **tune)  # fmt: skip
                try:
                    ms = timer(sparse_mla_ws, q, rows, layout.is_fp8, fmt.row_bytes, slots, 0.06,
                               torch.bfloat16, cfg.num_splits, **kw)  # fmt: skip
                except Exception as e:  # e.g. a partition over the register file: report it
                    print(f"  {kw}: {type(e).__name__}: {str(e)[:100]}")
                    continue
                _print(f"decode {cache_dtype} T={t}", f"ws {kw}", ms, flops, peaks, base)
            del cache
    for shape in filter(None, args.prefill.split(",")):
        t, s = (int(x) for x in shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(t, 64, 576, device="cuda", generator=g).to(torch.bfloat16)
        kv = torch.randn(s, 576, device="cuda", generator=g).to(torch.bfloat16)
        idx = torch.randint(0, s, (t, 2048), device="cuda", generator=g, dtype=torch.int32)
        fmt = RowFormat(512, 64, False)
        flops = sparse_mla_flops(t, 64, 2048, 576, 512)
        base = _time(sparse_mla_fwd, q, kv, fmt, idx, 0.04, torch.bfloat16, kernel="triton")
        _print(f"prefill T={t} S={s}", "triton", base, flops, peaks, base)
        for sch in args.schedules.split(","):
            ms = _time(
                sparse_mla_ws, q, kv, False, 1152, idx, 0.04, torch.bfloat16, 1, schedule=sch
            )
            _print(f"prefill T={t} S={s}", f"ws {sch}", ms, flops, peaks, base)


def _time(fn, *args, **kwargs) -> float:
    return time_ms(lambda: fn(*args, **kwargs))


def _time_graph(fn, *args, **kwargs) -> float:
    return time_ms_graph(lambda: fn(*args, **kwargs))


def _print(case, config, ms, flops, peaks, base):
    tf = flops / ms / 1e9
    print(f"{case:<34}{config:<34}{ms:>9.3f}{tf:>9.1f}{tf / peaks.bf16_tflops:>7.1%}"
          f"{base / ms:>10.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
