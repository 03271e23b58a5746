// The FP8 sparse-MLA decode kernel for Hopper (sm_90a): warpgroup 0 produces
// (sparse_mla_fp8_sm90_producer.cuh), warpgroups 1 and 2 consume (sparse_mla_fp8_sm90_seesaw.cuh)
// and store or merge each token (sparse_mla_fp8_sm90_epilogue.cuh). The design and the shapes:
// sparse_mla_fp8_sm90.cu, which launches it.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

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
      // Split token: every piece stores its normalised partial, then takes a ticket (arrival
      // order) on counters[2t]. All but the last count themselves on counters[2t + 1]; the last
      // waits for that count (the pieces it waits on have stored and taken their tickets, so
      // they wait on nothing), then merges every piece's partial from memory in piece order,
      // its own included: the sum, and each partial's rounding, do not depend on which piece
      // arrives last, so a launch is deterministic. One thread per CTA orders the CTA's stores
      // (the barrier before it) with a gpu-scope fence before its ticket.
      const int c_a = cta_of(pc.tw, pc.W, pc.G), c_b = cta_of(pc.tw + nb - 1, pc.W, pc.G);
      int* cnt = counters + 2 * pc.t;
      const bool pbf = PARTIAL_BF16 && !out_fp32;
      float* slot = ws_o + (long long)piece_slot(pc.cta, pc.tw, pc.W, pc.G) * 64 * D_V;
      if (pbf)
        store_partial_bf16(acc, inv, slot, 128 * half + wt);
      else
        store_partial(acc, inv, slot, 128 * half + wt);
      bar_sync(3, 256);
      if (wt == 0 && half == 0) {
        fence_acq_rel_gpu();
        const bool last = atomicAdd(cnt, 1) == c_b - c_a;
        ctl_s[0] = last;
        if (!last) {
          atomicAdd(cnt + 1, 1);
        } else {
          while (ld_acquire_gpu(cnt + 1) < c_b - c_a) {
          }
          cnt[0] = 0;  // zero again for the next launch
          cnt[1] = 0;
        }
      }
      bar_sync(3, 256);
      if (ctl_s[0]) {
        if (pbf)
          merge_pieces<true>(acc, ws_o, ws_l, reinterpret_cast<float*>(smem + OFF_RED), c_a, c_b,
                             pc.tw, pc.W, pc.G, lse + pc.t * stride_lt, num_heads, 128 * half + wt,
                             c);
        else
          merge_pieces<false>(acc, ws_o, ws_l, reinterpret_cast<float*>(smem + OFF_RED), c_a, c_b,
                              pc.tw, pc.W, pc.G, lse + pc.t * stride_lt, num_heads,
                              128 * half + wt, c);
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
