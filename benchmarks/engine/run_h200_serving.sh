#!/usr/bin/env bash
# One device call (~10 min on an H200): the GPU tests of the engine paths, the decode step (eager
# and graphs, compiles inside steps counted), the prefill/mixed step benchmark, then `vllm serve` + `vllm bench serve` (2K in / 128 out) on the GLM-5.3-shaped slice
# in the configurations BENCHMARKS.md §11 compares. Needs `vllm` on PATH and the engine's
# dependencies importable (on a machine without network: install cp312 wheels of msgspec, pyzmq,
# fastapi, starlette, uvicorn, pydantic, pydantic-core, annotated-types, typing-inspection,
# opentelemetry-api and importlib-metadata with --no-deps --target, put that folder and the
# checkout on PYTHONPATH, and make `vllm` run `python3 -m vllm.entrypoints.cli.main`).
# Results -> $OUT (or ./out); a summary is printed last.
#   CONFIGS="bf16 bf16_async bf16_2k fp8 nomtp mtp3" bash benchmarks/engine/run_h200_serving.sh
#   STEPS=project: GLM-5.3 at real dimensions (one GPU's EP8 share, FP8, random weights) at 4
#   and 8 layers, scaled to 78 (issue 34's full-model projection; ~2 min); STEPS=spec_real: MTP3
#   against none at real dimensions, 20 layers (issue 36's speed floors; ~4 min); STEPS=spec_project:
#   the same at 4 and 12 layers, scaled to 78 (~6 min)
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VLLM_NO_PROGRESS=1
summary=()
run() {  # name timeout cmd...
  local name=$1 t=$2; shift 2
  local t0=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  summary+=("$name rc=$rc $(( $(date +%s) - t0 ))s")
  tail -n "${TAILN:-20}" "$OUT/$name.log"
}
serve() {  # name checkpoint "serve args" "concurrencies"
  local name=$1 ckpt=$2 sargs=$3 cs=$4 port=8123 t0=$(date +%s)
  vllm serve "$ckpt" --port $port --kv-cache-dtype fp8_ds_mla --max-model-len 2240 \
    --max-num-seqs 64 $sargs > "$OUT/serve_$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 300); do
    curl -sf localhost:$port/health > /dev/null 2>&1 && break
    kill -0 $pid 2> /dev/null || break
    sleep 1
  done
  grep -iE "graph|warm-up|KV cache|context-dependent|error" "$OUT/serve_$name.log" | tail -5
  for c in $cs; do
    timeout 240 vllm bench serve --port $port --dataset-name random --random-input-len 2048 \
      --random-output-len 128 --num-prompts $(( c * 4 > 8 ? c * 4 : 8 )) --max-concurrency "$c" \
      --ignore-eos --json > "$OUT/bench_${name}_c$c.json" 2> "$OUT/bench_${name}_c$c.err"
    python3 - "$OUT/bench_${name}_c$c.json" "$name" "$c" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:  # noqa: BLE001
    sys.exit(print(sys.argv[2], "C", sys.argv[3], "no result:", e))
keys = ["output_throughput", "mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
        "spec_decode_acceptance_length", "completed"]
print(sys.argv[2], "C", sys.argv[3], {k: round(r[k], 2) if isinstance(r.get(k), float) else r.get(k) for k in keys})
PY
  done
  kill $pid; wait $pid 2> /dev/null
  # compiles after start-up are stalls inside requests (CompileWatch logs each one)
  summary+=("serve_$name $(( $(date +%s) - t0 ))s, compiles while serving: $(grep -c "while serving" "$OUT/serve_$name.log")")
}
python3 -c "
from vllm.model_executor.tiny.checkpoint import write_slice_checkpoint as w
w('/tmp/slice'); w('/tmp/slice_fp8', fp8=True); w('/tmp/slice_mtp', num_nextn_predict_layers=1)" || exit 1
SPEC='{"method":"mtp","num_speculative_tokens":3,"synthetic_acceptance_length":2.99}'
for step in ${STEPS:-gpu_tests decode_step prefill_step serving}; do
  case $step in
    gpu_tests) TAILN=6 run gpu_tests 150 python3 -m pytest -q -x -m gpu -p no:cacheprovider \
      tests/attention/test_dense_attend.py tests/worker/test_cudagraph_gpu.py tests/entrypoints/test_engine_gpu.py \
      tests/kernels/test_precompile.py ;;
    decode_step) TAILN=4 run decode_step 200 python3 benchmarks/engine/bench_decode_step.py \
      --batch 64 --context 8192 --steps 32 --out "$OUT/results.jsonl" ;;
    spec_real) TAILN=9 run spec_real 400 python3 benchmarks/engine/bench_spec_decode.py --real-dims \
      --layers 20 --batch 1,16,64 --context 8192 --steps 24 --out "$OUT/results.jsonl" ;;
    spec_project) TAILN=6 run spec_project 500 python3 benchmarks/engine/bench_spec_decode.py \
      --project 4,12 --batch 1,64 --context 8192 --steps 24 --out "$OUT/results.jsonl" ;;
    project) TAILN=5 run project 300 python3 benchmarks/engine/bench_decode_step.py --project \
      --batch 8,64 --context 8192 --steps 24 --out "$OUT/results.jsonl" ;;
    prefill_step) TAILN=40 run prefill_step 150 python3 benchmarks/engine/bench_prefill_step.py \
      --len 2048 --decode 64 --reps 6 --top 8 --out "$OUT/results.jsonl"
      TAILN=3 run mixed_graph 60 python3 benchmarks/engine/bench_prefill_step.py --len 1984 \
      --decode 64 --reps 6 --graphs --shapes mixed --forms dense --out "$OUT/results.jsonl" ;;
    serving)
      for cfg in ${CONFIGS:-bf16 bf16_async bf16_2k fp8 nomtp mtp3}; do
        case $cfg in
          bf16) serve bf16 /tmp/slice "" "1 64" ;;
          bf16_eager) serve bf16_eager /tmp/slice "--enforce-eager" "1 64" ;;
          bf16_async) serve bf16_async /tmp/slice "--async-scheduling" "1 64" ;;
          bf16_async64) serve bf16_async64 /tmp/slice "--async-scheduling" "64" ;;
          bf16_async_si4) serve bf16_async_si4 /tmp/slice "--async-scheduling --stream-interval 4" "64" ;;
          bf16_2k) serve bf16_2k /tmp/slice "--max-num-batched-tokens 2048 --async-scheduling" "64" ;;
          fp8) serve fp8 /tmp/slice_fp8 "" "1 16" ;;
          nomtp) serve nomtp /tmp/slice_mtp "" "1 16" ;;
          mtp3) serve mtp3 /tmp/slice_mtp "--speculative-config $SPEC" "1 16" ;;
        esac
      done ;;
  esac
done
printf '%s\n' "${summary[@]}"
