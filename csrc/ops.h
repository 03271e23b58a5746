// The ops of vllm._C: declared here, registered in torch_bindings.cpp, defined under csrc/.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

// FP8 sparse-MLA decode for Hopper (csrc/attention/sparse_mla_fp8_sm90.cu); its Python wrapper
// and spec: vllm/kernels/sparse_mla_cuda.py.
void sparse_mla_fp8_decode(const at::Tensor& q, const at::Tensor& kv_rows,
                           const at::Tensor& indices, at::Tensor& out, at::Tensor& lse,
                           at::Tensor& ws_o, at::Tensor& ws_l, at::Tensor& counters,
                           double scale_log2, int64_t num_ctas);
