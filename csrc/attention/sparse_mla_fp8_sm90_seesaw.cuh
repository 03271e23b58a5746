// The consumer warpgroups of the FP8 sparse-MLA decode kernel for Hopper
// (sparse_mla_fp8_sm90.cu): the query prologue, then per block QK, the online softmax and PV.
//
// The seesaw: warpgroup h scores blocks j = h, h + 2, ...: S^T[64 rows x 64 heads] (n64), its
// softmax, P^T[j % NUM_PBUF]; both warpgroups run PV of every block on their value half, in block
// order. Per block j of its own: QK_j; wait for the other warpgroup's block j - 1 (pfull) and run
// its PV; softmax_j; PV_j (S stays live across the other block's PV, so QK_j needs only its stage
// and runs while block j - 1's softmax finishes). The stabilisers (m, OFF_M; E, OFF_EX) live in
// shared memory: softmaxes run in block order, so both warpgroups read the same values, and they
// move (rarely) only in the scoring warpgroup's slow path; alpha and the block's flags go with
// P^T. pempty[b]: both warpgroups have retired PV of the block that last used P^T[b] (and
// sigma[b]).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "sparse_mla_fp8_sm90_layout.cuh"
#include "sparse_mla_fp8_sm90_ptx.cuh"

namespace vllm::sparse_mla_sm90 {

// The running max moves (and O is rescaled) only when a block's max exceeds it by more than
// this, in log2 units (the textbook online softmax moves it on every increase).
constexpr float RESCALE_LOG2 = 8.0f;
// The f16 PV's stabiliser E (see pv_f16_ok and the softmax): rows within [E - E_LO, E + E_HI]
// take the f16 PV; E_NONE: no row had a scale yet.
constexpr int E_HI = 13, E_LO = 4, TILE_LO = 11, E_MIN = -100, E_NONE = -1000;

// ---- query prologue -----------------------------------------------------------------------------
// Q^T layout: 9 K-atoms of [64 heads x 128 B], 8192 bytes apart, 128-byte swizzle; element
// (position p, head h) at (p / 64) * 8192 + h * 128 + ((2 (p % 64)) ^ ((h % 8) << 4)). Nope
// feature f = 128 c + 16 mm + 4 i + e goes to k-step 4 ((mm - 2c) & 7) + i, position
// 2c + (e < 2 ? e : e + 6): thread c of a quad then holds features [128c, 128c + 128) of its
// rows, 16 bytes per 4 k-steps, chunk order rotated by 2c so a warp's loads hit distinct banks.
// Rope feature 16 c + 4 i + e goes to k-step 32 + i, the same position.

// max.u16x2: each 16-bit half the larger of the two, unsigned
__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// The largest |value| of v[0..15] (bf16 pairs).
__device__ __forceinline__ float quarter_amax(const uint4 (&v)[18]) {
  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const uint32_t ws[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ws[e]));
      amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
  return amax;
}

// Thread (head h = 32 half + wt / 4, quarter qq = wt % 4) loads its quarter of head h's query:
// v[0..15] the nope values [128 qq, 128 qq + 128), v[16..17] rope dims [16 qq, 16 qq + 16)
// (zeros past num_heads); returns the largest |value| of the nope pieces it staged (only the
// maximum over all 256 threads is the query's). Straight from global memory each of a warp's
// 16-byte loads would touch 32 cache lines (8 heads x 4 quarters); instead the 256 consumer
// threads first copy the query in order (a warp's load is 512 contiguous bytes) into a padded
// [64 heads x RS bytes] staging area in shared memory (Q^T's and the P^T buffers' space: both
// free when a piece starts), then each thread reads its quarter from there. Synchronises the
// consumers.
__device__ __forceinline__ float load_query_quarter(const __nv_bfloat16* __restrict__ qrow,
                                                    long long stride_qh, int num_heads, int half,
                                                    int wt, uint4 (&v)[18], uint8_t* staging) {
  const int hl = wt >> 2, qq = wt & 3, h = 32 * half + hl;
  const bool hv = h < num_heads;
  if (staging != nullptr) {  // always: staging is in shared memory (see the end)
    // Staging row stride: a 16-byte gap after each 256-byte nope quarter, so quarter qq starts
    // 4 qq banks on, and rows 1216 bytes (16 banks mod 32) apart: a quarter-warp's 2 heads x 4
    // quarters cover all 32 banks (the 2 rope loads stay 2-way). Rows of 1168 bytes (no gaps)
    // conflict 4 ways on the read-back: 2.7K against 1.2K cycles a piece, ~1 % at T=64-128.
    constexpr int RS = 1216;
    const int tc = 128 * half + wt;
    uint4 x[18];
#pragma unroll
    for (int i = 0; i < 18; ++i) {  // 16-byte piece g of the [64 heads x 72] query
      const int g = tc + 256 * i, hd = g / 72, pc = g - 72 * hd;
      const uint4* src = reinterpret_cast<const uint4*>(qrow + (long long)hd * stride_qh) + pc;
      x[i] = hd < num_heads ? __ldg(src) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int i = 0; i < 18; ++i) {
    const int g = tc + 256 * i, hd = g / 72, pc = g - 72 * hd;
    *reinterpret_cast<uint4*>(staging + hd * RS + 16 * (pc + (pc >> 4))) = x[i];
  }
  // The largest |value| of the nope pieces this thread loaded (they cover the query once): on
  // the bit patterns, where |bf16| orders as an unsigned 16-bit integer, two at a time. The same
  // value as a float pass over the quarter read back, so the same output bits; 0-1 % faster at
  // T=64-128.
  uint32_t mb = 0;
#pragma unroll
  for (int i = 0; i < 18; ++i) {
    const int g = tc + 256 * i, hd = g / 72, pc = g - 72 * hd;
    const uint32_t keep = pc < 64 ? 0x7fff7fffu : 0u;  // (rope pieces: not in the f16 range)
    const uint32_t ws[4] = {x[i].x, x[i].y, x[i].z, x[i].w};
#pragma unroll
    for (int e = 0; e < 4; ++e) mb = max_u16x2(mb, ws[e] & keep);
  }
  bar_sync(3, 256);
  const uint4* qs = reinterpret_cast<const uint4*>(staging + h * RS);
#pragma unroll
  for (int k = 0; k < 16; ++k) v[k] = qs[17 * qq + k];
#pragma unroll
  for (int k = 0; k < 2; ++k) v[16 + k] = qs[68 + 2 * qq + k];
  return __uint_as_float(max(mb & 0xffffu, mb >> 16) << 16);
  }
  // Never reached. The compiler cannot prove staging non-null, so this unstaged load is part of
  // the compiled kernel, and without it ptxas allocates the registers differently (32 -> 44
  // bytes of spill loads): it stays until a build without it is timed on an H200.
  const uint4* qh = reinterpret_cast<const uint4*>(qrow + (long long)h * stride_qh);
#pragma unroll
  for (int k = 0; k < 16; ++k) v[k] = hv ? __ldg(qh + qq * 16 + k) : make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int k = 0; k < 2; ++k) v[16 + k] = hv ? __ldg(qh + 64 + 2 * qq + k) : make_uint4(0, 0, 0, 0);
  return quarter_amax(v);
}

// The whole query (64 heads) into the shared Q^T; each warpgroup loads its 32 heads; one power
// of two for the query (both warpgroups' amax). Returns the inverse of that power of two.
__device__ __forceinline__ float load_query64(const __nv_bfloat16* __restrict__ qrow,
                                              long long stride_qh, int num_heads, int half,
                                              uint8_t* smem, int wt, int lane, int w) {
  const int hl = wt >> 2, qq = wt & 3, h = 32 * half + hl;
  uint4 v[18];
  float amax = load_query_quarter(qrow, stride_qh, num_heads, half, wt, v, smem + OFF_QT);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  float* misc = reinterpret_cast<float*>(smem + OFF_MISC);
  if (lane == 0) misc[4 * half + w] = amax;
  bar_sync(3, 256);
  // (every consumer thread is past the previous piece's epilogue: its stabilisers can reset)
  if (half == 0 && wt < 64) reinterpret_cast<float*>(smem + OFF_M)[wt] = -INFINITY;
  if (half == 1 && wt == 0) reinterpret_cast<int*>(smem + OFF_EX)[0] = E_NONE;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, misc[i]);
  int eq = amax > 0.f ? 13 - ilog2(amax) : 0;
  eq = eq < -120 ? -120 : (eq > 120 ? 120 : eq);
  const float qf = exp2i(eq);
  uint8_t* row = smem + OFF_QT + h * 128;  // head h of every atom (atoms 8192 bytes apart)
  const int sw = h & 7;
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const uint32_t ws[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
    uint8_t* atom = row + (((k >> 1) - 2 * qq) & 7) * 8192;
#pragma unroll
    for (int e2 = 0; e2 < 4; ++e2) {
      const int r = 8 * (k & 1) + 2 * e2, x = 2 * (r >> 2) + ((r >> 1) & 1);
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ws[e2]));
      *reinterpret_cast<uint32_t*>(atom + (((x ^ sw) << 4) | (4 * qq))) =
          pack_f16(f.x * qf, f.y * qf);
    }
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint32_t ws[4] = {v[16 + k].x, v[16 + k].y, v[16 + k].z, v[16 + k].w};
#pragma unroll
    for (int e2 = 0; e2 < 4; ++e2) {
      const int r = 8 * k + 2 * e2, x = 2 * (r >> 2) + ((r >> 1) & 1);
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ws[e2]));
      *reinterpret_cast<uint32_t*>(row + 8 * 8192 + (((x ^ sw) << 4) | (4 * qq))) =
          pack_bf16(f.x * qf, f.y * qf);
    }
  }
  fence_proxy_async();
  bar_sync(3, 256);
  return exp2i(-eq);
}

// ---- QK -----------------------------------------------------------------------------------------
// Rows r0, r1's 4 tile scales (sa, sb): the largest (mx), its exponent (e) and tile c's.
__device__ __forceinline__ void row_scales(const float4& sa, const float4& sb, int c, float& mx0,
                                           float& mx1, int& e0, int& e1, float& ca, float& cb) {
  mx0 = fmaxf(fmaxf(sa.x, sa.y), fmaxf(sa.z, sa.w));
  mx1 = fmaxf(fmaxf(sb.x, sb.y), fmaxf(sb.z, sb.w));
  e0 = ilog2(mx0);
  e1 = ilog2(mx1);
  ca = c == 0 ? sa.x : (c == 1 ? sa.y : (c == 2 ? sa.z : sa.w));
  cb = c == 0 ? sb.x : (c == 1 ? sb.y : (c == 2 ? sb.z : sb.w));
}

// S^T[64 rows x 64 heads] = K . Q^T: K the A operand in registers (each thread's rows' raw e4m3
// bytes -> f16, exact, times the tile scale over the row's largest power of two), Q^T the B
// operand in shared memory. 4 k-steps (one 16-byte load's worth) per commit group, two groups in
// flight. Also returns the rows' largest tile scales (mx0, mx1), their exponents (e0, e1) and
// this thread's tile c scales (ca, cb).
__device__ __forceinline__ void qk_block64(float (&s)[32], const uint8_t* row0, const uint8_t* row1,
                                           uint32_t dq, int c, int& e0, int& e1, float& mx0,
                                           float& mx1, float& ca, float& cb) {
  const float4 sa = *reinterpret_cast<const float4*>(row0 + 512);
  const float4 sb = *reinterpret_cast<const float4*>(row1 + 512);
  row_scales(sa, sb, c, mx0, mx1, e0, e1, ca, cb);
  const uint32_t h0 = pack_f16(ca * exp2i(-e0), ca * exp2i(-e0));
  const uint32_t h1 = pack_f16(cb * exp2i(-e1), cb * exp2i(-e1));
#pragma unroll
  for (int mm = 0; mm < 8; ++mm) {
    const int off = 128 * c + 16 * ((mm + 2 * c) & 7);
    const uint4 u0 = *reinterpret_cast<const uint4*>(row0 + off);
    const uint4 u1 = *reinterpret_cast<const uint4*>(row1 + off);
    const uint32_t x0[4] = {u0.x, u0.y, u0.z, u0.w};
    const uint32_t x1[4] = {u1.x, u1.y, u1.z, u1.w};
    uint32_t a[4][4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint32_t f0, f1, f2, f3;
      e4m3x4_to_f16x4(x0[k], f0, f2);
      e4m3x4_to_f16x4(x1[k], f1, f3);
      a[k][0] = hmul2(f0, h0);
      a[k][1] = hmul2(f1, h1);
      a[k][2] = hmul2(f2, h0);
      a[k][3] = hmul2(f3, h1);
    }
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int kk = 4 * mm + k;
      wgmma_f16(s, a[k][0], a[k][1], a[k][2], a[k][3],
                desc(dq + (uint32_t)(((kk >> 2) * 8192 + (kk & 3) * 32) >> 4)), kk > 0);
    }
    wgmma_commit();
    if (mm > 0) wgmma_wait<1>();
  }
  const uint4 v00 = *reinterpret_cast<const uint4*>(row0 + 528 + 32 * c);
  const uint4 v01 = *reinterpret_cast<const uint4*>(row0 + 544 + 32 * c);
  const uint4 v10 = *reinterpret_cast<const uint4*>(row1 + 528 + 32 * c);
  const uint4 v11 = *reinterpret_cast<const uint4*>(row1 + 544 + 32 * c);
  const uint32_t y0[8] = {v00.x, v00.y, v00.z, v00.w, v01.x, v01.y, v01.z, v01.w};
  const uint32_t y1[8] = {v10.x, v10.y, v10.z, v10.w, v11.x, v11.y, v11.z, v11.w};
  const uint32_t q0 = ((uint32_t)(127 - e0) << 7) * 0x10001u;
  const uint32_t q1 = ((uint32_t)(127 - e1) << 7) * 0x10001u;
  uint32_t a[4][4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    a[k][0] = bmul2(y0[2 * k], q0);
    a[k][1] = bmul2(y1[2 * k], q1);
    a[k][2] = bmul2(y0[2 * k + 1], q0);
    a[k][3] = bmul2(y1[2 * k + 1], q1);
  }
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < 4; ++k)
    wgmma_bf16(s, a[k][0], a[k][1], a[k][2], a[k][3], desc(dq + (8 * 8192 + 32 * k) / 16), 1);
  wgmma_commit();
  wgmma_wait<0>();
  fence_acc(s);
}

// ---- PV on one half of the value columns --------------------------------------------------------
// O^T[256 dv x 64 heads] += V^T . P^T over the block in stage `stg`. Thread (w, g, c) holds dv
// rows dv0 + 2j + h (tile j, h = 0 for M row g / 1 for g + 8) with dv0 = 256*half + 8*(8w + g),
// so its 8 values of a row are 8 contiguous bytes; K = the block's rows 16kk + {2c,2c+1,2c+8,2c+9}.

// The 8 value bytes [dv0, dv0 + 8) of rows s0, s0 + 1, s0 + 8, s0 + 9 (s0 even)
__device__ __forceinline__ void v_rows(const uint8_t* stg, int s0, int dv0, uint2& r0, uint2& r1,
                                       uint2& r2, uint2& r3) {
  const uint8_t* p0 = stg + s0 * ROW;
  r0 = *reinterpret_cast<const uint2*>(p0 + dv0);
  r1 = *reinterpret_cast<const uint2*>(p0 + ROW + dv0);
  r2 = *reinterpret_cast<const uint2*>(p0 + 8 * ROW + dv0);
  r3 = *reinterpret_cast<const uint2*>(p0 + 9 * ROW + dv0);
}

// The exact PV: V^T = the fp32 product e4m3 x tile scale rounded to bf16, as the reference rounds
// it; P^T in bf16.
__device__ __forceinline__ void pv_block(float (&acc)[4][32], const uint8_t* stg, uint32_t dp,
                                         int half, int w, int g, int c) {
  const int dv0 = 256 * half + 8 * (8 * w + g);
  const int ts = 2 * half + (w >> 1);  // this thread's scale tile
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const int s0 = 16 * kk + 2 * c;
    const uint8_t* p0 = stg + s0 * ROW;
    const uint2 r0 = *reinterpret_cast<const uint2*>(p0 + dv0);
    const uint2 r1 = *reinterpret_cast<const uint2*>(p0 + ROW + dv0);
    const uint2 r2 = *reinterpret_cast<const uint2*>(p0 + 8 * ROW + dv0);
    const uint2 r3 = *reinterpret_cast<const uint2*>(p0 + 9 * ROW + dv0);
    const float c0 = *reinterpret_cast<const float*>(p0 + 512 + 4 * ts);
    const float c1 = *reinterpret_cast<const float*>(p0 + ROW + 512 + 4 * ts);
    const float c2 = *reinterpret_cast<const float*>(p0 + 8 * ROW + 512 + 4 * ts);
    const float c3 = *reinterpret_cast<const float*>(p0 + 9 * ROW + 512 + 4 * ts);
    uint32_t a[4][4];
#pragma unroll
    for (int wi = 0; wi < 2; ++wi) {
      uint32_t f[8];
      v_pairs_f16(wi ? r0.y : r0.x, wi ? r1.y : r1.x, wi ? r2.y : r2.x, wi ? r3.y : r3.x, f);
      a[2 * wi][0] = deq_bf16(f[0], c0, c1);
      a[2 * wi][1] = deq_bf16(f[1], c0, c1);
      a[2 * wi][2] = deq_bf16(f[2], c2, c3);
      a[2 * wi][3] = deq_bf16(f[3], c2, c3);
      a[2 * wi + 1][0] = deq_bf16(f[4], c0, c1);
      a[2 * wi + 1][1] = deq_bf16(f[5], c0, c1);
      a[2 * wi + 1][2] = deq_bf16(f[6], c2, c3);
      a[2 * wi + 1][3] = deq_bf16(f[7], c2, c3);
    }
    const uint64_t dsc = desc(dp + 2 * kk);  // + 32 bytes per k-step
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) wgmma_bf16(acc[j], a[j][0], a[j][1], a[j][2], a[j][3], dsc, 1);
    wgmma_commit();
    if (kk > 0) wgmma_wait<1>();
  }
}

// The f16 PV (the usual one): V^T = e4m3 (exact in f16) x sigma, sigma = the row's tile scale
// over its largest power of two (published by the scoring warpgroup, [4 tiles][64 rows] f16, a
// row pair per 32-bit word), P^T (f16) carries that power of two. 2 instructions per 2 values
// against the exact PV's 5.
__device__ __forceinline__ void pv_block_f16(float (&acc)[4][32], const uint8_t* stg,
                                             const uint8_t* sig, uint32_t dp, int half, int w,
                                             int g, int c) {
  const int dv0 = 256 * half + 8 * (8 * w + g);
  const uint8_t* sg = sig + (2 * half + (w >> 1)) * 128;  // this thread's scale tile
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const int s0 = 16 * kk + 2 * c;
    uint2 r0, r1, r2, r3;
    v_rows(stg, s0, dv0, r0, r1, r2, r3);
    const uint32_t g01 = *reinterpret_cast<const uint32_t*>(sg + 2 * s0);
    const uint32_t g89 = *reinterpret_cast<const uint32_t*>(sg + 2 * s0 + 16);
    uint32_t a[4][4];
#pragma unroll
    for (int wi = 0; wi < 2; ++wi) {
      uint32_t f[8];
      v_pairs_f16(wi ? r0.y : r0.x, wi ? r1.y : r1.x, wi ? r2.y : r2.x, wi ? r3.y : r3.x, f);
      a[2 * wi][0] = hmul2(f[0], g01);
      a[2 * wi][1] = hmul2(f[1], g01);
      a[2 * wi][2] = hmul2(f[2], g89);
      a[2 * wi][3] = hmul2(f[3], g89);
      a[2 * wi + 1][0] = hmul2(f[4], g01);
      a[2 * wi + 1][1] = hmul2(f[5], g01);
      a[2 * wi + 1][2] = hmul2(f[6], g89);
      a[2 * wi + 1][3] = hmul2(f[7], g89);
    }
    const uint64_t dsc = desc(dp + 2 * kk);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) wgmma_f16(acc[j], a[j][0], a[j][1], a[j][2], a[j][3], dsc, 1);
    wgmma_commit();
    if (kk > 0) wgmma_wait<1>();
  }
}

// acc[j][4jj + k] is (dv row, head 8jj + 2c + (k & 1)); alpha[2jj + b] that head's factor.
__device__ __forceinline__ void rescale(float (&d)[32], const float (&alpha)[16]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) d[i] *= alpha[2 * (i >> 2) + (i & 1)];
}

// PV of block j (scored by either warpgroup, whose P^T we have waited for) on this
// warpgroup's value half; then release P^T[j % NUM_PBUF] and the stage. The block's flags:
// bit 0 the stabilisers moved (O *= alpha ef; l took alpha where the block's P^T was awaited),
// bit 1 it takes the exact bf16 PV.
__device__ __forceinline__ void seesaw_pv(float (&acc)[4][32], int j, uint8_t* smem,
                                          uint32_t sbase, Bars b, int half, int w, int g, int c) {
  const int pb = j % NUM_PBUF, st = j % NUM_STAGES;
  mbar_wait(b.full + 8 * st, (j / NUM_STAGES) & 1);  // orders our reads
  const int flags = reinterpret_cast<const int*>(smem + OFF_FLAG)[pb];
  if (flags & 1) {  // uniform: one flag per block
    const float* alpha_s = reinterpret_cast<const float*>(smem + OFF_ALPHA) + pb * 64;
    const float ef = reinterpret_cast<const float*>(smem + OFF_EX)[1 + pb];
    float alpha[16];
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const float2 x = *reinterpret_cast<const float2*>(alpha_s + 8 * jj + 2 * c);
      alpha[2 * jj] = x.x * ef;
      alpha[2 * jj + 1] = x.y * ef;
    }
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) rescale(acc[jj], alpha);
  }
  const uint8_t* stg = smem + OFF_ST + st * STAGE;
  const uint32_t dp = desc_lo(sbase + OFF_PT) + pb * (8192 >> 4);
  // (each variant retires its wgmmas inside its branch: a group in flight across the merge
  // serialises them all)
  if (!(flags & 2)) {
    pv_block_f16(acc, stg, smem + OFF_SIG + pb * 512, dp, half, w, g, c);
    wgmma_wait<0>();
  } else {
    pv_block(acc, stg, dp, half, w, g, c);
    wgmma_wait<0>();
  }
  mbar_arrive(b.pempty + 8 * pb);
  mbar_arrive(b.empty + 8 * st);
}

// ---- softmax ------------------------------------------------------------------------------------
// P^T[64 heads x 64 rows] by stmatrix.trans, rows r0 (r1) of this thread times g0 (g1).
template <bool BF16>
__device__ __forceinline__ void store_pt(uint32_t pt, const float (&s)[32], float g0, float g1,
                                         int w, int lane) {
#pragma unroll
  for (int qq = 0; qq < 4; ++qq) {
    const int hf = qq >> 1, jb = 4 * (qq & 1);
    const int head = 8 * (jb + (lane >> 3)) + (lane & 7);
    const uint32_t addr = pt + head * 128 + ((((2 * w + hf) ^ (head & 7))) << 4);
    const float gr = hf ? g1 : g0;
    uint32_t x[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float lo = s[4 * (jb + u) + 2 * hf] * gr, hi = s[4 * (jb + u) + 2 * hf + 1] * gr;
      x[u] = BF16 ? pack_bf16(lo, hi) : pack_f16(lo, hi);
    }
    stmatrix_x4_trans(addr, x[0], x[1], x[2], x[3]);
  }
}

// p: the row has a scale exponent; tile_ok: this thread's tile scale is within 2^TILE_LO of e.
__device__ __forceinline__ bool pv_f16_ok(bool p, bool tile_ok, int e, int E) {
  return !p || (tile_ok && e <= E + E_HI && e >= E - E_LO);
}

// One piece (a token's blocks base .. base + nblk - 1 of this CTA's range): the query prologue,
// then the blocks. acc and l collect this warpgroup's O^T and row sums against the shared
// stabilisers.
__device__ __forceinline__ void consumer_seesaw(const __nv_bfloat16* __restrict__ qrow,
                                                long long stride_qh, int num_heads, int nblk,
                                                int base, float scale_log2, uint8_t* smem,
                                                uint32_t sbase, Bars b, int half, int wt,
                                                float (&acc)[4][32], float (&l)[16]) {
  const int w = wt >> 5, lane = wt & 31, g = lane >> 2, c = lane & 3;
  const float base_f =
      scale_log2 * load_query64(qrow, stride_qh, num_heads, half, smem, wt, lane, w);
  const uint32_t dq = desc_lo(sbase + OFF_QT);
  const int r0 = 16 * w + g, r1 = r0 + 8;
  const int* ids_s = reinterpret_cast<const int*>(smem + OFF_IDS);
  float* m_s = reinterpret_cast<float*>(smem + OFF_M);
  float* red_s = reinterpret_cast<float*>(smem + OFF_RED);
  float* alpha_s = reinterpret_cast<float*>(smem + OFF_ALPHA);
  int* flag_s = reinterpret_cast<int*>(smem + OFF_FLAG);
  int* ex_s = reinterpret_cast<int*>(smem + OFF_EX);  // E, ef[3] (f32), emax[2][4]
  // The piece's blocks j = 0 .. nblk - 1 are the CTA's blocks base + j (stages, P^T buffers and
  // their barriers' phases count those); warpgroup h scores those with (base + j) % 2 == h.
#pragma unroll 1
  for (int j = (half + base) & 1; j <= nblk; j += 2) {
    const int gj = base + j;
    // Our block j (none when j == nblk: only the other warpgroup's last block is left). Its QK
    // needs only the stage, so it runs before we wait for the other warpgroup's block j - 1
    // (whose softmax publishes the stabilisers ours starts from); the softmaxes alternate
    // between the warpgroups in block order, and the PVs (the other's block j - 1, then ours)
    // come after our P^T is out, so the other warpgroup's next softmax can start.
    const bool own = j < nblk;
    const int st = gj % NUM_STAGES, pb = gj % NUM_PBUF;
    float s[32];
    int e0 = 0, e1 = 0;
    bool p0 = false, p1 = false, t0 = true, t1 = true;
    if (own) {
      const uint8_t* stg = smem + OFF_ST + st * STAGE;
      mbar_wait(b.full + 8 * st, (gj / NUM_STAGES) & 1);
      float mx0, mx1, ca, cb;
      qk_block64(s, stg + r0 * ROW, stg + r1 * ROW, dq, c, e0, e1, mx0, mx1, ca, cb);
      const bool v0 = ids_s[st * BN + r0] >= 0, v1 = ids_s[st * BN + r1] >= 0;
      p0 = v0 && mx0 > 0.f;  // rows with a scale exponent
      p1 = v1 && mx1 > 0.f;
      t0 = !(ca > 0.f && ilog2(ca) < e0 - TILE_LO);
      t1 = !(cb > 0.f && ilog2(cb) < e1 - TILE_LO);
      // P^T[pb] and sigma[pb] were last read by PV of block j - 3, by both warpgroups (long
      // done: the other warpgroup ran it before its PV of block j - 2)
      mbar_wait(b.pempty + 8 * pb, ((gj / NUM_PBUF) & 1) ^ 1);
      __half* sig = reinterpret_cast<__half*>(smem + OFF_SIG + pb * 512) + 64 * c;
      sig[r0] = __float2half_rn(p0 ? ca * exp2i(min(6 - e0, 127)) : 0.f);
      sig[r1] = __float2half_rn(p1 ? cb * exp2i(min(6 - e1, 127)) : 0.f);
      const float f0 = base_f * exp2i(e0), f1 = base_f * exp2i(e1);
#pragma unroll
      for (int jj = 0; jj < 8; ++jj)
#pragma unroll
        for (int bb = 0; bb < 2; ++bb) {
          s[4 * jj + bb] = v0 ? s[4 * jj + bb] * f0 : -INFINITY;
          s[4 * jj + 2 + bb] = v1 ? s[4 * jj + 2 + bb] * f1 : -INFINITY;
        }
    }
    // the other warpgroup's block j - 1: its P^T and stabilisers; l takes alpha; its PV
    if (j > 0) {
      const int qb = (gj - 1) % NUM_PBUF;
      mbar_wait(b.pfull + 8 * qb, ((gj - 1) / NUM_PBUF) & 1);
      if (flag_s[qb] & 1) {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const float2 x = *reinterpret_cast<const float2*>(alpha_s + qb * 64 + 8 * jj + 2 * c);
          l[2 * jj] *= x.x;
          l[2 * jj + 1] *= x.y;
        }
      }
      seesaw_pv(acc, gj - 1, smem, sbase, b, half, w, g, c);
    }
    if (own) {
      int E = ex_s[0];
      // Fast check, no per-head state kept: does any row maximum pass m + 2^RESCALE_LOG2, or
      // any row leave the f16 PV's range?
      bool over = !(pv_f16_ok(p0, t0, e0, E) && pv_f16_ok(p1, t1, e1, E));
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const float2 x = *reinterpret_cast<const float2*>(m_s + 8 * jj + 2 * c);
#pragma unroll
        for (int bb = 0; bb < 2; ++bb)
          over |= fmaxf(s[4 * jj + bb], s[4 * jj + 2 + bb]) > (bb ? x.y : x.x) + RESCALE_LOG2;
      }
      const bool moved = bar_red_or(1 + half, 128, over);
      bool exact = false;
      float ef = 1.f;
      const float* m_use = m_s;  // the stabiliser this block's P uses
      if (moved) {
        // The rare path: per head, the block's maximum over the warpgroup's rows (warp shuffles,
        // then the 4 warps through red); the new m and alpha go to OFF_L (staging: m_s is read
        // until every warp is past the barrier) and alpha_s; l takes alpha here.
        float* red = red_s + half * 256;
#pragma unroll
        for (int hh = 0; hh < 16; ++hh) {
          float mb = fmaxf(s[4 * (hh >> 1) + (hh & 1)], s[4 * (hh >> 1) + 2 + (hh & 1)]);
#pragma unroll
          for (int o = 4; o < 32; o <<= 1) mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, o));
          if (g == 0) red[w * 64 + 8 * (hh >> 1) + 2 * c + (hh & 1)] = mb;
        }
        const int ev = __reduce_max_sync(0xffffffffu, max(p0 ? e0 : E_NONE, p1 ? e1 : E_NONE));
        if (lane == 0) ex_s[4 + 4 * half + w] = ev;
        bar_sync(1 + half, 128);
        float* mnew_s = reinterpret_cast<float*>(smem + OFF_L);
#pragma unroll
        for (int hh = 0; hh < 16; ++hh) {
          const int hd = 8 * (hh >> 1) + 2 * c + (hh & 1);
          const float mb =
              fmaxf(fmaxf(red[hd], red[64 + hd]), fmaxf(red[128 + hd], red[192 + hd]));
          const float mo = m_s[hd];
          const bool up = mb > mo + RESCALE_LOG2;
          const float al = up && mo != -INFINITY ? ex2(mo - mb) : 1.f;
          l[hh] *= al;
          if (w == 0 && g == 0) {
            mnew_s[hd] = up ? mb : mo;
            alpha_s[pb * 64 + hd] = al;
          }
        }
        const int* er = ex_s + 4 + 4 * half;
        const int emax = max(max(er[0], er[1]), max(er[2], er[3]));
        const int En = emax > E + E_HI ? max(emax - 6, E_MIN) : E;
        ef = exp2i(max(E - En, -127));
        E = En;
        // (also: every warp has read m_s, red and emax, and the staged m is written)
        exact =
            bar_red_or(1 + half, 128, !(pv_f16_ok(p0, t0, e0, E) && pv_f16_ok(p1, t1, e1, E)));
        m_use = mnew_s;
        if (w == 0 && g == 0) {
#pragma unroll
          for (int jj = 0; jj < 8; ++jj)
            *reinterpret_cast<float2*>(m_s + 8 * jj + 2 * c) =
                *reinterpret_cast<const float2*>(mnew_s + 8 * jj + 2 * c);
        }
        if (wt == 0) ex_s[0] = E;
      }
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const float2 x = *reinterpret_cast<const float2*>(m_use + 8 * jj + 2 * c);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float mk = (k & 1) ? x.y : x.x;
          s[4 * jj + k] = ex2(s[4 * jj + k] - (mk == -INFINITY ? 0.f : mk));
        }
#pragma unroll
        for (int bb = 0; bb < 2; ++bb) l[2 * jj + bb] += s[4 * jj + bb] + s[4 * jj + 2 + bb];
      }
      // P^T's factors: 2^(e_k - 6 - E) for the f16 PV, 2^-E for the exact one (E >= E_MIN there)
      const float ge = exp2i(min(-E, 127));
      const float g0 = exact ? ge : (p0 ? exp2i(max(e0 - 6 - E, -127)) : 0.f);
      const float g1 = exact ? ge : (p1 ? exp2i(max(e1 - 6 - E, -127)) : 0.f);
      const uint32_t pt = sbase + OFF_PT + pb * 8192;
      if (exact)
        store_pt<true>(pt, s, g0, g1, w, lane);
      else
        store_pt<false>(pt, s, g0, g1, w, lane);
      if (wt == 0) {
        flag_s[pb] = (moved ? 1 : 0) | (exact ? 2 : 0);
        reinterpret_cast<float*>(ex_s)[1 + pb] = ef;
      }
      fence_proxy_async();
      mbar_arrive(b.pfull + 8 * pb);
      bar_sync(1 + half, 128);  // this warpgroup's PV reads every warp's part of P^T
    }
    // PV in block order, from one call site (two inlined PV variants per call site serialise
    // the wgmmas): the other warpgroup's block j - 1, then ours
    if (own) seesaw_pv(acc, gj, smem, sbase, b, half, w, g, c);
  }
}

}  // namespace vllm::sparse_mla_sm90
