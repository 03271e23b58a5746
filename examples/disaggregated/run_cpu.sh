#!/usr/bin/env bash
# P/D disaggregation on one machine (CPU): vllm-router in P/D mode, a prefill engine and a
# decode engine joined by NIXL over UCX loopback, then one completion through the router.
#
#   bash examples/disaggregated/run_cpu.sh [MODEL]     (default: the built-in tiny checkpoint)
#
# Needs: pip install vllm-router; pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1
# Extra flags for the prefill / decode engines: PREFILL_ARGS / DECODE_ARGS, e.g.
#   PREFILL_ARGS="-pcp 2 -dcp 2" DECODE_ARGS="-dcp 2" bash examples/disaggregated/run_cpu.sh
# Ctrl-C (or the end of the script) stops all three.
set -euo pipefail

MODEL="${1:-}"
if [ -z "$MODEL" ]; then
    MODEL="$(mktemp -d)/tiny-glm"
    python -c "from vllm.model_executor.tiny import write_tiny_checkpoint as w; w('$MODEL')"
fi
P_PORT="${P_PORT:-8100}"; D_PORT="${D_PORT:-8200}"; R_PORT="${R_PORT:-8000}"
LOGS="${LOGS:-$(mktemp -d)}"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -INT "$p" 2>/dev/null || true; done; wait; }
trap cleanup EXIT
wait_healthy() {  # port, pid, log
    until curl -sf "localhost:$1/health" >/dev/null; do
        kill -0 "$2" 2>/dev/null || { echo "failed to start, see $3" >&2; tail -n 20 "$3" >&2; exit 1; }
        sleep 1
    done
}

# kv_producer: finishes a request after its prefill (max_tokens 1) and leases its blocks until
# the decode engine has pulled them; side channel (ZMQ handshake) on ports 5600 + rank
vllm serve "$MODEL" --port "$P_PORT" ${PREFILL_ARGS:-} --kv-transfer-config \
    '{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "side_channel_port": 5600}' \
    >"$LOGS/prefill.log" 2>&1 &
PIDS+=($!)
# kv_consumer: pulls the prompt's KV with NIXL READs (only the rows each rank owns), then decodes
vllm serve "$MODEL" --port "$D_PORT" ${DECODE_ARGS:-} --kv-transfer-config \
    '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"}' \
    >"$LOGS/decode.log" 2>&1 &
PIDS+=($!)
wait_healthy "$P_PORT" "${PIDS[0]}" "$LOGS/prefill.log"
wait_healthy "$D_PORT" "${PIDS[1]}" "$LOGS/decode.log"
# the router sends the prefill engine the request with max_tokens 1 and kv_transfer_params
# {"do_remote_decode": true}, then the decode engine the original request with the
# kv_transfer_params the prefill response returned
vllm-router --vllm-pd-disaggregation --prefill "http://127.0.0.1:$P_PORT" \
    --decode "http://127.0.0.1:$D_PORT" --port "$R_PORT" --prometheus-port "${R_METRICS_PORT:-29000}" \
    --worker-startup-check-interval 1 >"$LOGS/router.log" 2>&1 &
PIDS+=($!)
wait_healthy "$R_PORT" "${PIDS[2]}" "$LOGS/router.log"
echo "router on http://127.0.0.1:$R_PORT (logs in $LOGS)"

NAME="$(curl -s "localhost:$D_PORT/v1/models" | python -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')"
curl -s "localhost:$R_PORT/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$NAME\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16, \"temperature\": 0}"
echo
curl -s "localhost:$D_PORT/metrics" | grep -E '^vllm:kv_transfer_(recv_bytes|num_loads)_total'
if [ -n "${KEEP:-}" ]; then echo "serving; Ctrl-C stops"; wait; fi
