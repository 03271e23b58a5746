# vLLM (GLM-5.3 sparse-MLA edition) on CUDA. Build: docker build -t vllm-glm .
# Run:   docker run --gpus all -p 8000:8000 vllm-glm [MODEL] [flags]   (no MODEL: the tiny checkpoint)
FROM nvidia/cuda:13.0.0-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git \
        cmake ninja-build \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /opt/vllm
# torch first: the build of vllm._C (csrc/, sm_90a) uses this torch, hence --no-build-isolation
# nvidia-cutlass: CUTLASS's headers for the FP8 grouped MoE GEMM (csrc/moe/); its Python deps are
# not needed for that
RUN pip install --index-url https://download.pytorch.org/whl/cu130 "torch>=2.11" \
    && pip install "setuptools>=68" && pip install --no-deps nvidia-cutlass==4.2.0.0
COPY pyproject.toml setup.py CMakeLists.txt README.md ./
COPY csrc ./csrc
COPY vllm ./vllm
RUN pip install --no-build-isolation -e '.[triton]' \
    && python -c "import vllm._custom_ops as o; assert o.has_native_ops(), o.native_ops_error(); \
assert o.has_moe_grouped_fp8_gemm()"

# compiled Triton kernels (mount a volume here to keep them across restarts)
ENV TRITON_CACHE_DIR=/root/.cache/triton
EXPOSE 8000
ENTRYPOINT ["vllm", "serve", "--host", "0.0.0.0", "--port", "8000"]
