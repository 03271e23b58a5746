"""Per-level results of an agentic sweep, and the files they are written to.

Definitions (SPEC §9):
- throughput_per_gpu: logical tokens per second per GPU, (input + output tokens) of the profiled
  requests over the profiled wall time (first request start to last request end) over the GPU
  count. Input tokens count cached ones: it is the work the user sees, not the work computed.
- interactivity: per request, output tokens over its end-to-end latency (TTFT included), in
  tok/s/user. `interactivity_p90` is the 90th percentile over requests (the harness's percentile
  convention); `interactivity_p10` is the slowest decile, for readers who want the tail.
- TTFT and ITL: the harness's per-request time_to_first_token and inter_token_latency.
- prefix_cache_hit_rate: hits over queries from the server's /metrics (vllm:prefix_cache_*_total),
  scraped before and after the harness ran (warm-up included); `prefix_cache_hit_rate_profiling`
  is the same ratio over the profiling phase alone, from the harness's own /metrics scrapes.
- external_prefix_cache_hit_rate: the same for a KV connector's cache (the CPU offload tier,
  vllm:external_prefix_cache_*_total): tokens found there after the device prefix cache's hit, over
  the tokens of the requests that looked; `total_prefix_hit_rate` is device plus host hits over
  the device cache's queries (the share of prompt tokens not recomputed).
"""

from __future__ import annotations

import csv
import json
import math
import os

FIELDS = (
    "config",
    "concurrency",
    "num_gpus",
    "status",
    "message",
    "requests",
    "errors",
    "error_rate",
    "duration_s",
    "input_tokens",
    "cached_input_tokens",
    "output_tokens",
    "throughput_per_gpu",
    "output_throughput_per_gpu",
    "request_throughput",
    "interactivity_p90",
    "interactivity_median",
    "interactivity_p10",
    "ttft_median_ms",
    "ttft_p90_ms",
    "itl_mean_ms",
    "itl_median_ms",
    "itl_p90_ms",
    "e2e_median_ms",
    "e2e_p90_ms",
    "prefix_cache_hit_rate",
    "prefix_cache_hit_rate_profiling",
    "external_prefix_cache_hit_rate",
    "total_prefix_hit_rate",
    "server_prompt_tokens",
    "server_generation_tokens",
    "server_startup_s",
    "artifact_dir",
)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _value(rec: dict, *names: str) -> float | None:
    metrics = rec.get("metrics", {})
    for n in names:
        m = metrics.get(n)
        if isinstance(m, dict) and isinstance(m.get("value"), (int, float)):
            return float(m["value"])
    return None


def _delta(before: dict, after: dict, name: str) -> float | None:
    # A labelled counter appears only once incremented: absent is 0 on a server that answered.
    if not after:
        return None
    return after.get(name, 0.0) - before.get(name, 0.0)


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def level_metrics(
    records: list[dict],
    before: dict[str, float],
    after: dict[str, float],
    profiling_counters: dict[str, float],
    num_gpus: int,
) -> dict:
    """The metrics of one level from the harness's profiling records and /metrics scrapes."""
    ok = [r for r in records if not r.get("error")]
    starts = [r["metadata"].get("request_start_ns") for r in records]
    ends = [r["metadata"].get("request_end_ns") for r in records]
    starts = [s for s in starts if s is not None]
    ends = [e for e in ends if e is not None]
    duration = (max(ends) - min(starts)) / 1e9 if starts and ends else 0.0

    in_tok = sum(_value(r, "usage_prompt_tokens", "input_sequence_length") or 0 for r in ok)
    out_tok = sum(
        _value(r, "usage_completion_tokens", "output_sequence_length", "output_token_count") or 0
        for r in ok
    )
    cached = sum(_value(r, "usage_prompt_cache_read_tokens") or 0 for r in ok)
    interactivity = []
    for r in ok:
        out = _value(r, "usage_completion_tokens", "output_sequence_length", "output_token_count")
        lat = _value(r, "request_latency")
        if out and lat:
            interactivity.append(out / (lat / 1000.0))
    ttft = [v for r in ok if (v := _value(r, "time_to_first_token")) is not None]
    itl = [v for r in ok if (v := _value(r, "inter_token_latency")) is not None]
    e2e = [v for r in ok if (v := _value(r, "request_latency")) is not None]

    per_s = 1.0 / duration if duration > 0 else 0.0
    q = _delta(before, after, "vllm:prefix_cache_queries_total")
    h = _delta(before, after, "vllm:prefix_cache_hits_total")
    xq = _delta(before, after, "vllm:external_prefix_cache_queries_total")
    xh = _delta(before, after, "vllm:external_prefix_cache_hits_total")
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_rate": (len(records) - len(ok)) / len(records) if records else None,
        "duration_s": duration,
        "input_tokens": int(in_tok),
        "cached_input_tokens": int(cached),
        "output_tokens": int(out_tok),
        "throughput_per_gpu": (in_tok + out_tok) * per_s / num_gpus,
        "output_throughput_per_gpu": out_tok * per_s / num_gpus,
        "request_throughput": len(ok) * per_s,
        "interactivity_p90": percentile(interactivity, 90),
        "interactivity_median": percentile(interactivity, 50),
        "interactivity_p10": percentile(interactivity, 10),
        "ttft_median_ms": percentile(ttft, 50),
        "ttft_p90_ms": percentile(ttft, 90),
        "itl_mean_ms": sum(itl) / len(itl) if itl else None,
        "itl_median_ms": percentile(itl, 50),
        "itl_p90_ms": percentile(itl, 90),
        "e2e_median_ms": percentile(e2e, 50),
        "e2e_p90_ms": percentile(e2e, 90),
        "prefix_cache_hit_rate": _ratio(h, q),
        "prefix_cache_hit_rate_profiling": _ratio(
            profiling_counters.get("vllm:prefix_cache_hits"),
            profiling_counters.get("vllm:prefix_cache_queries"),
        ),
        "external_prefix_cache_hit_rate": _ratio(xh, xq),
        "total_prefix_hit_rate": _ratio((h or 0) + (xh or 0), q) if h is not None else None,
        "server_prompt_tokens": _delta(before, after, "vllm:prompt_tokens_total"),
        "server_generation_tokens": _delta(before, after, "vllm:generation_tokens_total"),
    }


def write_json(path: str, meta: dict, rows: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=2)
    os.replace(tmp, path)


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: _csv_cell(row.get(k)) for k in FIELDS})


def _csv_cell(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def plot_pareto(path: str, rows: list[dict], title: str) -> bool:
    """Throughput per GPU against P90 interactivity, one line per configuration.
    Returns False (and writes nothing) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 5), dpi=120)
    configs = list(dict.fromkeys(r["config"] for r in rows))
    plotted = False
    for name in configs:
        pts = sorted(
            (r["interactivity_p90"], r["throughput_per_gpu"], r["concurrency"])
            for r in rows
            if r["config"] == name
            and r.get("interactivity_p90") is not None
            and r.get("throughput_per_gpu")
        )
        if not pts:
            continue
        xs, ys, cs = zip(*pts, strict=False)
        ax.plot(xs, ys, marker="o", label=name)
        plotted = True
        for x, y, c in pts:
            ax.annotate(f"c{c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("interactivity, P90 over requests (output tok/s/user, end to end)")
    ax.set_ylabel("logical throughput (input + output tok/s) per GPU")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    if plotted:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no level completed", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
