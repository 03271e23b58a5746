#!/usr/bin/env bash
# Pipe, shared-memory and stall metrics of one sparse-MLA decode kernel (Nsight Compute), text to
# stdout: what is busy (tensor pipe, shared-memory read/write wavefronts, issue slots) and why the
# warps wait. The first launch (compiles, warms up) is skipped; the second one is profiled.
# Usage: bash benchmarks/kernels/ncu_sparse_mla_metrics.sh KERNEL_REGEX [profile_ncu.py sparse_mla_decode args...]
#   e.g. bash benchmarks/kernels/ncu_sparse_mla_metrics.sh _sparse_mla_ws_kernel --rows 1024 --cache fp8_ds_mla
# Kernels: _sparse_mla_ws_kernel (split), _sparse_mla_asym_kernel, _sparse_mla_seesaw_kernel (bf16 rows).
set -u
regex=$1; shift
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
M='regex:^sm__pipe_.*cycles_active\.avg\.pct_of_peak_sustained_active$'
M+=',regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$'
M+=',regex:^l1tex__data_pipe_lsu_wavefronts_mem_shared.*\.pct_of_peak_sustained_elapsed$'
M+=',regex:^l1tex__data_bank_conflicts_pipe_lsu_mem_shared.*\.sum$'
M+=',sm__cycles_elapsed.avg.per_second,gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed'
M+=',smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed'
M+=',lts__t_sector_hit_rate.pct'
"$NCU" --clock-control none --kernel-name "regex:$regex" --launch-skip 1 --launch-count 1 \
  --metrics "$M" --print-summary none \
  python3 benchmarks/kernels/profile_ncu.py sparse_mla_decode "$@" --launches 2
