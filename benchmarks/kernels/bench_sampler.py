"""The sampler's per-step kernels at the model's vocabulary (V = 154,880): top-k / top-p
filtering (the Triton kernel against the stable sort of ``top_k_top_p_ref``, the old path) and
Gumbel-max sampling (the fused kernel against the [B, V] uniforms of ``gumbel_sample_ref``), at
B = 1, 64, 256, for top-p 0.95 with and without top-k 50, on peaked (LLM-like) and flat logits.

Kernels are timed as CUDA-graph replays (the decode step runs as a graph), the references
eagerly (milliseconds: launch overhead is noise there). TB/s counts the kernel's bytes (the
row read twice and written once for top-k / top-p, read once for sampling) against the copy
bandwidth measured in this process; the floor is 0.5 ms at B = 256 (aim 0.2 ms). Each row's
note gives the kernel's path statistics: mean refinement passes, mean / max list size, rows
that fell back to the dense select. ``--sweep`` times a few tuning variants at B = 256.

    PYTHONPATH=. python3 benchmarks/kernels/bench_sampler.py [--vocab V] [--quick] [--json F]

Without CUDA it runs the Triton interpreter at a tiny size (``--vocab 2000``, B <= 8): a smoke
run of the script, not a measurement.
"""

from __future__ import annotations

import os
import time

import torch

if not torch.cuda.is_available():  # before Triton is imported: the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.kernels.common import dump_json, parser, print_rows, row, time_ms, time_ms_graph
from vllm.kernels.sampling import (
    gumbel_sample_cost,
    gumbel_sample_ref,
    top_k_top_p_cost,
    top_k_top_p_ref,
)

V_GLM = 154880
BATCHES = (1, 64, 256)
CONFIGS = (("p0.95", None, 0.95), ("p0.95+k50", 50, 0.95))
SWEEP = [dict(block=4096), dict(num_warps=4, block=1024, tile=512), dict(cap=2048),
         dict(num_bins=32, bins_per_unit=1)]  # fmt: skip


def logits(b, v, kind, device, seed=0):
    """Peaked: a few dozen tokens 8-11 units above N(0, 2) (an LLM's next-token logits at
    temperature 1); flat: N(0, 1) (a high temperature: top-p 0.95 keeps most of the row)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(b, v, device=device, generator=g)
    if kind == "peaked":
        x *= 2.0
        top = torch.randint(0, v, (b, 30), device=device, generator=g)
        x.scatter_add_(1, top, 8 + 3 * torch.rand(b, 30, device=device, generator=g))
    return x


def _stats_note(stats: torch.Tensor) -> str:
    s = stats.float()
    return (f"refine {s[:, 0].mean():.2f} list mean {s[:, 1].mean():.0f} max "
            f"{int(s[:, 1].max())} dense {int(s[:, 2].sum())}")  # fmt: skip


def bench_filter(x, b, v, kind, name, k, p, sweep):
    """Rows for top_k_top_p on x: the graph-replayed kernel against the eager sort."""
    from vllm.kernels.triton.top_k_top_p import top_k_top_p

    top_k = torch.full((b,), k, device="cuda") if k else None
    top_p = torch.full((b,), p, device="cuda")
    stats = torch.zeros(b, 3, dtype=torch.int32, device="cuda")
    got = top_k_top_p(x, top_k, top_p, stats=stats)
    agree = (got.isinf() == top_k_top_p_ref(x, top_k, top_p).isinf()).float().mean().item()
    ms = time_ms_graph(lambda: top_k_top_p(x, top_k, top_p), launches=10)
    ref_ms = time_ms(lambda: top_k_top_p_ref(x, top_k, top_p), rep_ms=100)
    flops, nbytes = top_k_top_p_cost(b, v)
    shape = f"B={b} V={v} {name}"
    note = f"{kind} {_stats_note(stats)} agree {agree:.6f}"
    out = [row("top_k_top_p", shape, ms, flops, nbytes, "bf16", ref_ms, note)]
    for kw in SWEEP if sweep else ():
        ms_kw = time_ms_graph(lambda kw=kw: top_k_top_p(x, top_k, top_p, **kw), launches=10)
        note = f"{kind} " + " ".join(f"{a}={c}" for a, c in kw.items())
        out.append(row("top_k_top_p sweep", shape, ms_kw, flops, nbytes, "bf16", ref_ms, note))
    return out


def bench_sample(x, b, v, kind, name):
    """A row for gumbel_sample on x: the graph-replayed kernel against the eager formula."""
    from vllm.kernels.triton.gumbel import gumbel_sample

    temp = torch.ones(b, device="cuda")
    seeds = torch.arange(b, device="cuda") * 7919
    pos = torch.full((b,), 1000, device="cuda")
    same = torch.equal(gumbel_sample(x, temp, seeds, pos), gumbel_sample_ref(x, temp, seeds, pos))
    ms = time_ms_graph(lambda: gumbel_sample(x, temp, seeds, pos), launches=10)
    ref_ms = time_ms(lambda: gumbel_sample_ref(x, temp, seeds, pos), rep_ms=100)
    flops, nbytes = gumbel_sample_cost(b, v)
    note = f"{kind} same tokens {same}"
    return row("gumbel_sample", f"B={b} V={v} {name}", ms, flops, nbytes, "bf16", ref_ms, note)


def bench_cuda(args, shapes):
    from vllm.kernels.triton.top_k_top_p import top_k_top_p

    v, rows = args.vocab, []
    for kind in ("peaked", "flat"):
        for b in shapes:
            x = logits(b, v, kind, "cuda")
            for name, k, p in CONFIGS:
                sweep = args.sweep and b == max(shapes) and kind == "flat"
                rows += bench_filter(x, b, v, kind, name, k, p, sweep)
                print_rows(rows[-1 - (len(SWEEP) if sweep else 0) :])
            # sampling from raw rows and from rows filtered by top-p 0.95
            rows.append(bench_sample(x, b, v, kind, "raw"))
            filt = top_k_top_p(x, None, torch.full((b,), 0.95, device="cuda"))
            rows.append(bench_sample(filt, b, v, kind, "after p0.95"))
            print_rows(rows[-2:])
            torch.cuda.empty_cache()
    return rows


def bench_cpu(args):
    """The interpreter at a tiny size: the script's smoke run (no peaks, wall-clock times)."""
    from tests.kernels.conftest import _numpy_index_shim
    from vllm.kernels.triton.gumbel import gumbel_sample
    from vllm.kernels.triton.top_k_top_p import top_k_top_p

    _numpy_index_shim()  # Triton 3.6's interpreter under NumPy >= 2.4
    v = args.vocab
    print(f"# no CUDA: Triton interpreter, V={v}; times are the interpreter's, not a measurement")
    print(f"{'op':<14}{'shape':<28}{'ms':>10}{'ref ms':>10}  note")
    for b in (1, 4):
        x = logits(b, v, "peaked", "cpu")
        for name, k, p in CONFIGS:
            top_k = torch.full((b,), k) if k else None
            top_p = torch.full((b,), p)
            stats = torch.zeros(b, 3, dtype=torch.int32)
            t0 = time.perf_counter()
            got = top_k_top_p(x, top_k, top_p, stats=stats, block=1024, tile=512)
            ms = (time.perf_counter() - t0) * 1e3
            t0 = time.perf_counter()
            ref = top_k_top_p_ref(x, top_k, top_p)
            ref_ms = (time.perf_counter() - t0) * 1e3
            agree = bool((got.isinf() == ref.isinf()).all())
            print(f"{'top_k_top_p':<14}{f'B={b} {name}':<28}{ms:>10.1f}{ref_ms:>10.2f}  "
                  f"{_stats_note(stats)} agree {agree}")  # fmt: skip
        temp, seeds, pos = torch.ones(b), torch.arange(b), torch.zeros(b, dtype=torch.int64)
        t0 = time.perf_counter()
        same = torch.equal(gumbel_sample(x, temp, seeds, pos, chunk=1024, block=512),
                           gumbel_sample_ref(x, temp, seeds, pos))  # fmt: skip
        ms = (time.perf_counter() - t0) * 1e3
        print(f"{'gumbel_sample':<14}{f'B={b} raw':<28}{ms:>10.1f}{'':>10}  same tokens {same}")


def main():
    ap = parser(__doc__)
    ap.add_argument("--vocab", type=int, default=None, help=f"vocabulary (default {V_GLM})")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        args.vocab = args.vocab or 2000
        bench_cpu(args)
        return
    args.vocab = args.vocab or V_GLM
    shapes = (1, 256) if args.quick else BATCHES
    rows = bench_cuda(args, shapes)
    print("\n# summary (floor: top_k_top_p <= 0.5 ms at B=256, aim 0.2 ms)")
    print_rows([r for r in rows if "sweep" not in r["op"]])
    dump_json(rows, args.json)


if __name__ == "__main__":
    main()
