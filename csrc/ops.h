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

#ifdef VLLM_WITH_CUTLASS_MOE
// FP8 grouped GEMM of the routed experts at prefill sizes (csrc/moe/moe_grouped_fp8_sm90.cu);
// its Python wrapper and spec: vllm/kernels/moe_cutlass.py.
void moe_grouped_fp8_gemm(const at::Tensor& a, const at::Tensor& sa, const at::Tensor& w,
                          const at::Tensor& sw, const at::Tensor& offsets, at::Tensor& out);
#endif
