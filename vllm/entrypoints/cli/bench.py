"""`vllm bench {serve,agentic}`: serving benchmarks (code in `vllm/benchmarks/`)."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="serving benchmarks", description="Serving benchmarks.")
    bench_sub = p.add_subparsers(dest="bench_command", metavar="{serve,agentic}")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    s = bench_sub.add_parser(
        "serve",
        help="single-turn random/fixed-length load against a running server",
        description="Single-turn load against a running OpenAI-compatible server; upstream vLLM's "
        "metric names (request_throughput, mean_ttft_ms, p99_tpot_ms, ...).",
    )
    from vllm.benchmarks import serve

    serve.add_cli_args(s)
    s.set_defaults(func=lambda args: _run(serve.main, args))

    a = bench_sub.add_parser(
        "agentic",
        help="AgentX agentic benchmark: server configurations x concurrency levels",
        description="Sweep server configurations over concurrency levels with the AgentX harness "
        "(agentx profile); writes results.json, results.csv and pareto.png.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from vllm.benchmarks.agentic import sweep

    sweep.add_cli_args(a)
    a.set_defaults(func=lambda args: _run(sweep.main, args))


def _run(fn, args) -> int:
    from vllm.benchmarks import BenchmarkError

    try:
        return fn(args)
    except BenchmarkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
