#!/usr/bin/env bash
# The seed's prefill engine (SPEC §1) on one 8-GPU H200 node: PCP8 × DCP8 × EP8.
#
#   bash examples/serve_pcp_dcp_ep.sh /models/GLM-5.3-FP8 [extra vllm serve flags]
#
# - PCP8 (-pcp 8): each prompt's queries are cut into 16 chunks; rank r takes chunks r and 15-r,
#   so causal work balances. Attention weights are replicated on the 8 ranks.
# - DCP8 (-dcp 8): the persistent KV cache is split by token, round-robin, over the same 8 ranks
#   (DCP adds no ranks). One token in eight per GPU: a 1M-token request needs 6.7 GiB per GPU.
# - EP8 (--enable-expert-parallel): the routed experts are split over the 8 ranks.
# - fp8_ds_mla: 656-byte MLA rows + 132-byte FP8 indexer keys per token and layer.
# - sparse_mla_force_mqa: every prefill stays on the sparse MQA kernel.
# --max-model-len defaults to min(max_position_embeddings, 1M) = 1,048,576 for GLM-5.3.
# The seed also ran MTP3 (--speculative-config) and 512 GiB of CPU KV offload
# (--kv-offloading-size); this engine refuses both at start-up until they land (docs/flags.md).
set -euo pipefail

MODEL="${1:?usage: $0 MODEL_PATH [extra vllm serve flags]}"
shift

exec vllm serve "$MODEL" \
    --prefill-context-parallel-size 8 \
    --decode-context-parallel-size 8 \
    --dcp-comm-backend ag_rs \
    --enable-expert-parallel \
    --kv-cache-dtype fp8_ds_mla \
    --attention-config '{"sparse_mla_force_mqa": true}' \
    --host 0.0.0.0 --port "${PORT:-8000}" \
    "$@"
