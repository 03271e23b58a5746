#!/usr/bin/env bash
# Nsight Compute report of one kernel of one op (benchmarks/kernels/profile_ncu.py), text to stdout.
# Usage: bash benchmarks/kernels/ncu_profile.sh KERNEL_REGEX OP [profile_ncu.py args...]
#   e.g. bash benchmarks/kernels/ncu_profile.sh _collect_kernel topk --rows 8192 --cols 131072 --causal
# The first launch (compiles, warms up) is skipped; the second one is profiled.
set -u
regex=$1; shift
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
"$NCU" --clock-control none --kernel-name "regex:$regex" --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section SchedulerStats --section SourceCounters \
  --print-summary none python3 benchmarks/kernels/profile_ncu.py "$@" --launches 2
