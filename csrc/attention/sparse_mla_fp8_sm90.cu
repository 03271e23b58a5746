// Sparse-MLA decode over fp8_ds_mla rows for Hopper (sm_90a), in CUDA C++: the design of the
// kernel (sparse_mla_fp8_sm90_kernel.cuh and the headers it includes) and its launcher, the op
// `_C::sparse_mla_fp8_decode` (csrc/torch_bindings.cpp; Python wrapper and spec:
// vllm/kernels/sparse_mla_cuda.py).
//
// Same function as the Triton sparse-MLA kernels (per query token, all of its <= 64 heads at
// once) at GLM-5.3's dims: kv_lora 512 (e4m3 + 4 fp32 tile scales), rope 64 (bf16); a row is 656
// bytes. Unlike the Gluon kernel (vllm/kernels/sparse_mla_ws.py) it never dequantises the FP8
// rows into shared memory.
//
// The grid's G CTAs share the T x ceil(topk / 64) blocks of 64 rows equally, in contiguous
// ranges of (token, block) items (sparse_mla_fp8_sm90_epilogue.cuh). A CTA with several tokens
// moves from one to the next while its producer keeps filling stages. A token cut between CTAs
// is merged in the kernel by whichever of its pieces arrives last. The Python wrapper's default
// grid: G = T from T >= #SMs / 2 (one token per CTA), else each token in #SMs / T equal pieces.
// - Producer warpgroup (warpgroup 0, 24 registers): its 4 warps copy each 64-row block's
//   selected rows in 16-byte cp.async pieces into a ring of NUM_STAGES raw stages (a -1 id is
//   zero-filled and masked); once it has issued its last stage it prefetches into L2 the query
//   and first rows of the CTA likely to start next on a freed SM
//   (sparse_mla_fp8_sm90_producer.cuh).
// - Two consumer warpgroups (240 registers each) that score alternate blocks
//   (sparse_mla_fp8_sm90_seesaw.cuh). For its block j, warpgroup j % 2:
//   - S^T = K . Q^T for all 64 heads: M = the block's 64 rows, N = 64 heads. K is the wgmma A
//     operand *in registers*: each thread loads its rows' raw bytes from the stage and converts
//     e4m3 -> f16 (exact) times the tile scale normalised by the row's largest scale (2^-e_row,
//     undone in the softmax); Q^T (f16, times a power of two so it fits f16) is B in shared
//     memory. The 576 features are permuted (the same permutation on Q) so each thread reads 16
//     contiguous bytes per row per 4 k-steps, conflict-free. The rope part is a bf16 wgmma into
//     the same fp32 accumulator. (QK on the FP8 tensor cores from shared memory, the query split
//     into two e4m3 terms, measured 1-2 % slower.)
//   - Online base-2 softmax. The stabiliser m is shared by both warpgroups (softmaxes run in
//     block order) and moves only when a row exceeds it by 2^RESCALE_LOG2: one barrier-with-OR
//     per block decides; only then are the row maxima reduced and alpha published. P^T goes to
//     shared memory by stmatrix.trans (one of NUM_PBUF buffers), with the block's flags.
//   - Both warpgroups then run PV of every block in block order, each on its value columns
//     [256h, 256h + 256) for all 64 heads (4 m64 tiles x 64 heads = 128 fp32 registers):
//     O^T += V^T . P^T, V^T the A operand in registers, in f16 (e4m3 times the tile scale over
//     the row's largest power of two, which P^T carries against a second CTA-wide stabiliser
//     2^E), with an exact bf16 PV for blocks whose scales f16 cannot hold.
// - Per token (a CTA's piece): the query prologue (the query copied in order through a shared
//   staging area), then the blocks, then the epilogue (row sums reduced across warps and
//   warpgroups, 1/l by rcp.approx, O and the LSE stored, or a split token's partial stored or
//   merged).
// Per CTA at T=1024 on an H200: ~8K cycles of query load, 9.5K per two blocks, ~11K of output
// stores (which a replayed benchmark does not wait for). An earlier design (both warpgroups score
// every block, 32 heads each, exact bf16 PV) took 1.003 ms at T=1024 against this one's 0.886.
//
// Shapes: q [T, H<=64, 576] bf16; kv [rows, 656] uint8; idx [T, K] int32 (-1 = none);
// out [T, H, 512] (bf16 or fp32), lse [T, H] fp32 natural log (-inf, zeros for a token with no
// valid row). Grid (G, 1), 384 threads, one CTA per SM.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>

#include "../ops.h"
#include "../sm90_device.h"
#include "sparse_mla_fp8_sm90_kernel.cuh"
#include "sparse_mla_fp8_sm90_layout.cuh"

// ---- launcher -----------------------------------------------------------------------------------
namespace {

namespace k = vllm::sparse_mla_sm90;

// Once per device: the sm_90 check and the kernel's dynamic shared memory, over the 48 KB
// default, for both instantiations.
void prepare_device(int device) {
  vllm::once_per_device(device, [](int d) {
    vllm::check_sm90(d, "sparse_mla_fp8_decode");
    C10_CUDA_CHECK(cudaFuncSetAttribute(k::sparse_mla_fp8_sm90_kernel<true>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        k::SMEM_ALLOC));
    C10_CUDA_CHECK(cudaFuncSetAttribute(k::sparse_mla_fp8_sm90_kernel<false>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        k::SMEM_ALLOC));
  });
}

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// The layouts the kernel assumes (it reads whole 16-byte pieces and writes heads 512 apart).
void check_inputs(const at::Tensor& q, const at::Tensor& kv_rows,
                  const at::Tensor& indices, const at::Tensor& out,
                  const at::Tensor& lse) {
  TORCH_CHECK(q.is_cuda() && q.scalar_type() == at::kBFloat16 && q.dim() == 3 &&
                  q.size(1) >= 1 && q.size(1) <= 64 && q.size(2) == 576,
              "q must be CUDA bf16 [T, 1..64, 576], got ", q.scalar_type(), " ", q.sizes());
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) % 8 == 0 && q.stride(0) % 8 == 0 && aligned16(q),
              "q's rows must be 16-byte aligned with a unit last stride");
  TORCH_CHECK(kv_rows.scalar_type() == at::kByte && kv_rows.dim() == 2 &&
                  kv_rows.size(1) == k::ROW && kv_rows.stride(1) == 1 &&
                  kv_rows.stride(0) == k::ROW && aligned16(kv_rows),
              "kv_rows must be contiguous uint8 [rows, 656] fp8_ds_mla rows, 16-byte aligned");
  const int64_t t = q.size(0), h = q.size(1);
  TORCH_CHECK(indices.scalar_type() == at::kInt && indices.dim() == 2 && indices.size(0) == t &&
                  indices.stride(1) == 1,
              "indices must be int32 [T, K] with a unit last stride");
  TORCH_CHECK((out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat) &&
                  out.dim() == 3 && out.size(0) == t && out.size(1) == h &&
                  out.size(2) == k::D_V && out.stride(2) == 1 && out.stride(1) == k::D_V &&
                  aligned16(out),
              "out must be bf16 or fp32 [T, H, 512], heads contiguous, 16-byte aligned");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 2 && lse.size(0) == t &&
                  lse.size(1) == h && lse.stride(1) == 1,
              "lse must be fp32 [T, H] with a unit last stride");
  for (const at::Tensor* x : {&kv_rows, &indices, &out, &lse})
    TORCH_CHECK(x->device() == q.device(), "all tensors must be on ", q.device());
}

}  // namespace

void sparse_mla_fp8_decode(const at::Tensor& q, const at::Tensor& kv_rows,
                           const at::Tensor& indices, at::Tensor& out, at::Tensor& lse,
                           at::Tensor& ws_o, at::Tensor& ws_l, at::Tensor& counters,
                           double scale_log2, int64_t num_ctas) {
  check_inputs(q, kv_rows, indices, out, lse);
  const int64_t t = q.size(0), topk = indices.size(1);
  if (t == 0) return;
  const auto cdiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const int64_t nb = std::max<int64_t>(1, cdiv(topk, k::BN));  // K = 0: one block of -1 rows
  const int64_t work = t * nb;
  TORCH_CHECK(work < (int64_t{1} << 31) && topk < (int64_t{1} << 31) - k::BN,
              "T * ceil(K / 64) = ", work, " work items, K = ", topk,
              ": the kernel counts both in int32");
  // A token must span at most MAX_PIECES CTAs: every CTA's range at least
  // ceil((nb - 1) / (MAX_PIECES - 1)) blocks.
  const int64_t max_ctas = work / std::max<int64_t>(1, cdiv(nb - 1, k::MAX_PIECES - 1));
  TORCH_CHECK(num_ctas >= 1 && num_ctas <= max_ctas, "num_ctas must be in [1, ", max_ctas,
              "] for T = ", t, ", K = ", topk, ", got ", num_ctas);
  TORCH_CHECK(ws_o.scalar_type() == at::kFloat && ws_o.is_contiguous() &&
                  ws_o.numel() >= 2 * num_ctas * 64 * k::D_V && ws_o.device() == q.device(),
              "ws_o must be contiguous fp32 of >= [2 * num_ctas, 64, 512] on ", q.device());
  TORCH_CHECK(ws_l.scalar_type() == at::kFloat && ws_l.is_contiguous() &&
                  ws_l.numel() >= 2 * num_ctas * 64 && ws_l.device() == q.device(),
              "ws_l must be contiguous fp32 of >= [2 * num_ctas, 64] on ", q.device());
  TORCH_CHECK(counters.scalar_type() == at::kInt && counters.is_contiguous() &&
                  counters.numel() >= 2 * t && counters.device() == q.device(),
              "counters must be contiguous int32 of >= [2T] (zero) on ", q.device());

  const c10::cuda::CUDAGuard guard(q.device());
  prepare_device(q.get_device());
  // Tokens cut between CTAs (the G equal ranges of the T * nb items are whole tokens when G
  // divides T) take the bf16 partials; see the kernel.
  const bool split = t % num_ctas != 0;
  const auto kernel = split ? k::sparse_mla_fp8_sm90_kernel<true>
                            : k::sparse_mla_fp8_sm90_kernel<false>;
  kernel<<<dim3(static_cast<unsigned>(num_ctas)), k::THREADS, k::SMEM_ALLOC,
           c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __nv_bfloat16*>(q.data_ptr()),
      static_cast<const uint8_t*>(kv_rows.data_ptr()), indices.data_ptr<int>(), out.data_ptr(),
      lse.data_ptr<float>(), ws_o.data_ptr<float>(), ws_l.data_ptr<float>(),
      counters.data_ptr<int>(), static_cast<float>(scale_log2), static_cast<int>(q.size(1)),
      static_cast<int>(topk), static_cast<int>(nb), static_cast<int>(t), q.stride(0),
      q.stride(1), indices.stride(0), out.stride(0), out.stride(1), lse.stride(0),
      out.scalar_type() == at::kFloat ? 1 : 0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
