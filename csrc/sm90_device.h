// Once-per-device set-up of the Hopper-only ops (the library holds sm_90a code only): the
// compute-capability check every such op makes before its first launch on a device.
#pragma once

#include <c10/core/Device.h>
#include <c10/cuda/CUDAException.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <array>
#include <mutex>
#include <utility>

namespace vllm {

// Throws unless `device` is sm_90; `op` names the caller in the message.
inline void check_sm90(int device, const char* op) {
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  TORCH_CHECK(major == 9 && minor == 0, op, " is built for sm_90a (Hopper); device ", device,
              " is sm_", major, minor);
}

// Runs `setup(device)` the first time it is called for `device` (per call site: each lambda is
// its own instantiation, with its own flags).
template <class F>
void once_per_device(int device, F&& setup) {
  static std::array<std::once_flag, C10_COMPILE_TIME_MAX_GPUS> once;
  TORCH_CHECK(device >= 0 && device < static_cast<int>(once.size()), "bad device ", device);
  std::call_once(once[device], std::forward<F>(setup), device);
}

}  // namespace vllm
