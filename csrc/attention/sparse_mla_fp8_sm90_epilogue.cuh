// The epilogue of the FP8 sparse-MLA decode kernel for Hopper (sparse_mla_fp8_sm90.cu): the
// work split between CTAs, the output stores, and the merge of tokens cut between CTAs.
//
// The W = T * nb (token, 64-row block) items are cut into G = gridDim.x contiguous ranges, the
// first W % G of ceil(W / G) items, the others of floor(W / G). A token cut by a range boundary
// is a split token: each of its pieces takes a ticket on the token's first counter; all but the
// last to arrive write their normalised partial (O in bf16 or fp32, see store_partial_bf16; the
// natural-log LSE in fp32) to a workspace slot and count it on the second counter; the last waits
// for that count and merges the others' partials with its own, which never leaves its registers.
// Only the last piece waits, and only for pieces that already hold tickets (so are running and
// wait on nothing): any number of CTAs may be resident at once. Each cut costs a second query
// prologue, a pipeline restart and the merge, so the default grid cuts tokens only to fill the
// SMs at small T.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "sparse_mla_fp8_sm90_layout.cuh"
#include "sparse_mla_fp8_sm90_ptx.cuh"

namespace vllm::sparse_mla_sm90 {

// ---- output -------------------------------------------------------------------------------------
// Writes this thread's O^T values for its 16 heads: out[head, dv0 .. dv0+8), head rows D_V
// elements apart (the launcher's out is contiguous [T, H, 512]).
// The stores are at constant offsets from one base address. ALL: num_heads == 64, no per-head
// test. (With a test per head, each head is a branch of its own and ptxas staged every 16-byte
// store through the same 4 registers and a fresh address register: each head's packing then
// waited on the long scoreboard for the previous store to have read them. 32-bit stores, which
// need no staging, were slower from T=256 up.)
template <bool FP32, bool ALL>
__device__ __forceinline__ void store_out_heads(const float (&acc)[4][32], const float (&inv)[16],
                                                void* out, long long base, int num_heads, int dv0,
                                                int c) {
  const long long o = base + 2 * c * D_V + dv0;  // head 2c's first value
#pragma unroll
  for (int jj = 0; jj < 8; ++jj)
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int dh = 8 * jj + b;  // head 2c + dh
      if (!ALL && 2 * c + dh >= num_heads) continue;
      const float f = inv[2 * jj + b];
      float x[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        x[2 * j] = acc[j][4 * jj + b] * f;
        x[2 * j + 1] = acc[j][4 * jj + 2 + b] * f;
      }
      if (FP32) {
        float4* p = reinterpret_cast<float4*>(reinterpret_cast<float*>(out) + o + dh * D_V);
        p[0] = make_float4(x[0], x[1], x[2], x[3]);
        p[1] = make_float4(x[4], x[5], x[6], x[7]);
      } else {
        *reinterpret_cast<uint4*>(reinterpret_cast<__nv_bfloat16*>(out) + o + dh * D_V) =
            make_uint4(pack_bf16(x[0], x[1]), pack_bf16(x[2], x[3]), pack_bf16(x[4], x[5]),
                       pack_bf16(x[6], x[7]));
      }
    }
}

template <bool FP32>
__device__ __forceinline__ void store_out(const float (&acc)[4][32], const float (&inv)[16],
                                          void* out, long long base, int num_heads, int dv0,
                                          int c) {
  if (num_heads == 64)
    store_out_heads<FP32, true>(acc, inv, out, base, num_heads, dv0, c);
  else
    store_out_heads<FP32, false>(acc, inv, out, base, num_heads, dv0, c);
}

// ---- work split ---------------------------------------------------------------------------------
// (32-bit: the launcher keeps W < 2^31; a 64-bit division is a long software routine)
__device__ __forceinline__ int range_lo(int c, int W, int G) {
  const int q = W / G, r = W - q * G;
  return c * q + min(c, r);
}
__device__ __forceinline__ int cta_of(int w, int W, int G) {
  const int q = W / G, r = W - q * G, head = r * (q + 1);
  return w < head ? w / (q + 1) : r + (w - head) / q;
}
// CTA c's piece of the token whose first item is tw: slot 2c if the piece starts c's range,
// 2c + 1 if it ends it (a CTA has at most one split piece of each kind).
__device__ __forceinline__ int piece_slot(int c, int tw, int W, int G) {
  return 2 * c + (range_lo(c, W, G) >= tw ? 0 : 1);
}

// The piece starting at item wi of this CTA's range. Computed again after the piece's blocks
// from a laundered wi and the grid registers, so none of it stays live (spilled) across them.
struct Piece {
  int t, tw, npb, base, w1, G, cta;
  int W;
  bool split;
};
__device__ __forceinline__ Piece piece_at(int wi, int nb, int num_tokens) {
  Piece p;
  asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(p.G));
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(p.cta));
  p.W = num_tokens * nb;
  p.w1 = range_lo(p.cta + 1, p.W, p.G);
  p.base = wi - range_lo(p.cta, p.W, p.G);
  p.t = wi / nb;
  p.tw = p.t * nb;
  p.npb = min(nb - (wi - p.tw), p.w1 - wi);
  p.split = p.npb < nb;
  return p;
}
__device__ __forceinline__ int launder(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// ---- split tokens -------------------------------------------------------------------------------
// A split piece's partial, normalised O (acc * inv) in the accumulators' own layout: slot
// [32][256 threads] float4, value q of consumer thread tc = acc[q / 8][4 (q % 8) .. + 4) (heads
// 8 (q % 8) + 2c + {0, 1, 0, 1}), which is also the merging thread's own. Each store takes 4
// consecutive accumulator registers and a warp writes 512 contiguous bytes.
__device__ __forceinline__ void store_partial(float (&acc)[4][32], const float (&inv)[16],
                                              float* __restrict__ slot, int tc) {
  float4* dst = reinterpret_cast<float4*>(slot) + tc;
#pragma unroll
  for (int q = 0; q < 32; ++q) {
    const int j = q >> 3, jj = q & 7;
    float* a = acc[j] + 4 * jj;
    a[0] *= inv[2 * jj];
    a[1] *= inv[2 * jj + 1];
    a[2] *= inv[2 * jj];
    a[3] *= inv[2 * jj + 1];
    __stcg(dst + 256 * q, make_float4(a[0], a[1], a[2], a[3]));
  }
}
// The bf16 partial (bf16 output where the kernel's PARTIAL_BF16 is set): slot [16][256 threads]
// uint4, value p of thread tc the bf16 of values 2p and 2p + 1 of the fp32 layout (a warp writes
// 512 contiguous bytes). 64 KB a piece instead of 128 KB, at the cost of one more bf16 rounding
// of a partial before the output's own.
__device__ __forceinline__ void store_partial_bf16(float (&acc)[4][32], const float (&inv)[16],
                                                   float* __restrict__ slot, int tc) {
  uint4* dst = reinterpret_cast<uint4*>(slot) + tc;
#pragma unroll
  for (int p = 0; p < 16; ++p) {
    const int j = p >> 2, jj = 2 * (p & 3);
    const float* a = acc[j] + 4 * jj;
    const float f0 = inv[2 * jj], f1 = inv[2 * jj + 1], g0 = inv[2 * jj + 2], g1 = inv[2 * jj + 3];
    __stcg(dst + 256 * p,
           make_uint4(pack_bf16(a[0] * f0, a[1] * f1), pack_bf16(a[2] * f0, a[3] * f1),
                      pack_bf16(a[4] * g0, a[5] * g1), pack_bf16(a[6] * g0, a[7] * g1)));
  }
}

// acc += the bf16 partial x (store_partial_bf16's layout) weighted per head by wk
__device__ __forceinline__ void add_partial_bf16(float (&acc)[4][32], const uint4 (&x)[16],
                                                 const float* wk) {
#pragma unroll
  for (int p = 0; p < 16; ++p) {
    const int j = p >> 2, jj = 2 * (p & 3);
    const uint32_t u[4] = {x[p].x, x[p].y, x[p].z, x[p].w};
    float* a = acc[j] + 4 * jj;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float lo = __uint_as_float(u[e] << 16), hi = __uint_as_float(u[e] & 0xffff0000u);
      const int hd = 8 * (jj + (e >> 1));  // head offset of values 2e, 2e + 1
      a[2 * e] += wk[hd] * lo;
      a[2 * e + 1] += wk[hd + 1] * hi;
    }
  }
}

// The last piece of a split token to arrive merges the partials of all its pieces (slots of
// CTAs c_a..c_b; at most MAX_PIECES, which the launcher's grid size ensures) into acc, in piece
// order, and writes the token's LSE. Every piece, the merging one included, stored its normalised
// partial, so the result does not depend on the order of arrival. Every load of a phase is
// independent of the others, so each costs about one L2 latency: (a) the pieces' LSEs into wts
// [MAX_PIECES][64] (shared), (b) per head, the LSE and each piece's weight, (c) acc = the
// weighted sum of the pieces' normalised partials. BF16: the partials are store_partial_bf16's.
template <bool BF16>
__device__ __forceinline__ void merge_pieces(float (&acc)[4][32], const float* __restrict__ ws_o,
                                             const float* __restrict__ ws_l, float* wts, int c_a,
                                             int c_b, int tw, int W, int G, float* lse,
                                             int num_heads, int tc, int c) {
  const int np = c_b - c_a + 1;
  // BF16: the first EARLY of the 16 loads of the first piece's partial are issued before the
  // weights (they do not depend on them); all 16 make the kernel spill.
  constexpr int EARLY = 8;
  uint4 x[16];
  if constexpr (BF16) {
    const uint4* src =
        reinterpret_cast<const uint4*>(ws_o + (long long)piece_slot(c_a, tw, W, G) * 64 * D_V) +
        tc;
#pragma unroll
    for (int p = 0; p < EARLY; ++p) x[p] = __ldcg(src + 256 * p);
  }
  for (int i = tc; i < np * 64; i += 256)
    wts[i] = __ldcg(ws_l + piece_slot(c_a + (i >> 6), tw, W, G) * 64 + (i & 63));
  bar_sync(3, 256);
  if (tc < 64) {
    float mx = -INFINITY, sum = 0.f;
    for (int k = 0; k < np; ++k) mx = fmaxf(mx, wts[64 * k + tc]);
    for (int k = 0; k < np; ++k) sum += mx == -INFINITY ? 0.f : __expf(wts[64 * k + tc] - mx);
    const float r = sum > 0.f ? 1.f / sum : 0.f;
    for (int k = 0; k < np; ++k)
      wts[64 * k + tc] = mx == -INFINITY ? 0.f : __expf(wts[64 * k + tc] - mx) * r;
    if (tc < num_heads) lse[tc] = sum > 0.f ? mx + __logf(sum) : -INFINITY;
  }
  bar_sync(3, 256);
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[j][i] = 0.f;
  if constexpr (BF16) {
    for (int k = 0; k < np; ++k) {
      const uint4* src = reinterpret_cast<const uint4*>(
                             ws_o + (long long)piece_slot(c_a + k, tw, W, G) * 64 * D_V) + tc;
#pragma unroll
      for (int p = 0; p < 16; ++p)
        if (k != 0 || p >= EARLY) x[p] = __ldcg(src + 256 * p);
      add_partial_bf16(acc, x, wts + 64 * k + 2 * c);
    }
  } else {
    for (int k = 0; k < np; ++k) {
      const float4* src = reinterpret_cast<const float4*>(
                              ws_o + (long long)piece_slot(c_a + k, tw, W, G) * 64 * D_V) + tc;
      const float* wk = wts + 64 * k + 2 * c;
#pragma unroll
      for (int q = 0; q < 32; ++q) {
        const int j = q >> 3, jj = q & 7;
        const float4 x = __ldcg(src + 256 * q);
        const float w0 = wk[8 * jj], w1 = wk[8 * jj + 1];
        float* a = acc[j] + 4 * jj;
        a[0] += w0 * x.x;
        a[1] += w1 * x.y;
        a[2] += w0 * x.z;
        a[3] += w1 * x.w;
      }
    }
  }
}

}  // namespace vllm::sparse_mla_sm90
