"""Serving benchmarks behind `vllm bench`.

- `serve.py`: `vllm bench serve`, a single-turn random/fixed-length load with upstream vLLM's
  metric names (our own stdlib HTTP client).
- `agentic/`: `vllm bench agentic`, the AgentX agentic benchmark: a weka_trace synthesiser, a sweep
  over server configurations and concurrency levels driven by the real AgentX harness
  (`agentx profile`), and the per-level results (JSON, CSV, Pareto PNG).

Kernel micro-benchmarks live in the repository's `benchmarks/kernels/`, not here.
"""

from __future__ import annotations


class BenchmarkError(Exception):
    """A user mistake or an environment problem, reported as one line without a traceback."""
