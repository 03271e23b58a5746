#!/usr/bin/env bash
# One device call: the GPU kernel tests, then every kernel benchmark; full logs and JSON rows under
# $OUT, the short tables last. Usage (repository root, on the GPU machine):
#   BENCH_ARGS="--sweep" bash benchmarks/kernels/run_h200.sh
# Knobs: TEST_K (pytest -k filter, "" = all), BENCH_ARGS, BENCHES, *_TIMEOUT (seconds per stage).
set -u
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
git log -1 --format="commit %H" 2>/dev/null | tee -a "$OUT/gpu.txt"
if [ "${TEST_TIMEOUT:-200}" != 0 ]; then
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -m gpu tests/kernels -q -p no:cacheprovider \
    --timeout 150 --tb=short -k "${TEST_K-not e2e}" >"$OUT/tests.log" 2>&1
  echo "tests exit $?" >>"$OUT/tests.log"
fi
# the FP8 benchmarks finished within 150 s (fp8_gemm) and 100 s (fp8_moe) on the H200
for b in ${BENCHES:-sparse_mla_decode sparse_mla_prefill indexer_logits topk kv_write merge_attn fp8_gemm fp8_moe norm_rope}; do
  echo "==== bench_$b" >>"$OUT/bench.log"
  timeout "${BENCH_TIMEOUT:-150}" python3 "benchmarks/kernels/bench_$b.py" --json "$OUT/bench.jsonl" \
    ${BENCH_ARGS:-} >>"$OUT/bench.log" 2>&1
  echo "exit $?" >>"$OUT/bench.log"
done
echo "==== tests"
grep -E "^(FAILED|ERROR)|^E  |passed|failed|tests exit" "$OUT/tests.log" 2>/dev/null | cut -c1-160 | tail -30
grep -vE "^\s*$|Warning|warn\(" "$OUT/bench.log" | grep -E "^(====|#|op |exit|[a-z0-9_]+[*]? +[TP]=|[a-z0-9_]+ +N=|fp8_gemm_|config|[A-Za-z]*Error)" | cut -c1-220
