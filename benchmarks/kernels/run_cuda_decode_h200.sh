#!/usr/bin/env bash
# One device call for the CUDA FP8 sparse-MLA decode kernel: smoke diagnostics, its GPU tests,
# then the decode benchmark (Gluon ws vs CUDA, same process). Output under $OUT.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1 VLLM_CACHE_ROOT=/tmp/vllm-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
which nvcc || ls /usr/local/cuda/bin/nvcc
timeout 180 python3 benchmarks/kernels/smoke_sparse_mla_cuda.py 2>&1 | tee "$OUT/smoke.txt"
smoke=${PIPESTATUS[0]}
echo "smoke rc=$smoke"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_sparse_mla_cuda.py ${TEST_ARGS:-} 2>&1 | tail -25 | tee "$OUT/tests.txt"
fi
if [ "$smoke" = 0 ] && [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout 300 python3 benchmarks/kernels/bench_sparse_mla_decode.py --kernels ${KERNELS:-ws,cuda} --json "$OUT/decode.jsonl" 2>&1 | tee "$OUT/bench.txt" | tail -20
fi
