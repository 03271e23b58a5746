"""Where a HiSparse decode step's time goes (torch profiler), B=64, 32K context, 90 % hits.

    python benchmarks/hisparse/profile_resolver.py [--dense] [--trace out.json]

Prints CUDA time per kernel over 5 group steps, and the wall time of each mode's step (HBM and
HiSparse) with the host time spent launching it, so launch-bound and GPU-bound steps can be told
apart. --dense adds each layer's GLM-5.3 non-attention work (see bench_hisparse.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.hisparse.bench_hisparse import DenseLayer, Setup  # noqa: E402
from vllm.config.arch import GLM_5_3, ModelArch  # noqa: E402
from vllm.kv_cache_interface import KVCacheLayout  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dense", action="store_true")
    ap.add_argument("--trace", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    layout = KVCacheLayout.from_arch(ModelArch.from_dict(GLM_5_3), "fp8_ds_mla", torch.bfloat16)
    s = Setup(64, 32768, dev, layout)
    if args.dense:
        s.dense = DenseLayer(64, dev)
    for mode in ("hbm", "hisparse"):
        positions = s.draw(0.9, 10)
        for p in positions[:5]:
            s.pos = p
            s.group_hbm(args.dense) if mode == "hbm" else s.group_hisparse(args.dense)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for p in positions[5:]:
            s.pos = p
            s.group_hbm(args.dense) if mode == "hbm" else s.group_hisparse(args.dense)
        t_host = (time.perf_counter() - t0) / 5 * 1e3
        torch.cuda.synchronize()
        t_wall = (time.perf_counter() - t0) / 5 * 1e3
        print(f"{mode}: {t_wall:.3f} ms per group step, host launch time {t_host:.3f} ms")
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for p in s.draw(0.9, 5):
            s.pos = p
            s.group_hisparse(args.dense)
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    )
    if args.trace:
        prof.export_chrome_trace(args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
