#!/usr/bin/env bash
# One device call for the CUDA FP8 sparse-MLA decode kernel: smoke diagnostics of the build
# variants ($VARIANTS, ';'-separated NAME=V lists), its GPU tests, an Nsight Compute profile of the
# default build at T=1024 (pipes, stalls, hottest SASS), then the decode benchmark (Gluon ws vs
# CUDA and its variants, same process). Everything also lands under $OUT. NCU_DEFINES: the build
# the profiles take (default: the default build). ATTRS: launcher settings of the CUDA kernel
# to time as well (";"-separated NAME=V lists, e.g. NUM_CTAS=128).
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1 VLLM_CACHE_ROOT=/tmp/vllm-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader
IFS=';' read -ra V <<< "${VARIANTS:-}"
timeout 240 python3 benchmarks/kernels/smoke_sparse_mla_cuda.py "" "${V[@]}" 2>&1 | tee "$OUT/smoke.txt"
smoke=${PIPESTATUS[0]}
echo "smoke rc=$smoke"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_sparse_mla_cuda.py ${TEST_ARGS:-} > "$OUT/tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -5
  grep -nE "^E  |Error|error" "$OUT/tests.txt" | head -12
fi
if [ "${SKIP_NCU:-0}" != 1 ]; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  timeout 200 bash benchmarks/kernels/ncu_sparse_mla_metrics.sh sparse_mla_fp8_sm90 --rows 1024 --kernel cuda --cuda-defines "${NCU_DEFINES:-}" > "$OUT/ncu_metrics.txt" 2>&1
  grep -E "pipe_tensor_cycles|pipe_alu|pipe_fma_c|issue_active|stalled_(barrier|long|short|wait|math|mio|gmma|dispatch|no_inst)|mem_shared.sum.pct|mem_shared_op_(ld|st|gmma).sum|duration|dram__" "$OUT/ncu_metrics.txt" | sed 's/  */ /g' | head -30
  timeout 240 "$NCU" --clock-control none --kernel-name regex:sparse_mla_fp8_sm90 --launch-skip 1 --launch-count 1 \
    --section SourceCounters --export "$OUT/prof" --force-overwrite \
    python3 benchmarks/kernels/profile_ncu.py sparse_mla_decode --rows 1024 --kernel cuda --cuda-defines "${NCU_DEFINES:-}" --launches 2 > /dev/null 2>&1
  "$NCU" -i "$OUT/prof.ncu-rep" --page source --csv --print-source sass > "$OUT/src.csv" 2>/dev/null
  python3 benchmarks/kernels/ncu_top_stalls.py "$OUT/src.csv" 15 2>&1 | tee "$OUT/top_stalls.txt"
fi
if [ "$smoke" = 0 ] && [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout 400 python3 benchmarks/kernels/bench_sparse_mla_decode.py --kernels ${KERNELS:-ws,cuda} --cuda-defines "${VARIANTS:-}" --cuda-attrs "${ATTRS:-}" --json "$OUT/decode.jsonl" 2>&1 | tee "$OUT/bench.txt" | grep -E "peaks|fp8" 
fi
