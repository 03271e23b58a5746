// Sparse-MLA decode over fp8_ds_mla rows for Hopper (sm_90a), in CUDA C++: the kernel and its
// launcher, the op `_C::sparse_mla_fp8_decode` (csrc/torch_bindings.cpp; Python wrapper and spec:
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
// stores. An earlier design (both warpgroups score every block, 32 heads each, exact bf16 PV)
// took 1.003 ms at T=1024 against this one's 0.886.
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
#include "sparse_mla_fp8_sm90_epilogue.cuh"
#include "sparse_mla_fp8_sm90_layout.cuh"
#include "sparse_mla_fp8_sm90_producer.cuh"
#include "sparse_mla_fp8_sm90_ptx.cuh"
#include "sparse_mla_fp8_sm90_seesaw.cuh"

namespace vllm::sparse_mla_sm90 {

// Grid (G, 1), any G >= 1 (more than the SMs run in waves), 384 threads, one CTA per SM.
// out [T, H, 512] (bf16 or fp32; heads contiguous: stride_oh must be 512), lse [T, H] fp32;
// ws_o [2G, 64, 512] fp32 and ws_l [2G, 64] the split tokens' partials; counters [2T] int32,
// zero on entry (the merging piece re-zeroes its token's two, so they are zero again on exit).
// PARTIAL_BF16: with bf16 output, a split token's non-merging pieces store their partial O in
// bf16 (store_partial_bf16). The launcher sets it where tokens are split: 1.5-2.5 % faster at
// T=64, where every token is; where none is, the merge code never runs, and the other
// instantiation's register allocation measured 0.5-1 % faster at T=128-1024 (H200).
template <bool PARTIAL_BF16>
__global__ void __launch_bounds__(THREADS, 1) sparse_mla_fp8_sm90_kernel(
    const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ kv,
    const int* __restrict__ idx, void* __restrict__ out, float* __restrict__ lse,
    float* __restrict__ ws_o, float* __restrict__ ws_l, int* __restrict__ counters,
    float scale_log2, int num_heads, int topk, int nb, int num_tokens, long long stride_qt,
    long long stride_qh, long long stride_it, long long stride_ot, long long stride_oh,
    long long stride_lt, int out_fp32) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t sbase = (raw + 1023) & ~1023u;
  uint8_t* smem = smem_raw + (sbase - raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
  const int G = gridDim.x, cta = blockIdx.x;
  const int W = num_tokens * nb;
  const int w0 = range_lo(cta, W, G), w1 = range_lo(cta + 1, W, G);
  const Work wk{idx, stride_it, topk, nb};
  const Bars b{sbase + OFF_BAR, sbase + OFF_BAR + 24, sbase + OFF_BAR + 48, sbase + OFF_BAR + 72};
  if (tid == 0) {
    for (int s = 0; s < NUM_STAGES; ++s) {
      mbar_init(b.full + 8 * s, 132);  // 128 cp.async arrivals + 4 warps publishing their ids
      mbar_init(b.empty + 8 * s, 256);
    }
    for (int s = 0; s < NUM_PBUF; ++s) {
      mbar_init(b.pfull + 8 * s, 128);
      mbar_init(b.pempty + 8 * s, 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  fence_proxy_async();
  __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PROD_REGS));
    producer(kv, wk, w0, w1, smem, sbase, b, warp, lane,
             QueryRef{q, stride_qt, stride_qh, num_heads, num_tokens});
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONS_REGS));
  const int half = wg - 1;
  const int wt = tid - 128 * wg;  // thread within its warpgroup
  const int w = wt >> 5, g = (wt & 31) >> 2, c = wt & 3;
  const int dv0 = 256 * half + 8 * (8 * w + g);
  int* ctl_s = reinterpret_cast<int*>(smem + OFF_CTL);
#pragma unroll 1
  for (int wi = w0;;) {  // one piece per pass: token t, its blocks [b0, b0 + npb)
    if (wi >= piece_at(wi, nb, num_tokens).w1) break;
    float acc[4][32];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int i = 0; i < 32; ++i) acc[j][i] = 0.f;
    {
      float l[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) l[i] = 0.f;
      {
        const Piece pc = piece_at(wi, nb, num_tokens);
        consumer_seesaw(q + (long long)pc.t * stride_qt, stride_qh, num_heads, pc.npb, pc.base,
                        scale_log2, smem, sbase, b, half, wt, acc, l);
      }
      wi = launder(wi);
      // Row sums over this warpgroup's blocks: over the warp's rows, then the 4 warps and both
      // warpgroups (shared memory); the stabiliser is the shared m.
#pragma unroll
      for (int o = 4; o < 32; o <<= 1)
#pragma unroll
        for (int hh = 0; hh < 16; ++hh) l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], o);
      float* red = reinterpret_cast<float*>(smem + OFF_RED);
      float* l_s = reinterpret_cast<float*>(smem + OFF_L);
      const float* m_s = reinterpret_cast<const float*>(smem + OFF_M);
      if (g == 0) {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj)
          *reinterpret_cast<float2*>(red + (4 * half + w) * 64 + 8 * jj + 2 * c) =
              make_float2(l[2 * jj], l[2 * jj + 1]);
      }
      bar_sync(3, 256);
      const Piece pc = piece_at(wi, nb, num_tokens);
      if (wt < 32) {  // heads [32 half, +32): a lane of each warpgroup's first warp each
        const int head = 32 * half + wt;
        float x = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) x += red[i * 64 + head];
        l_s[head] = x;
        const float ls = x > 0.f ? (m_s[head] + __log2f(x)) * 0.6931471805599453f : -INFINITY;
        if (head < num_heads) {
          if (pc.split)
            ws_l[piece_slot(pc.cta, pc.tw, pc.W, pc.G) * 64 + head] = ls;
          else
            lse[pc.t * stride_lt + head] = ls;
        }
      }
      bar_sync(3, 256);
    }
    const float* l_s = reinterpret_cast<const float*>(smem + OFF_L);
    float inv[16];
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
#pragma unroll
      for (int bb = 0; bb < 2; ++bb) {
        const float x = l_s[8 * jj + 2 * c + bb];
        // (rcp.approx: one instruction; the IEEE division is a branchy ~20-instruction sequence
        // per head, 2K cycles of the epilogue)
        inv[2 * jj + bb] = x > 0.f ? rcp_approx(x) : 0.f;
      }
    {  // O accumulated in units of 2^E (E_NONE: nothing had a scale, O is zero)
      const int E = reinterpret_cast<const int*>(smem + OFF_EX)[0];
      const float fe = E == E_NONE ? 0.f : exp2i(E);
#pragma unroll
      for (int i = 0; i < 16; ++i) inv[i] *= fe;
    }
    const Piece pc = piece_at(wi, nb, num_tokens);
    if (!pc.split) {
      if (out_fp32)
        store_out<true>(acc, inv, out, pc.t * stride_ot, num_heads, dv0, c);
      else
        store_out<false>(acc, inv, out, pc.t * stride_ot, num_heads, dv0, c);
    } else {
      // Split token: each piece takes a ticket (arrival order) on counters[2t]. All but the
      // last store their normalised partial and count it on counters[2t + 1]; the last waits
      // for that count (the pieces it waits on have their tickets, so they run and wait on
      // nothing), then merges the others' partials with its own, still in registers. One
      // thread per CTA orders the CTA's stores (the barrier before it) with a gpu-scope fence.
      const int c_a = cta_of(pc.tw, pc.W, pc.G), c_b = cta_of(pc.tw + nb - 1, pc.W, pc.G);
      int* cnt = counters + 2 * pc.t;
      if (wt == 0 && half == 0) ctl_s[0] = atomicAdd(cnt, 1) == c_b - c_a;
      bar_sync(3, 256);
      const bool pbf = PARTIAL_BF16 && !out_fp32;
      if (!ctl_s[0]) {
        float* slot = ws_o + (long long)piece_slot(pc.cta, pc.tw, pc.W, pc.G) * 64 * D_V;
        if (pbf)
          store_partial_bf16(acc, inv, slot, 128 * half + wt);
        else
          store_partial(acc, inv, slot, 128 * half + wt);
        bar_sync(3, 256);
        if (wt == 0 && half == 0) {
          fence_acq_rel_gpu();
          atomicAdd(cnt + 1, 1);
        }
      } else {
        if (wt == 0 && half == 0) {
          while (ld_acquire_gpu(cnt + 1) < c_b - c_a) {
          }
          cnt[0] = 0;  // zero again for the next launch
          cnt[1] = 0;
        }
        bar_sync(3, 256);
        if (pbf)
          merge_pieces<true>(acc, inv, ws_o, ws_l, reinterpret_cast<float*>(smem + OFF_RED), c_a,
                             c_b, pc.cta - c_a, pc.tw, pc.W, pc.G, lse + pc.t * stride_lt,
                             num_heads, 128 * half + wt, c);
        else
          merge_pieces<false>(acc, inv, ws_o, ws_l, reinterpret_cast<float*>(smem + OFF_RED), c_a,
                              c_b, pc.cta - c_a, pc.tw, pc.W, pc.G, lse + pc.t * stride_lt,
                              num_heads, 128 * half + wt, c);
        float one[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) one[i] = 1.f;
        if (out_fp32)
          store_out<true>(acc, one, out, pc.t * stride_ot, num_heads, dv0, c);
        else
          store_out<false>(acc, one, out, pc.t * stride_ot, num_heads, dv0, c);
      }
    }
    wi += pc.npb;
  }
}

}  // namespace vllm::sparse_mla_sm90

// ---- launcher -------------------------------------------------------------------------------------
namespace {

namespace k = vllm::sparse_mla_sm90;

// Once per device: the sm_90 check (the library holds sm_90a code only) and the kernel's dynamic
// shared memory, over the 48 KB default, for both instantiations.
void prepare_device(int device) {
  static std::array<std::once_flag, C10_COMPILE_TIME_MAX_GPUS> once;
  TORCH_CHECK(device >= 0 && device < static_cast<int>(once.size()), "bad device ", device);
  std::call_once(once[device], [device] {
    int major = 0, minor = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    TORCH_CHECK(major == 9 && minor == 0, "sparse_mla_fp8_decode is built for sm_90a (Hopper); ",
                "device ", device, " is sm_", major, minor);
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
  TORCH_CHECK(work < (int64_t{1} << 31), "T * ceil(K / 64) = ", work,
              " work items: the kernel counts them in int32");
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
