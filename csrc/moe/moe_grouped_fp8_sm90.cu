// The routed experts' FP8 grouped GEMM at prefill sizes on Hopper (sm_90a): the op
// `_C::moe_grouped_fp8_gemm` (csrc/torch_bindings.cpp; Python wrapper, spec and the rest of the
// expert computation: vllm/kernels/moe_cutlass.py).
//
//   out[r, :] = Σ_kb sa[kb, r] · sw[e, kb, n / 128] · (a[r, kb·128 : +128] · w[e, :, kb·128 : +128]ᵀ)
//
// for the rows r of group e, [offsets[e], offsets[e + 1]): a e4m3 [P, K] (each expert's rows
// contiguous), its scales fp32, one per row and 128-deep K block, group by group: group e's
// [K / 128, m_e] block (rows contiguous) at K / 128 · offsets[e] of a [K / 128 · P] buffer (the
// layout CUTLASS's collective derives from each group's size), w e4m3 [E, N, K] and its 128 x 128
// block scales fp32 [E, K / 128, N / 128] (the checkpoint's [E, N / 128, K / 128] transposed),
// out bf16 [P, N]. Rows past offsets[E] are neither read nor written.
//
// The GEMM is CUTLASS's (a build dependency: the nvidia-cutlass package's headers, found by
// CMakeLists.txt): its pointer-array grouped kernel with FP8 block-wise scaling, warp-specialised
// (a TMA producer warp, two consumer warpgroups that promote each 128-deep block's wgmma result
// into fp32 accumulators with the block's scales), persistent over the groups' tiles. The
// per-group arguments (sizes, pointers, strides, scale layouts) are written by a small kernel from
// the device-side offsets, so nothing is copied to or from the host: the launch sequence is
// fixed and CUDA-graph capturable. The Triton grouped kernel (vllm/kernels/triton/
// moe_grouped_fp8.py) reaches ~39 % of the fp8 peak at 8K tokens; its design notes
// (docs/design/fp8.md) say why a warp-specialised kernel is what closes the gap.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <mutex>

#include "../ops.h"
#include "../sm90_device.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace vllm::moe_grouped_fp8_sm90 {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using ElementAB = cutlass::float_e4m3_t;
using ElementOut = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;  // w [N, K]: K contiguous
using LayoutOut = cutlass::layout::RowMajor;
constexpr int kBlock = 128;  // the scales' block (and the activation quantisation group)
constexpr int kAlignAB = 16;  // elements per 16-byte access
constexpr int kAlignOut = 8;

// per-row scales of A (granularity 1 along M), 128 x 128 blocks of B; both M/N-contiguous
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kBlock, kBlock>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

// 128 x 128 x 128 tiles, two consumer warpgroups (cooperative), clusters of two CTAs along N
// sharing the A tile by TMA multicast.
using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutOut*, kAlignOut,
    ElementOut, LayoutOut*, kAlignOut, EpilogueSchedule,
    cutlass::epilogue::fusion::LinearCombination<ElementOut, float>>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB,
    cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB, ElementAB, cute::tuple<LayoutB*, LayoutSFB*>,
    kAlignAB, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename Epilogue::SharedStorage))>,
    KernelSchedule>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
using StrideA = typename GemmKernel::InternalStrideA;
using StrideB = typename GemmKernel::InternalStrideB;
using StrideOut = typename GemmKernel::InternalStrideD;
using GroupShape = typename ProblemShape::UnderlyingProblemShape;

// The per-group argument arrays, carved from one byte buffer.
struct GroupArgs {
  GroupShape* shapes;
  const ElementAB** a;
  const ElementAB** w;
  ElementOut** out;
  const float** sa;
  const float** sw;
  StrideA* stride_a;
  StrideB* stride_w;
  StrideOut* stride_out;
  LayoutSFA* layout_sa;
  LayoutSFB* layout_sw;
};

// Places array i of a GroupArgs at the next 128-byte boundary of a buffer at base (null: only
// counts the bytes).
template <class T>
T* carve(uint8_t* base, int64_t& used, int64_t n) {
  T* out = base ? reinterpret_cast<T*>(base + used) : nullptr;
  used += (n * static_cast<int64_t>(sizeof(T)) + 127) / 128 * 128;
  return out;
}

GroupArgs group_args(uint8_t* base, int64_t e, int64_t& bytes) {
  GroupArgs g;
  bytes = 0;
  g.shapes = carve<GroupShape>(base, bytes, e);
  g.a = carve<const ElementAB*>(base, bytes, e);
  g.w = carve<const ElementAB*>(base, bytes, e);
  g.out = carve<ElementOut*>(base, bytes, e);
  g.sa = carve<const float*>(base, bytes, e);
  g.sw = carve<const float*>(base, bytes, e);
  g.stride_a = carve<StrideA>(base, bytes, e);
  g.stride_w = carve<StrideB>(base, bytes, e);
  g.stride_out = carve<StrideOut>(base, bytes, e);
  g.layout_sa = carve<LayoutSFA>(base, bytes, e);
  g.layout_sw = carve<LayoutSFB>(base, bytes, e);
  return g;
}

// One thread per group: its size from the offsets, its pointers, strides and scale layouts.
__global__ void fill_group_args(GroupArgs g, const int* __restrict__ offsets, int num_groups,
                                int n, int k, const ElementAB* a, const ElementAB* w,
                                ElementOut* out, const float* sa, const float* sw) {
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= num_groups) return;
  int start = offsets[e];
  int m = offsets[e + 1] - start;
  int kb = k / kBlock, nb = n / kBlock;
  g.shapes[e] = cute::make_shape(m, n, k);
  g.a[e] = a + static_cast<int64_t>(start) * k;
  g.w[e] = w + static_cast<int64_t>(e) * n * k;
  g.out[e] = out + static_cast<int64_t>(start) * n;
  g.sa[e] = sa + static_cast<int64_t>(start) * kb;  // the group's [K / 128, m] block
  g.sw[e] = sw + static_cast<int64_t>(e) * kb * nb;
  g.stride_a[e] = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(m, k, 1));
  g.stride_w[e] = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(n, k, 1));
  g.stride_out[e] = cutlass::make_cute_packed_stride(StrideOut{}, cute::make_shape(m, n, 1));
  // (the collective derives the scale layouts from each group's size: these are the same)
  g.layout_sa[e] = ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
  g.layout_sw[e] = ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
}

// Once per device: the sm_90 check and the SM count.
int prepare_device(int device) {
  static std::array<int, C10_COMPILE_TIME_MAX_GPUS> sms{};
  vllm::once_per_device(device, [](int d) {
    vllm::check_sm90(d, "moe_grouped_fp8_gemm");
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms[d], cudaDevAttrMultiProcessorCount, d));
  });
  return sms[device];
}

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

}  // namespace vllm::moe_grouped_fp8_sm90

void moe_grouped_fp8_gemm(const at::Tensor& a, const at::Tensor& sa, const at::Tensor& w,
                          const at::Tensor& sw, const at::Tensor& offsets, at::Tensor& out) {
  using namespace vllm::moe_grouped_fp8_sm90;
  TORCH_CHECK(a.is_cuda() && a.scalar_type() == at::kFloat8_e4m3fn && a.dim() == 2 &&
                  a.is_contiguous() && aligned16(a),
              "a: contiguous e4m3 [P, K] expected");
  TORCH_CHECK(w.scalar_type() == at::kFloat8_e4m3fn && w.dim() == 3 && w.is_contiguous() &&
                  aligned16(w),
              "w: contiguous e4m3 [E, N, K] expected");
  const int64_t p = a.size(0), k = a.size(1), e = w.size(0), n = w.size(1);
  TORCH_CHECK(w.size(2) == k, "w's K (", w.size(2), ") is not a's (", k, ")");
  TORCH_CHECK(k % kBlock == 0 && n % kBlock == 0 && k > 0 && n > 0,
              "N and K must be positive multiples of 128, got N ", n, " K ", k);
  TORCH_CHECK(sa.scalar_type() == at::kFloat && sa.is_contiguous() && sa.dim() == 1 &&
                  sa.size(0) == k / kBlock * p,
              "sa: contiguous fp32 [K / 128 * P] expected (group-major scales)");
  TORCH_CHECK(sw.scalar_type() == at::kFloat && sw.is_contiguous() && sw.dim() == 3 &&
                  sw.size(0) == e && sw.size(1) == k / kBlock && sw.size(2) == n / kBlock,
              "sw: contiguous fp32 [E, K / 128, N / 128] expected");
  TORCH_CHECK(offsets.scalar_type() == at::kInt && offsets.is_contiguous() && offsets.dim() == 1 &&
                  offsets.size(0) == e + 1,
              "offsets: contiguous int32 [E + 1] expected");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == p && out.size(1) == n && aligned16(out),
              "out: contiguous bf16 [P, N] expected");
  for (const at::Tensor* x : std::initializer_list<const at::Tensor*>{&sa, &w, &sw, &offsets, &out}) {
    TORCH_CHECK(x->device() == a.device(), "all tensors must be on ", a.device());
  }
  TORCH_CHECK(p < (int64_t{1} << 31) / kBlock && e < (int64_t{1} << 20),
              "too many rows or groups for int32 sizes");
  if (p == 0 || e == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  const int sms = prepare_device(a.get_device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  int64_t bytes = 0;
  group_args(nullptr, e, bytes);
  at::Tensor buf = at::empty({bytes}, a.options().dtype(at::kByte));
  GroupArgs g = group_args(buf.data_ptr<uint8_t>(), e, bytes);
  auto* a_ptr = reinterpret_cast<const ElementAB*>(a.data_ptr());
  auto* w_ptr = reinterpret_cast<const ElementAB*>(w.data_ptr());
  auto* out_ptr = reinterpret_cast<ElementOut*>(out.data_ptr());
  fill_group_args<<<static_cast<unsigned>((e + 127) / 128), 128, 0, stream>>>(
      g, offsets.data_ptr<int>(), static_cast<int>(e), static_cast<int>(n), static_cast<int>(k),
      a_ptr, w_ptr, out_ptr, sa.data_ptr<float>(), sw.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  cutlass::KernelHardwareInfo hw;
  hw.device_id = a.get_device();
  hw.sm_count = sms;
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {static_cast<int>(e), g.shapes, nullptr},  // sizes on the device only
      {g.a, g.stride_a, g.w, g.stride_w, g.sa, g.layout_sa, g.sw, g.layout_sw},
      {{}, nullptr, g.stride_out, g.out, g.stride_out},
      hw};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  // Tiles walk along M (the expert-sorted rows) first: at GLM-5.3's down shape (N 6144, K 2048,
  // 65,536 rows) 2.14-2.16 ms against 2.21-2.52 ms for the heuristic's order, swizzle 1-8 (H100,
  // standalone probe); the gate/up shape measured the same either way.
  args.scheduler.raster_order =
      cutlass::gemm::kernel::detail::RasterOrderOptions::AlongM;

  Gemm gemm;
  cutlass::Status st = gemm.can_implement(args);
  TORCH_CHECK(st == cutlass::Status::kSuccess, "moe_grouped_fp8_gemm: CUTLASS cannot run N ", n,
              " K ", k, ": ", cutlassGetStatusString(st));
  at::Tensor workspace =
      at::empty({static_cast<int64_t>(Gemm::get_workspace_size(args)) + 1},
                a.options().dtype(at::kByte));
  st = gemm.initialize(args, workspace.data_ptr(), stream);
  TORCH_CHECK(st == cutlass::Status::kSuccess, "moe_grouped_fp8_gemm: initialize: ",
              cutlassGetStatusString(st));
  st = gemm.run(stream);
  TORCH_CHECK(st == cutlass::Status::kSuccess, "moe_grouped_fp8_gemm: run: ",
              cutlassGetStatusString(st));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
