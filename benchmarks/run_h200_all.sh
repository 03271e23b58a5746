#!/usr/bin/env bash
# One device call: GPU tests, then the engine/PCP/HiSparse benchmarks. Results -> $OUT (or ./out).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=${EXTRA_PYTHONPATH:+$EXTRA_PYTHONPATH:}. PYTHONUNBUFFERED=1 VLLM_NO_PROGRESS=1 NCCL_NVLS_ENABLE=0
summary=()
run() {  # name timeout cmd...
  local name=$1 t=$2; shift 2
  local t0=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  summary+=("$name rc=$rc $(( $(date +%s) - t0 ))s")
  tail -n 25 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# STEPS picks what runs (default: the tests and the engine/PCP/HiSparse benchmarks); e.g. a fresh
# machine, the MoE path: STEPS="wheels build gpu_tests fp8_moe" GPU_TESTS="tests/kernels/test_moe_cutlass.py"
for step in ${STEPS:-gpu_tests step_overhead pcp_share hisparse}; do
  case $step in
    # the device has no network: pure-Python wheels (msgspec, pyzmq, fastapi, ...) and
    # nvidia-cutlass's headers travel in .whl/ (tools/device_wheels.sh), then vllm._C is built
    # (python3 -m pip: the image's plain pip installs for another Python)
    wheels) run wheels 300 bash -c 'python3 -m pip install -q --no-deps --no-index .whl/*.whl' ;;
    build) run build "${BUILD_TIMEOUT:-400}" python3 -m pip install -q --no-deps --no-build-isolation -e . ;;
    gpu_tests) run gpu_tests "${GPU_TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/hisparse tests/entrypoints/test_engine_gpu.py} ;;
    step_overhead) run step_overhead 150 python3 benchmarks/engine/bench_step_overhead.py --device cuda --model glm-slice --json "$OUT/results.jsonl" ;;
    pcp_share) run pcp_share 200 python3 benchmarks/parallel/bench_pcp_share.py --lengths 32768 131072 --pcp 8 --json "$OUT/results.jsonl" ;;
    engine_decode) run engine_decode "${ENGINE_DECODE_TIMEOUT:-240}" python3 benchmarks/hisparse/bench_engine_decode.py ${ENGINE_DECODE_ARGS:-} --json "$OUT/results.jsonl" ;;
    hisparse) run hisparse "${HISPARSE_TIMEOUT:-240}" python3 benchmarks/hisparse/bench_hisparse.py ${HISPARSE_ARGS:---million} --json "$OUT/results.jsonl" ;;
    *) run "$step" "${BENCH_TIMEOUT:-150}" python3 "benchmarks/kernels/bench_$step.py" ${BENCH_ARGS:-} --json "$OUT/results.jsonl" ;;
  esac
done
printf '%s\n' "${summary[@]}"
