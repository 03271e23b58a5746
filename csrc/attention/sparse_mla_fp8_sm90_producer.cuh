// The producer warpgroup of the FP8 sparse-MLA decode kernel for Hopper (sparse_mla_fp8_sm90.cu):
// it gathers each 64-row block's selected rows into a ring of NUM_STAGES raw stages.
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

#include "sparse_mla_fp8_sm90_layout.cuh"
#include "sparse_mla_fp8_sm90_ptx.cuh"

namespace vllm::sparse_mla_sm90 {

// The producer walks this CTA's range of (token, block) work items, w in [w0, w1): token
// w / nb, block w % nb (rows 64 (w % nb) + row of the token's top-k list, -1 past topk). The ids
// of item w + 1 are loaded while item w's copies go out (a dependent global load per block
// otherwise adds its latency to every refill).
struct Work {
  const int* idx;
  long long stride_it;
  int topk, nb;
};
__device__ __forceinline__ int block_id(const Work& wk, int w, int row) {
  const int t = w / wk.nb;
  const int k = (w - t * wk.nb) * BN + row;
  return k < wk.topk ? __ldg(wk.idx + t * wk.stride_it + k) : -1;
}

struct QueryRef {
  const __nv_bfloat16* q;
  long long stride_qt, stride_qh;
  int num_heads, num_tokens;
};
// Once the producer has issued its CTA's last stage: the query (64 head rows of 1152 bytes) and
// the rows of the first 3 blocks of CTA blockIdx.x + #SMs, the CTA likely to start next when the
// grid runs in waves, into L2, so that CTA's prologue reads L2 (its query load measured 12.4K ->
// 11.0K cycles). pt: this producer thread (0..127).
__device__ __forceinline__ void prefetch_next_cta(const uint8_t* __restrict__ kv, const Work& wk,
                                                  const QueryRef& qr, int pt) {
  uint32_t nsm, ncta, cta;
  asm volatile("mov.u32 %0, %%nsmid;" : "=r"(nsm));
  asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(ncta));
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(cta));
  const int nxt = (int)(cta + nsm);
  if (nxt >= (int)ncta) return;
  const int W = qr.num_tokens * wk.nb, G = (int)ncta;
  const int wn = nxt * (W / G) + min(nxt, W - (W / G) * G);  // its first item (range_lo)
  const int t = wn / wk.nb;
  if (pt < qr.num_heads)
    prefetch_l2(qr.q + t * qr.stride_qt + pt * qr.stride_qh, 1152);
  for (int r = pt; r < 3 * BN; r += 128) {
    const int w = wn + r / BN;
    if (w >= W) break;
    const int id = block_id(wk, w, r % BN);
    if (id >= 0) prefetch_l2(kv + (size_t)id * ROW, ROW);
  }
}

// The producer warpgroup's 4 warps, warp pw copying rows 16pw..16pw+15 in 16-byte cp.async pieces
// (41 a row; zero-filled for a -1 id, whose row the consumers mask); `full` expects 128 cp.async
// arrivals plus one plain arrival per warp that publishes its ids. (One warp issuing one
// cp.async.bulk per row measured 5 % slower at 1024 queries: those copies become the limit once
// the consumers are fast enough.)
__device__ __forceinline__ void producer(const uint8_t* __restrict__ kv, const Work& wk, int w0,
                                         int w1, uint8_t* smem, uint32_t sbase, Bars b, int pw,
                                         int lane, const QueryRef& q) {
  int* ids_s = reinterpret_cast<int*>(smem + OFF_IDS);
  int id = w0 < w1 ? block_id(wk, w0, 16 * pw + (lane & 15)) : -1;
  for (int w = w0; w < w1; ++w) {
    const int i = w - w0, st = i % NUM_STAGES;
    const uint32_t ph = (i / NUM_STAGES) & 1;
    mbar_wait(b.empty + 8 * st, ph ^ 1);
    if (lane < 16) ids_s[st * BN + 16 * pw + lane] = id;
    const uint32_t dst0 = sbase + OFF_ST + st * STAGE + 16 * pw * ROW;
#pragma unroll 4
    for (int rr = 0; rr < 16; ++rr) {
      const int r_id = __shfl_sync(0xffffffffu, id, rr);
      const uint8_t* src = kv + (size_t)(r_id < 0 ? 0 : r_id) * ROW;
      const uint32_t nb = r_id < 0 ? 0u : 16u;
      const uint32_t dst = dst0 + rr * ROW;
      cp_async16(dst + 16 * lane, src + 16 * lane, nb);
      if (lane < 9) cp_async16(dst + 16 * (lane + 32), src + 16 * (lane + 32), nb);
    }
    cp_async_arrive_noinc(b.full + 8 * st);
    __syncwarp();
    if (lane == 0) mbar_arrive(b.full + 8 * st);
    if (w + 1 < w1) id = block_id(wk, w + 1, 16 * pw + (lane & 15));
  }
  prefetch_next_cta(kv, wk, q, 32 * pw + lane);
}

}  // namespace vllm::sparse_mla_sm90
