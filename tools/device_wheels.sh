#!/usr/bin/env bash
# Downloads (on this machine, which reaches PyPI) the wheels a fresh GPU machine needs and cannot
# download itself (no network there): the engine's pure-Python dependencies that its image lacks,
# for its Python 3.12, and nvidia-cutlass's headers for building vllm._C's grouped MoE GEMM.
# They go to .whl/ (git-ignored; carry it with the device call), where run_h200_all.sh's
# `wheels` step installs them. Usage: bash tools/device_wheels.sh
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
pip download -q --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  -d .whl msgspec pyzmq fastapi opentelemetry-api uvicorn starlette pydantic pydantic-core \
  annotated-types typing-inspection
pip download -q --no-deps nvidia-cutlass==4.2.0.0 -d .whl
du -sh .whl
