"""Where a HiSparse decode step's time goes (torch profiler, CUDA time per op), B=64, 32K context.

    python benchmarks/hisparse/profile_resolver.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.hisparse.bench_hisparse import Setup  # noqa: E402
from vllm.attention.kv_cache import KVCacheLayout  # noqa: E402
from vllm.config.arch import GLM_5_3, ModelArch  # noqa: E402


def main() -> int:
    dev = torch.device("cuda")
    layout = KVCacheLayout.from_arch(ModelArch.from_dict(GLM_5_3), "fp8_ds_mla", torch.bfloat16)
    s = Setup(64, 32768, dev, layout)
    for _ in range(5):
        s.advance(0.9)
        s.attend_hisparse()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            s.advance(0.9)
            s.attend_hisparse()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
