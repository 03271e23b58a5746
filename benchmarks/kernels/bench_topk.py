"""Top-k selection (k = 2048) over indexer logits: decode rows (64 queries × 128K / 1M
candidates) and a prefill chunk (8192 queries, causal limits, 32K–128K context). Memory-bound
(the eligible logits are read once); the floor compares it with the logits kernel of the same
shape, timed in the same run: top-k must take ≤ 30 % of the logits time (aim ≤ 15 %).

A row's time is the GPU's per call (the op's four launches captured in a CUDA graph and
replayed; the eager per-call time is in the note). Each row's note gives the ratio, the
per-stage times (pivot sample, streaming collect pass, per-row finish; differences of cumulative
eager timings) and the compiler's report for each kernel.
``--sweep`` then times the tuning knobs one at a time around the defaults."""

from __future__ import annotations

import torch

from benchmarks.kernels.bench_indexer_logits import prefill_inputs
from benchmarks.kernels.common import (
    dump_json,
    measure_peaks,
    parser,
    print_rows,
    row,
    scaled_ref_ms,
    time_ms,
    time_ms_graph,
)
from vllm.kernels.indexer import indexer_logits_paged_cost, topk_cost, topk_ref
from vllm.kernels.triton.indexer_logits import indexer_logits
from vllm.kernels.triton.topk import indexer_topk, topk_stages
from vllm.kernels.triton.utils import resource_report

TOPK = 2048
SHAPES = [(64, 131072, False), (64, 1 << 20, False), (8192, 32768, True), (8192, 131072, True)]
KERNELS = ("topk_pivot", "topk", "topk_select", "topk_fallback")
# knobs around the defaults (collect: chunk 4096, 8 warps, up to 32 rows per program, no
# prefetch, 64 registers; select: 4 warps, 4096 keys in registers; pivot sample: runs of 8
# adjacent scores, one score per 32 columns, 2-16 warps by sample size, z 5; cap 8192; `collect_maxnreg=None, prefetch=True` is the previous
# collect: 121 registers, next row prefetched), on every shape but the 1M-candidate rows (``--prefill-only``: the causal shapes)
SWEEP = [
    dict(sample_run=1),  # one score per sampled sector (stride 32 up to 64K columns, 64 beyond)
    dict(sample_stride=16),
    dict(pivot_warps=1),
    dict(pivot_warps=4),
    dict(z=6.0),
    dict(rows_per_program=16),
    dict(collect_maxnreg=None, prefetch=True),
    dict(select_regs=16),
    dict(select_regs=64),
    dict(select_warps=8),
]


def inputs(t, s, causal):
    """(logits, limit, logits_ms): the logits kernel's output and time for prefill shapes; random
    decode rows, whose logits time is the paged-key bytes over the measured copy bandwidth."""
    if causal:
        q, qs, w, k, ks = prefill_inputs(t, s)
        logits = indexer_logits(q, qs, w, k, ks)
        logit_ms = time_ms(lambda: indexer_logits(q, qs, w, k, ks))
        return logits, torch.arange(s - t + 1, s + 1, device="cuda"), logit_ms
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(t, s, device="cuda", generator=g)
    _, kb = indexer_logits_paged_cost(t, s)
    return logits, torch.full((t,), s, device="cuda"), kb / (measure_peaks().copy_tbps * 1e12) * 1e3


def bench(t, s, causal, data, kw=None, ref_ms=None):
    """One row: the whole top-k, checked against the reference set on every row; the per-stage
    times (pivot sample, streaming collect pass, select + fallback: differences of cumulative
    timings), the candidate counts and the compiler's report per kernel."""
    logits, limit, logit_ms, ref_set = data
    kw = kw or {}
    got, (pivot, collect, finish), count = topk_stages(logits, limit, TOPK, **kw)
    pivot(), collect(), finish()
    ok = torch.equal(got.sort(1).values, ref_set)
    live = limit.clamp(max=s) > TOPK
    cap = kw.get("cap", 4 * TOPK)
    cnt = count[live].float()
    n_fallback = int(((count < TOPK) | (count > cap))[live].sum())
    fn = lambda: indexer_topk(logits, limit, TOPK, **kw)  # noqa: E731
    eager_ms = time_ms(fn, rep_ms=200 if not kw else 100)
    # the op is four launches: timed eagerly, a 0.1-ms decode row measures the host's launches
    ms = time_ms_graph(fn, launches=5, rep_ms=200 if not kw else 100)
    note = f"{ms / logit_ms:.1%} of logits ({logit_ms:.3f} ms{'' if causal else ' at copy BW'})"
    note += f" graph replay; eager {eager_ms:.3f} ms"
    note += f" cand mean {cnt.mean():.0f} max {cnt.max():.0f} fallback rows {n_fallback}"
    note += "" if ok else " MISMATCH"
    t_pivot = time_ms(pivot, rep_ms=100)
    t_collect = time_ms(lambda: (pivot(), collect()), rep_ms=100)
    note += (
        f" stages pivot/collect/finish {t_pivot:.3f}/{t_collect - t_pivot:.3f}/{ms - t_collect:.3f}"
    )
    if kw:
        note += " " + " ".join(f"{a}={b}" for a, b in kw.items())
        note += f" | collect {resource_report('topk')} | select {resource_report('topk_select')}"
    else:
        note += " | " + " | ".join(f"{n}: {resource_report(n)}" for n in KERNELS)
    if ref_ms is None:
        n = min(t, 64)
        ref_ms = scaled_ref_ms(lambda: topk_ref(logits[:n], limit[:n], TOPK), n, t)
    flops, nbytes = topk_cost(t, s, TOPK, causal)
    shape = f"T={t} S={s} k=2048{' causal' if causal else ''}"
    return row("topk" if not kw else "topk sweep", shape, ms, flops, nbytes, "fp8", ref_ms, note)


def main():
    ap = parser(__doc__)
    ap.add_argument("--prefill-only", action="store_true", help="only the causal prefill shapes")
    args = ap.parse_args()
    shapes = SHAPES[::2] if args.quick else SHAPES
    shapes = [sh for sh in shapes if sh[2]] if args.prefill_only else shapes
    rows = []
    for sh in shapes:
        logits, limit, logit_ms = inputs(*sh)
        data = logits, limit, logit_ms, topk_ref(logits, limit, TOPK).sort(1).values
        rows.append(bench(*sh, data))
        print_rows(rows[-1:])
        if args.sweep and sh[1] < 1 << 20:
            for kw in SWEEP:
                rows.append(bench(*sh, data, kw, ref_ms=rows[-1]["ref_ms"]))
                print_rows(rows[-1:])
        del data, logits
        torch.cuda.empty_cache()
    print("\n# summary")
    print_rows([r for r in rows if r["op"] == "topk"])
    dump_json(rows, args.json)


if __name__ == "__main__":
    main()
