#!/usr/bin/env bash
# Hybrid HiSparse decode at 1M-token context (SPEC §6, docs/hisparse.md) on one 8-GPU H200 node:
# the seed's decode engine, 8 DP ranks sharing EP8, each with a pinned host pool for the KV.
#
#   bash examples/serve_hisparse_long_context.sh /models/GLM-5.3-FP8 [extra vllm serve flags]
#   HOST_POOL_GIB=48 bash examples/serve_hisparse_long_context.sh ...   # the seed's pool size
#
# - hisparse_config.host_pool_gib: pinned host memory per rank for the MLA rows (fp8_ds_mla,
#   656 B per token per layer) and a host copy of the indexer keys. GLM-5.3 needs 54,728 B per
#   token in all, 53.4 GiB for one 1,048,576-token request: the default 64 GiB per rank holds one
#   such request per rank (8 × 64 = 512 GiB of host memory on the node). The GPU keeps the recent
#   tail, the indexer keys and a 4,096-row hot buffer per request; misses are copied from the host.
# - Concurrency at long context is then bounded by host memory, not HBM.
# - HiSparse is a decode-side feature for TP/DP/EP layouts: this engine refuses it together with
#   -pcp or -dcp > 1 (vllm/config/vllm_config.py), so long prompts are prefilled elsewhere
#   (examples/serve_pcp_dcp_ep.sh) or chunk by chunk here.
set -euo pipefail

MODEL="${1:?usage: $0 MODEL_PATH [extra vllm serve flags]}"
shift
HOST_POOL_GIB="${HOST_POOL_GIB:-64}"

exec vllm serve "$MODEL" \
    --data-parallel-size 8 \
    --enable-expert-parallel \
    --kv-cache-dtype fp8_ds_mla \
    --max-model-len 1048576 \
    --attention-config "{\"hisparse_config\": {\"host_pool_gib\": ${HOST_POOL_GIB}}}" \
    --host 0.0.0.0 --port "${PORT:-8000}" \
    "$@"
