"""`vllm bench agentic`: the AgentX agentic serving benchmark (SPEC §9).

- `traces.py`: the weka_trace session synthesiser (AgentX's shape, every dimension scalable) and
  the Mooncake trace scaler.
- `server.py`: a named `vllm serve ...` configuration; start, /health, /metrics, stop.
- `harness.py`: the real AgentX harness (`agentx profile`) as a subprocess: where it is, its
  offline tokenizer layout, its command line, its per-request records.
- `results.py`: per-level metrics (throughput per GPU, interactivity, TTFT, ITL, cache hit rate)
  and the JSON / CSV / Pareto PNG outputs.
- `sweep.py`: the CLI: configurations x concurrency levels, progress, failures per level.

The load generator is the harness, not code of ours; nothing here sends benchmark traffic.
"""
