#!/usr/bin/env bash
# The CPU sweep recorded in BENCHMARKS.md: the built-in tiny GLM-5.3 checkpoint, plain serving
# against PCP2 x DCP2 + EP, concurrency 1-8, the `cpu` session shape (AgentX's turn counts with
# 1/16 of its input tokens, 1/8 of its output, 1/10 of its think times), 60 s per level.
#   benchmarks/agentic/cpu_sweep.sh [OUTPUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-agentic-results/cpu-$(date -u +%Y%m%d-%H%M%S)}"
bash benchmarks/agentic/install_agentx.sh
exec vllm bench agentic \
  --config plain='vllm serve' \
  --config pcp2dcp2='vllm serve -pcp 2 -dcp 2 --dcp-comm-backend ag_rs --enable-expert-parallel' \
  --shape cpu --sessions 16 --seed 0 \
  --concurrency 1,2,4,8 --duration 60 --warmup-requests-per-lane 3 \
  --output-dir "$OUT"
