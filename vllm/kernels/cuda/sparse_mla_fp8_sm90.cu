// Sparse-MLA decode over fp8_ds_mla rows for Hopper (sm_90a), in CUDA C++.
//
// Same function as vllm.kernels.sparse_mla_fwd (one query token, all of its <= 64 heads, one
// slice of its top-k list per CTA) at GLM-5.3's dims: kv_lora 512 (e4m3 + 4 fp32 tile scales),
// rope 64 (bf16); a row is 656 bytes. What differs from the Gluon kernel (sparse_mla_ws.py) is
// where the FP8 rows are dequantised: never into shared memory.
//
// The default build (the knobs below select the others):
// - Producer warpgroup (warpgroup 0, 40 registers; PRODUCER_CPASYNC 1): its 4 warps copy each
//   64-row block's selected rows in 16-byte cp.async pieces into a ring of NUM_STAGES raw stages
//   (a -1 id is zero-filled and masked). PRODUCER_CPASYNC 0: one warp, one cp.async.bulk per row
//   (5 % slower at 1024 queries: the per-row bulk copies become the limit once the consumers are
//   fast enough).
// - Two consumer warpgroups (232 registers each) that score alternate blocks (SCHEDULE_SEESAW,
//   consumer_seesaw in sparse_mla_fp8_seesaw.cuh). For its block j, warpgroup j % 2:
//   - S^T = K . Q^T for all 64 heads: M = the block's 64 rows, N = 64 heads. K is the wgmma A
//     operand *in registers*: each thread loads its rows' raw bytes from the stage and converts
//     e4m3 -> f16 (exact) times the tile scale normalised by the row's largest scale (2^-e_row,
//     undone in the softmax); Q^T (f16, times a power of two so it fits f16) is B in shared
//     memory. The 576 features are permuted (the same permutation on Q) so each thread reads 16
//     contiguous bytes per row per 4 k-steps, conflict-free. The rope part is a bf16 wgmma into
//     the same fp32 accumulator.
//   - Online base-2 softmax. The stabiliser m is shared by both warpgroups (softmaxes run in
//     block order) and moves only when a row exceeds it by 2^RESCALE_LOG2: one barrier-with-OR
//     per block decides; only then are the row maxima reduced and alpha published. P^T goes to
//     shared memory by stmatrix.trans (one of NUM_PBUF buffers), with the block's flags.
//   - Both warpgroups then run PV of every block in block order, each on its value columns
//     [256h, 256h + 256) for all 64 heads (4 m64 tiles x 64 heads = 128 fp32 registers):
//     O^T += V^T . P^T, V^T the A operand in registers. PV_F16: V^T in f16 (e4m3 times the
//     tile scale over the row's largest power of two, which P^T carries against a second
//     CTA-wide stabiliser 2^E), with an exact bf16 PV for blocks whose scales f16 cannot hold.
//   The row sums l come from the softmax; the epilogue reduces them across warps and
//   warpgroups, normalises O and writes it and the LSE.
// SCHEDULE_SEESAW 0 (the consumer below, the first design): both warpgroups score every block,
// 32 heads each, and run PV on their value half with exact bf16 V.
// Files: this one (layout, producers, PV, the SCHEDULE_SEESAW 0 consumer, the kernel), the PTX
// wrappers in sparse_mla_sm90_ptx.cuh, the seesaw consumer in sparse_mla_fp8_seesaw.cuh.
// Measurements, the profile and what limits it: BENCHMARKS.md, twelfth and thirteenth sessions.
//
// Shapes: q [T, H<=64, 576] bf16; kv [rows, 656] uint8; idx [T, K] int32 (-1 = none);
// out [splits, T, H, 512] (bf16 or fp32), lse [splits, T, H] fp32 natural log (-inf, zeros for a
// slice with no valid row). Grid (T, splits), 384 threads, one CTA per SM.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// Build-time knobs (nvcc -D...), timed against each other by benchmarks/kernels/bench_sparse_mla_decode.py:
// PRODUCER_CPASYNC: how the raw rows reach shared memory (see the producers below).
// QK_KSTEPS: k-steps per wgmma group in QK (the A registers of two groups are live).
#ifndef PRODUCER_CPASYNC
#define PRODUCER_CPASYNC 1
#endif
// SCHEDULE_SEESAW 1: the warpgroups score alternate blocks for all 64 heads (see
// consumer_seesaw); 0: both score each block, 32 heads each (consumer).
#ifndef SCHEDULE_SEESAW
#define SCHEDULE_SEESAW 1
#endif
// PV_F16 (seesaw only) 1: PV in f16 (V = e4m3 x the tile scale over the row's largest, P times
// that largest over the block's stabiliser 2^E), falling back to the exact bf16 PV for a block
// whose scales the f16 range cannot hold (see consumer_seesaw); 0: always the exact bf16 PV.
#ifndef PV_F16
#define PV_F16 1
#endif
// SEESAW_ORDER (seesaw only): 1: per own block j, QK_j, then PV of the other warpgroup's block
// j - 1 (S live across it), softmax_j, PV_j; 0: QK_j, softmax_j, then both PVs; 2: PV of block
// j - 1 first (no S live across it, but QK_j waits for block j - 1's softmax), QK_j, softmax_j,
// PV_j.
#ifndef SEESAW_ORDER
#define SEESAW_ORDER 1
#endif
#ifndef QK_KSTEPS
#define QK_KSTEPS 4
#endif
// RESCALE_LOG2: the running max moves (and O is rescaled) only when a block's max exceeds it by
// more than this, in log2 units (0: every increase, the textbook online softmax).
#ifndef RESCALE_LOG2
#define RESCALE_LOG2 8.0f
#endif

namespace {

constexpr int ROW = 656;        // fp8_ds_mla row bytes
constexpr int BN = 64;          // rows per block
constexpr int NUM_STAGES = 3;
constexpr int STAGE = BN * ROW; // 41984
constexpr int NUM_PBUF = 3;     // P^T buffers (the default consumer uses two)
constexpr int QT_HALF = 9 * 4096;                        // a warpgroup's Q^T: 9 x [32 heads x 128 B]
constexpr int OFF_QT = 0;
constexpr int OFF_PT = OFF_QT + 9 * 8192;                // P^T: NUM_PBUF x [64 heads x 128 B]
constexpr int OFF_ST = OFF_PT + NUM_PBUF * 8192;         // raw stages
constexpr int OFF_IDS = OFF_ST + NUM_STAGES * STAGE;     // [stages][64] int32
constexpr int OFF_RED = OFF_IDS + NUM_STAGES * BN * 4;   // [2 bufs][2 halves][4 warps][32] f32
constexpr int OFF_ALPHA = OFF_RED + 2 * 4 * 64 * 4;      // [NUM_PBUF][64] f32
constexpr int OFF_L = OFF_ALPHA + NUM_PBUF * 64 * 4;     // [64] f32
constexpr int OFF_MISC = OFF_L + 64 * 4;                 // [16] f32
constexpr int OFF_BAR = OFF_MISC + 64;                   // full, empty [3]; pfull, pempty [3]
constexpr int OFF_M = OFF_BAR + 12 * 8;                  // [64] f32 (seesaw: shared max)
constexpr int OFF_FLAG = OFF_M + 64 * 4;                 // [4] int32 (seesaw: max moved)
constexpr int OFF_SIG = OFF_FLAG + 16;                   // seesaw f16 PV: [3][4 tiles][64] f16
constexpr int OFF_EX = OFF_SIG + NUM_PBUF * 4 * 64 * 2;  // seesaw f16 PV: E, ef[3], [2][4] emax
constexpr int SMEM_BYTES = OFF_EX + 48;
[[maybe_unused]] constexpr int SMEM_ALLOC = SMEM_BYTES + 1024;  // + alignment room; the launcher's size

static_assert(OFF_PT % 1024 == 0 && OFF_ST % 16 == 0 && OFF_BAR % 8 == 0, "alignment");

#include "sparse_mla_sm90_ptx.cuh"

// Q^T layout (a warpgroup's region): 9 K-atoms of [32 heads x 128 B], 128-byte swizzle; element
// (position p, head h) at (p / 64) * 4096 + h * 128 + ((2 (p % 64)) ^ ((h % 8) << 4)). Nope
// feature f = 128 c + 16 mm + 4 i + e goes to k-step 4 ((mm - 2c) & 7) + i, position
// 2c + (e < 2 ? e : e + 6): thread c of a quad then holds features [128c, 128c + 128) of its
// rows, 16 bytes per 4 k-steps, chunk order rotated by 2c so a warp's loads hit distinct banks.
// Rope feature 16 c + 4 i + e goes to k-step 32 + i, the same position.

struct Bars {
  uint32_t full, empty, pfull, pempty;  // base addresses; +8 per index
};

// ---- producer -------------------------------------------------------------------------------
// The ids of block i + 1 are loaded while block i's copies go out (a dependent global load per
// block otherwise adds its latency to every refill).
__device__ __forceinline__ int block_id(const int* __restrict__ idx_row, int k_lo, int k_hi,
                                        int i, int row) {
  const int k = k_lo + i * BN + row;
  return k < k_hi ? __ldg(idx_row + k) : -1;
}

// PRODUCER_CPASYNC 0: one warp, a cp.async.bulk of 656 bytes per row (lane l: rows 2l, 2l+1),
// completing on `full` with expect_tx = valid rows x 656.
__device__ __forceinline__ void producer(const uint8_t* __restrict__ kv,
                                         const int* __restrict__ idx_row, int k_lo, int k_hi,
                                         int nblk, uint8_t* smem, uint32_t sbase, Bars b,
                                         int lane) {
  int* ids_s = reinterpret_cast<int*>(smem + OFF_IDS);
  int id0 = block_id(idx_row, k_lo, k_hi, 0, 2 * lane);
  int id1 = block_id(idx_row, k_lo, k_hi, 0, 2 * lane + 1);
  for (int i = 0; i < nblk; ++i) {
    const int st = i % NUM_STAGES;
    const uint32_t ph = (i / NUM_STAGES) & 1;
    mbar_wait(b.empty + 8 * st, ph ^ 1);
    ids_s[st * BN + 2 * lane] = id0;
    ids_s[st * BN + 2 * lane + 1] = id1;
    const uint32_t n = __popc(__ballot_sync(0xffffffffu, id0 >= 0)) +
                       __popc(__ballot_sync(0xffffffffu, id1 >= 0));
    __syncwarp();
    if (lane == 0) mbar_arrive_expect_tx(b.full + 8 * st, n * ROW);
    __syncwarp();
    const uint32_t dst = sbase + OFF_ST + st * STAGE + 2 * lane * ROW;
    if (id0 >= 0) bulk_g2s(dst, kv + (size_t)id0 * ROW, ROW, b.full + 8 * st);
    if (id1 >= 0) bulk_g2s(dst + ROW, kv + (size_t)id1 * ROW, ROW, b.full + 8 * st);
    if (i + 1 < nblk) {
      id0 = block_id(idx_row, k_lo, k_hi, i + 1, 2 * lane);
      id1 = block_id(idx_row, k_lo, k_hi, i + 1, 2 * lane + 1);
    }
  }
}

// PRODUCER_CPASYNC 1: the producer warpgroup's 4 warps, warp pw copying rows 16pw..16pw+15 in
// 16-byte cp.async pieces (41 a row; zero-filled for a -1 id); `full` expects 128 cp.async
// arrivals plus one plain arrival per warp that publishes its ids.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void producer_cpasync(const uint8_t* __restrict__ kv,
                                                 const int* __restrict__ idx_row, int k_lo,
                                                 int k_hi, int nblk, uint8_t* smem,
                                                 uint32_t sbase, Bars b, int pw, int lane) {
  int* ids_s = reinterpret_cast<int*>(smem + OFF_IDS);
  int id = block_id(idx_row, k_lo, k_hi, 0, 16 * pw + (lane & 15));
  for (int i = 0; i < nblk; ++i) {
    const int st = i % NUM_STAGES;
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
    if (i + 1 < nblk) id = block_id(idx_row, k_lo, k_hi, i + 1, 16 * pw + (lane & 15));
  }
}

// ---- PV on one half of the value columns ------------------------------------------------------
// O^T[256 dv x 64 heads] += V^T . P^T over the block in stage `stg`. Thread (w, g, c) holds dv
// rows dv0 + 2j + h (tile j, h = 0 for M row g / 1 for g + 8) with dv0 = 256*half + 8*(8w + g),
// so its 8 values of a row are 8 contiguous bytes; K = the block's rows 16kk + {2c,2c+1,2c+8,2c+9}.
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
      const uint32_t x0 = wi ? r0.y : r0.x, x1 = wi ? r1.y : r1.x;
      const uint32_t x2 = wi ? r2.y : r2.x, x3 = wi ? r3.y : r3.x;
      const uint32_t u01 = __byte_perm(x0, x1, 0x5140), v01 = __byte_perm(x0, x1, 0x7362);
      const uint32_t u23 = __byte_perm(x2, x3, 0x5140), v23 = __byte_perm(x2, x3, 0x7362);
      uint32_t f[8];
      e4m3x4_to_f16x4(u01, f[0], f[1]);
      e4m3x4_to_f16x4(u23, f[2], f[3]);
      e4m3x4_to_f16x4(v01, f[4], f[5]);
      e4m3x4_to_f16x4(v23, f[6], f[7]);
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

// acc[j][4jj + k] is (dv row, head 8jj + 2c + (k & 1)); alpha[2jj + b] that head's factor.
__device__ __forceinline__ void rescale(float (&d)[32], const float (&alpha)[16]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) d[i] *= alpha[2 * (i >> 2) + (i & 1)];
}

// Writes this thread's O^T values for its 16 heads: out[head, dv0 .. dv0+8).
__device__ __forceinline__ void store_out(const float (&acc)[4][32], const float (&inv)[16],
                                          void* out, long long base, long long stride_oh,
                                          int num_heads, int dv0, int c, bool fp32) {
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int head = 8 * jj + 2 * c + b;
      if (head >= num_heads) continue;
      float v[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        v[2 * j] = acc[j][4 * jj + b] * inv[2 * jj + b];
        v[2 * j + 1] = acc[j][4 * jj + 2 + b] * inv[2 * jj + b];
      }
      const long long o = base + head * stride_oh + dv0;
      if (fp32) {
        float4* p = reinterpret_cast<float4*>(reinterpret_cast<float*>(out) + o);
        p[0] = make_float4(v[0], v[1], v[2], v[3]);
        p[1] = make_float4(v[4], v[5], v[6], v[7]);
      } else {
        uint4 u = make_uint4(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]), pack_bf16(v[4], v[5]),
                             pack_bf16(v[6], v[7]));
        *reinterpret_cast<uint4*>(reinterpret_cast<__nv_bfloat16*>(out) + o) = u;
      }
    }
  }
}

// ---- the query: heads [32 half, 32 half + 32) into this warpgroup's Q^T region ------------------
// Thread wt: head wt / 4, nope features [128 qq, 128 qq + 128) and rope [16 qq, 16 qq + 16),
// qq = wt % 4, loaded once into registers (72 of them, before the accumulators are live).
// Returns 2^-eq, eq the power of two that puts the region's largest |q| just under 2^14 in f16.
// Placement: feature 128 qq + 16 mm + 4 i + e sits at k-step 4 ((mm - 2 qq) & 7) + i, position
// 2 qq + (e < 2 ? e : e + 6) of it (pos_nope); a pair (e, e + 1), e even, is one 4-byte word.
__device__ __forceinline__ float load_query(const __nv_bfloat16* __restrict__ qrow,
                                            long long stride_qh, int num_heads, int half,
                                            uint8_t* smem, int wt, int lane, int w) {
  const int hl = wt >> 2, qq = wt & 3, h = 32 * half + hl;
  const bool hv = h < num_heads;
  const uint4* qh = reinterpret_cast<const uint4*>(qrow + (long long)h * stride_qh);
  uint4 v[18];
#pragma unroll
  for (int k = 0; k < 16; ++k) v[k] = hv ? __ldg(qh + qq * 16 + k) : make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int k = 0; k < 2; ++k) v[16 + k] = hv ? __ldg(qh + 64 + 2 * qq + k) : make_uint4(0, 0, 0, 0);
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
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  float* misc = reinterpret_cast<float*>(smem + OFF_MISC) + 4 * half;
  if (lane == 0) misc[w] = amax;
  bar_sync(1 + half, 128);
  amax = fmaxf(fmaxf(misc[0], misc[1]), fmaxf(misc[2], misc[3]));
  int eq = amax > 0.f ? 13 - ilog2(amax) : 0;
  eq = eq < -120 ? -120 : (eq > 120 ? 120 : eq);
  const float qf = exp2i(eq);
  uint8_t* qt = smem + OFF_QT + half * QT_HALF;
  // this thread's row of its 9 atoms, swizzled by (hl & 7); a word at 16-byte chunk x, byte b
  // lands at row + ((x ^ sw) << 4) + b
  uint8_t* row = qt + hl * 128;
  const int sw = hl & 7;
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const uint32_t ws[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
    const int mm = k >> 1;                 // 16-feature chunk of this thread's 128
    uint8_t* atom = row + (((mm - 2 * qq) & 7) * 4096);  // k-steps 4 m .. 4 m + 3
#pragma unroll
    for (int e2 = 0; e2 < 4; ++e2) {       // feature pair 8k + 2 e2 = 16 mm + 4 i + 2 p
      const int r = 8 * (k & 1) + 2 * e2, i = r >> 2, p = (r >> 1) & 1;
      // byte of position 2 qq + 8 p within k-step i: 32 i + 4 qq + 16 p
      const int x = 2 * i + p, bofs = 4 * qq;
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ws[e2]));
      *reinterpret_cast<uint32_t*>(atom + (((x ^ sw) << 4) | bofs)) = pack_f16(f.x * qf, f.y * qf);
    }
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint32_t ws[4] = {v[16 + k].x, v[16 + k].y, v[16 + k].z, v[16 + k].w};
#pragma unroll
    for (int e2 = 0; e2 < 4; ++e2) {       // rope pair 16 qq + 8k + 2 e2 = 16 qq + 4 i + 2 p
      const int r = 8 * k + 2 * e2, i = r >> 2, p = (r >> 1) & 1;
      const int x = 2 * i + p;             // k-step 32 + i: atom 8, byte 32 i + 4 qq + 16 p
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ws[e2]));
      *reinterpret_cast<uint32_t*>(row + 8 * 4096 + (((x ^ sw) << 4) | (4 * qq))) =
          pack_bf16(f.x * qf, f.y * qf);
    }
  }
  fence_proxy_async();
  bar_sync(1 + half, 128);
  return exp2i(-eq);
}

// Descriptor increment of k-step kk in a Q^T region (the address field counts 16-byte units).
__device__ __forceinline__ constexpr uint32_t qk_step(int kk) {
  return (uint32_t)(((kk >> 2) * 4096 + (kk & 3) * 32) >> 4);
}

__device__ __forceinline__ void qk_block(float (&s)[16], const uint8_t* row0, const uint8_t* row1,
                                         uint32_t dq, int c, int& e0, int& e1) {
  const float4 sa = *reinterpret_cast<const float4*>(row0 + 512);
  const float4 sb = *reinterpret_cast<const float4*>(row1 + 512);
  e0 = ilog2(fmaxf(fmaxf(sa.x, sa.y), fmaxf(sa.z, sa.w)));
  e1 = ilog2(fmaxf(fmaxf(sb.x, sb.y), fmaxf(sb.z, sb.w)));
  const float ca = c == 0 ? sa.x : (c == 1 ? sa.y : (c == 2 ? sa.z : sa.w));
  const float cb = c == 0 ? sb.x : (c == 1 ? sb.y : (c == 2 ? sb.z : sb.w));
  const uint32_t h0 = pack_f16(ca * exp2i(-e0), ca * exp2i(-e0));
  const uint32_t h1 = pack_f16(cb * exp2i(-e1), cb * exp2i(-e1));
#pragma unroll
  for (int mm = 0; mm < 8; ++mm) {
    const int off = 128 * c + 16 * ((mm + 2 * c) & 7);
    const uint4 u0 = *reinterpret_cast<const uint4*>(row0 + off);
    const uint4 u1 = *reinterpret_cast<const uint4*>(row1 + off);
    const uint32_t x0[4] = {u0.x, u0.y, u0.z, u0.w};
    const uint32_t x1[4] = {u1.x, u1.y, u1.z, u1.w};
#pragma unroll
    for (int hk = 0; hk < 4 / QK_KSTEPS; ++hk) {  // the A registers of 2 groups are live
      uint32_t a[QK_KSTEPS][4];
#pragma unroll
      for (int k = 0; k < QK_KSTEPS; ++k) {
        const int x = QK_KSTEPS * hk + k;
        uint32_t f0, f1, f2, f3;
        e4m3x4_to_f16x4(x0[x], f0, f2);
        e4m3x4_to_f16x4(x1[x], f1, f3);
        a[k][0] = hmul2(f0, h0);
        a[k][1] = hmul2(f1, h1);
        a[k][2] = hmul2(f2, h0);
        a[k][3] = hmul2(f3, h1);
      }
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < QK_KSTEPS; ++k) {
        const int kk = 4 * mm + QK_KSTEPS * hk + k;
        wgmma_f16_n32(s, a[k][0], a[k][1], a[k][2], a[k][3], desc(dq + qk_step(kk)), kk > 0);
      }
      wgmma_commit();
      if (mm + hk > 0) wgmma_wait<1>();
    }
  }
  const uint4 v00 = *reinterpret_cast<const uint4*>(row0 + 528 + 32 * c);
  const uint4 v01 = *reinterpret_cast<const uint4*>(row0 + 544 + 32 * c);
  const uint4 v10 = *reinterpret_cast<const uint4*>(row1 + 528 + 32 * c);
  const uint4 v11 = *reinterpret_cast<const uint4*>(row1 + 544 + 32 * c);
  const uint32_t y0[8] = {v00.x, v00.y, v00.z, v00.w, v01.x, v01.y, v01.z, v01.w};
  const uint32_t y1[8] = {v10.x, v10.y, v10.z, v10.w, v11.x, v11.y, v11.z, v11.w};
  // bf16x2 (2^-e, 2^-e): exact rescale of the rope values to the row's normalisation
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
  for (int k = 0; k < 4; ++k) {
    const int kk = 32 + k;
    wgmma_bf16_n32(s, a[k][0], a[k][1], a[k][2], a[k][3], desc(dq + qk_step(kk)), 1);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_acc(s);
}

// ---- one consumer warpgroup: QK + softmax for heads [32 half, +32), PV for value columns
// [256 half, +256) over all 64 heads ------------------------------------------------------------
__device__ __forceinline__ void consumer(const __nv_bfloat16* __restrict__ qrow,
                                         long long stride_qh, int num_heads, int nblk,
                                         float scale_log2, uint8_t* smem, uint32_t sbase, Bars b,
                                         int half, int wt, float (&acc)[4][32], float (&m)[8],
                                         float (&l)[8]) {
  const int w = wt >> 5, lane = wt & 31, g = lane >> 2, c = lane & 3;
  const float base_f = scale_log2 * load_query(qrow, stride_qh, num_heads, half, smem, wt, lane, w);
  const uint32_t dq = desc_lo(sbase + OFF_QT + half * QT_HALF);
  const uint32_t dp0 = desc_lo(sbase + OFF_PT);
  const int r0 = 16 * w + g, r1 = r0 + 8;
  const int* ids_s = reinterpret_cast<const int*>(smem + OFF_IDS);
  float* red_s = reinterpret_cast<float*>(smem + OFF_RED);
  float* alpha_s = reinterpret_cast<float*>(smem + OFF_ALPHA);
#pragma unroll 1
  for (int i = 0; i < nblk; ++i) {
    const int st = i % NUM_STAGES, buf = i & 1;
    const uint32_t ph = (i / NUM_STAGES) & 1;
    const uint8_t* stg = smem + OFF_ST + st * STAGE;
    mbar_wait(b.full + 8 * st, ph);
    float s[16];
    int e0, e1;
    qk_block(s, stg + r0 * ROW, stg + r1 * ROW, dq, c, e0, e1);
    fence_acc(acc[0]); fence_acc(acc[1]); fence_acc(acc[2]); fence_acc(acc[3]);
    // ---- online softmax over the block's rows (base 2), this warpgroup's heads ----
    const bool v0 = ids_s[st * BN + r0] >= 0, v1 = ids_s[st * BN + r1] >= 0;
    const float f0 = base_f * exp2i(e0), f1 = base_f * exp2i(e1);
    // The stabiliser only has to bound P: the running max m moves only when a row exceeds it by
    // more than 2^RESCALE_LOG2 (P < 2^RESCALE_LOG2 in bf16 is as exact as P <= 1, and l and O
    // carry the same factor). One barrier-with-OR tells the warpgroup whether any row of any
    // warp does; only then (the first valid block, and rarely after) are the block's row maxima
    // reduced across the warps and O rescaled. alpha = 1 while nothing was valid (O, l are zero).
    float mb[8];
    bool over = false;
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
      for (int bb = 0; bb < 2; ++bb) {
        s[4 * jj + bb] = v0 ? s[4 * jj + bb] * f0 : -INFINITY;
        s[4 * jj + 2 + bb] = v1 ? s[4 * jj + 2 + bb] * f1 : -INFINITY;
        mb[2 * jj + bb] = fmaxf(s[4 * jj + bb], s[4 * jj + 2 + bb]);
        over |= mb[2 * jj + bb] > m[2 * jj + bb] + RESCALE_LOG2;
      }
    }
    float al[8];
#pragma unroll
    for (int hh = 0; hh < 8; ++hh) al[hh] = 1.f;
    if (bar_red_or(1 + half, 128, over)) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
#pragma unroll
        for (int hh = 0; hh < 8; ++hh)
          mb[hh] = fmaxf(mb[hh], __shfl_xor_sync(0xffffffffu, mb[hh], o));
      }
      float* red = red_s + (buf * 2 + half) * 128;
      if (g == 0) {
#pragma unroll
        for (int jj = 0; jj < 4; ++jj)
          *reinterpret_cast<float2*>(red + w * 32 + 8 * jj + 2 * c) =
              make_float2(mb[2 * jj], mb[2 * jj + 1]);
      }
      bar_sync(1 + half, 128);
#pragma unroll
      for (int ww = 0; ww < 4; ++ww) {
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const float2 r = *reinterpret_cast<const float2*>(red + ww * 32 + 8 * jj + 2 * c);
          mb[2 * jj] = fmaxf(mb[2 * jj], r.x);
          mb[2 * jj + 1] = fmaxf(mb[2 * jj + 1], r.y);
        }
      }
#pragma unroll
      for (int hh = 0; hh < 8; ++hh) {
        if (mb[hh] > m[hh] + RESCALE_LOG2) {
          al[hh] = m[hh] == -INFINITY ? 1.f : ex2(m[hh] - mb[hh]);
          m[hh] = mb[hh];
        }
      }
    }
#pragma unroll
    for (int hh = 0; hh < 8; ++hh) mb[hh] = m[hh] == -INFINITY ? 0.f : m[hh];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
      for (int k = 0; k < 4; ++k) s[4 * jj + k] = ex2(s[4 * jj + k] - mb[2 * jj + (k & 1)]);
#pragma unroll
      for (int bb = 0; bb < 2; ++bb)
        l[2 * jj + bb] = l[2 * jj + bb] * al[2 * jj + bb] + s[4 * jj + bb] + s[4 * jj + 2 + bb];
    }
    // P^T[buf] rows 32 half .. +32 (heads) and alpha[buf]; P^T[buf] was last read by PV_{i-2},
    // which both warpgroups retired before the barrier of block i-1.
    const uint32_t pt = sbase + OFF_PT + buf * 8192;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int head = 32 * half + 8 * (lane >> 3) + (lane & 7);
      const uint32_t addr = pt + head * 128 + ((((2 * w + hf) ^ (head & 7))) << 4);
      stmatrix_x4_trans(addr, pack_bf16(s[2 * hf], s[2 * hf + 1]),
                        pack_bf16(s[4 + 2 * hf], s[4 + 2 * hf + 1]),
                        pack_bf16(s[8 + 2 * hf], s[8 + 2 * hf + 1]),
                        pack_bf16(s[12 + 2 * hf], s[12 + 2 * hf + 1]));
    }
    if (w == 0 && g == 0) {
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
        *reinterpret_cast<float2*>(alpha_s + buf * 64 + 32 * half + 8 * jj + 2 * c) =
            make_float2(al[2 * jj], al[2 * jj + 1]);
    }
    fence_proxy_async();
    bar_sync(3, 256);  // both halves of P^T[buf] and alpha[buf] are written
    float alpha[16];
    bool any = false;
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const float2 x = *reinterpret_cast<const float2*>(alpha_s + buf * 64 + 8 * jj + 2 * c);
      alpha[2 * jj] = x.x;
      alpha[2 * jj + 1] = x.y;
      any |= (x.x != 1.f) | (x.y != 1.f);
    }
    if (__any_sync(0xffffffffu, any)) {
#pragma unroll
      for (int j = 0; j < 4; ++j) rescale(acc[j], alpha);
    }
    pv_block(acc, stg, dp0 + buf * (8192 >> 4), half, w, g, c);
    mbar_arrive(b.empty + 8 * st);
    // Retire PV here, not in the next block's QK: with a group in flight across the loop's back
    // edge ptxas cannot prove the rescale above safe and serialises every wgmma (C7514).
    wgmma_wait<0>();
  }
  wgmma_wait<0>();
  fence_acc(acc[0]); fence_acc(acc[1]); fence_acc(acc[2]); fence_acc(acc[3]);
}

#if SCHEDULE_SEESAW
#include "sparse_mla_fp8_seesaw.cuh"
#endif

}  // namespace

extern "C" __global__ void __launch_bounds__(384, 1) sparse_mla_fp8_sm90(
    const __nv_bfloat16* __restrict__ q, const uint8_t* __restrict__ kv,
    const int* __restrict__ idx, void* __restrict__ out, float* __restrict__ lse,
    float scale_log2, int num_heads, int topk, int k_per_split, long long stride_qt,
    long long stride_qh, long long stride_it, long long stride_os, long long stride_ot,
    long long stride_oh, long long stride_ls, long long stride_lt, int out_fp32) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t sbase = (raw + 1023) & ~1023u;
  uint8_t* smem = smem_raw + (sbase - raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
  const int t = blockIdx.x, split = blockIdx.y;
  const int k_lo = split * k_per_split;
  const int k_hi = min(topk, k_lo + k_per_split);
  const int nblk = k_hi > k_lo ? (k_hi - k_lo + BN - 1) / BN : 0;
  const Bars b{sbase + OFF_BAR, sbase + OFF_BAR + 24, sbase + OFF_BAR + 48, sbase + OFF_BAR + 72};
  if (tid == 0) {
    for (int s = 0; s < NUM_STAGES; ++s) {
      mbar_init(b.full + 8 * s, PRODUCER_CPASYNC ? 132 : 1);
      mbar_init(b.empty + 8 * s, 256);
    }
#if SCHEDULE_SEESAW
    for (int s = 0; s < NUM_PBUF; ++s) {
      mbar_init(b.pfull + 8 * s, 128);
      mbar_init(b.pempty + 8 * s, 256);
    }
#endif
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
#if SCHEDULE_SEESAW
  if (tid < 64) reinterpret_cast<float*>(smem + OFF_M)[tid] = -INFINITY;
  if (tid == 64) reinterpret_cast<int*>(smem + OFF_EX)[0] = E_NONE;
#endif
  // Rows of a -1 id keep what the stage held (masked, never NaN): zero the stages once.
  for (int o = tid * 16; o < NUM_STAGES * STAGE; o += 384 * 16)
    *reinterpret_cast<uint4*>(smem + OFF_ST + o) = make_uint4(0, 0, 0, 0);
  fence_proxy_async();
  __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (PRODUCER_CPASYNC)
      producer_cpasync(kv, idx + (long long)t * stride_it, k_lo, k_hi, nblk, smem, sbase, b, warp,
                       lane);
    else if (warp == 0)
      producer(kv, idx + (long long)t * stride_it, k_lo, k_hi, nblk, smem, sbase, b, lane);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int half = wg - 1;
  const int wt = tid - 128 * wg;  // thread within its warpgroup
  const int w = wt >> 5, g = (wt & 31) >> 2, c = wt & 3;
  float acc[4][32];
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[j][i] = 0.f;
#if SCHEDULE_SEESAW
  {
    float l[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) l[i] = 0.f;
    consumer_seesaw(q + (long long)t * stride_qt, stride_qh, num_heads, nblk, scale_log2, smem,
                    sbase, b, half, wt, acc, l);
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
    if (wt < 32) {  // heads [32 half, +32): a lane of each warpgroup's first warp each
      const int head = 32 * half + wt;
      float x = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) x += red[i * 64 + head];
      l_s[head] = x;
      if (head < num_heads)
        lse[split * stride_ls + t * stride_lt + head] =
            x > 0.f ? (m_s[head] + __log2f(x)) * 0.6931471805599453f : -INFINITY;
    }
    bar_sync(3, 256);
  }
#else
  {
    float m[8], l[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      m[i] = -INFINITY;
      l[i] = 0.f;
    }
    consumer(q + (long long)t * stride_qt, stride_qh, num_heads, nblk, scale_log2, smem, sbase, b,
             half, wt, acc, m, l);
  // Row sums: this thread's partial over its rows r0, r1 -> over the warp's 16 rows (lanes of one
  // quad column) -> over the 4 warps (shared memory); all 64 heads' sums then go to every thread.
#pragma unroll
  for (int o = 4; o < 32; o <<= 1)
#pragma unroll
    for (int hh = 0; hh < 8; ++hh) l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], o);
  float* red = reinterpret_cast<float*>(smem + OFF_RED) + half * 128;
  float* l_s = reinterpret_cast<float*>(smem + OFF_L);
  if (g == 0) {
#pragma unroll
    for (int jj = 0; jj < 4; ++jj)
      *reinterpret_cast<float2*>(red + w * 32 + 8 * jj + 2 * c) = make_float2(l[2 * jj], l[2 * jj + 1]);
  }
  bar_sync(3, 256);  // (also: both warpgroups are past their last use of the row-max buffer)
  if (w == 0 && g == 0) {
#pragma unroll
    for (int jj = 0; jj < 4; ++jj)
#pragma unroll
      for (int bb = 0; bb < 2; ++bb) {
        const int hl = 8 * jj + 2 * c + bb;
        const float x = red[hl] + red[32 + hl] + red[64 + hl] + red[96 + hl];
        l_s[32 * half + hl] = x;
        const int head = 32 * half + hl;
        if (head < num_heads)
          lse[split * stride_ls + t * stride_lt + head] =
              x > 0.f ? (m[2 * jj + bb] + __log2f(x)) * 0.6931471805599453f : -INFINITY;
      }
  }
  bar_sync(3, 256);
  }
#endif
  const float* l_s = reinterpret_cast<const float*>(smem + OFF_L);
  float inv[16];
#pragma unroll
  for (int jj = 0; jj < 8; ++jj)
#pragma unroll
    for (int bb = 0; bb < 2; ++bb) {
      const float x = l_s[8 * jj + 2 * c + bb];
      inv[2 * jj + bb] = x > 0.f ? 1.f / x : 0.f;
    }
#if SCHEDULE_SEESAW && PV_F16
  {  // O accumulated in units of 2^E (E_NONE: nothing had a scale, O is zero)
    const int E = reinterpret_cast<const int*>(smem + OFF_EX)[0];
    const float fe = E == E_NONE ? 0.f : exp2i(E);
#pragma unroll
    for (int i = 0; i < 16; ++i) inv[i] *= fe;
  }
#endif
  store_out(acc, inv, out, split * stride_os + t * stride_ot, stride_oh, num_heads,
            256 * half + 8 * (8 * w + g), c, out_fp32 != 0);
}
