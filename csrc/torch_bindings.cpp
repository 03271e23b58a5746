// Registers the ops of vllm._C with the PyTorch dispatcher (torch.ops._C.*), and makes the shared
// library importable as the Python module vllm._C: importing it loads the library, which runs
// the registration below.
#include <Python.h>
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(_C, m) {
  // Mutates out, lse, ws_o, ws_l and counters (counters: zero on entry and on exit); returns
  // nothing, so torch.compile needs no fake kernel for it.
  m.def(
      "sparse_mla_fp8_decode(Tensor q, Tensor kv_rows, Tensor indices, Tensor! out, Tensor! lse, "
      "Tensor! ws_o, Tensor! ws_l, Tensor! counters, float scale_log2, int num_ctas) -> ()");
  m.impl("sparse_mla_fp8_decode", c10::kCUDA, &sparse_mla_fp8_decode);
#ifdef VLLM_WITH_CUTLASS_MOE
  // Writes out's rows [0, offsets[-1]); offsets stay on the device (no host sync).
  m.def(
      "moe_grouped_fp8_gemm(Tensor a, Tensor sa, Tensor w, Tensor sw, Tensor offsets, "
      "Tensor! out) -> ()");
  m.impl("moe_grouped_fp8_gemm", c10::kCUDA, &moe_grouped_fp8_gemm);
#endif
}

// The module itself is empty: the ops live in torch.ops._C.
PyMODINIT_FUNC PyInit__C() {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, 0, nullptr};
  return PyModule_Create(&module);
}
