// Probe: the wgmma issue rates of the CUDA FP8 sparse-MLA decode kernel's shapes and patterns
// (benchmarks/kernels/probe_wgmma_rate.py builds one cubin per MODE and NWG and times it).
// One CTA per SM, 384 threads with the decode kernel's register split (setmaxnreg 24 / 240):
// warpgroup 0 idles (the decode kernel's producer), warpgroups 1..NWG issue `groups` steps of 4
// wgmmas each, and thread 0 of each writes its clock64 cycles.
// MODE 0: RS m64n64k16 f16 into 4 accumulators, wait_group 1 after each group (the PV's pattern,
//         A registers fixed); 1: wait_group 0 after each group; 2: no wait inside the loop;
//         3: one accumulator (the QK's pattern); 4: A and B from shared memory (SS),
//         4 accumulators;
//         6: RS m64n256k16, one accumulator;
//         7: as 0, A dequantised per group from e4m3 bytes in shared memory as the PV does
//            (4 8-byte loads, byte permutes, e4m3x2 -> f16x2, x sigma);
//         8: as 3, A dequantised as the QK does (2 16-byte loads per 4 k-steps, x tile scale);
//         9: a whole block loop in one warpgroup's registers: the PV accumulators live across
//            the loop; per iteration a QK call (9 mode-8 steps into its own accumulator,
//            drained), a minimal softmax of the scores (exponentials against shared-memory
//            maxima, row sums, the f16 P^T stored to shared memory) and the PV calls (4 steps
//            each, dequantised as mode 7, drained per call). NWG 1-2: 4 value tiles (256
//            columns) and 2 PV calls an iteration, the decode kernel's split; NWG 3-4: 2 tiles
//            (128 columns) and 4 PV calls, the split of a kernel with four consumer warpgroups.
//            Either way 68 wgmmas a warpgroup an iteration. L16 1: the row sums in 16
//            registers a thread (as the decode kernel keeps them); 0: reduced across the 8
//            lanes sharing heads every block (14 shuffles) into 2.
// NWG: consumer warpgroups; 1-2 in a 384-thread CTA with setmaxnreg 24 / 240 (the decode
// kernel's), 3-4 in a (NWG + 1) x 128-thread CTA with setmaxnreg 24 / 112 (what a kernel of four
// consumer warpgroups could have: 96 registers a thread at launch). NT (mode 7): the m64 value
// tiles of a warpgroup's PV, 4 (256 value columns, the decode kernel's) or 2 (128: each thread
// dequantises 4 bytes of a row a step, not 8).
// DEQ (modes 7, 8): 0 cvt.rn.f16x2.e4m3x2, 1 e4m3x2_to_f16x2_int (prmt, and,
// shift: the integer pipe), 2 half of each group's pairs each way. NOMMA 1: the dequantisation
// alone (its results XORed into a register instead of feeding wgmmas).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#ifndef MODE
#define MODE 0
#endif
static_assert(MODE >= 0 && MODE <= 9 && MODE != 5, "MODE: 0-4, 6-9");
#ifndef NWG
#define NWG 2
#endif
#ifndef DEQ
#define DEQ 0
#endif
#ifndef NT
#define NT 4
#endif
static_assert(NT == 2 || NT == 4, "NT: 2 or 4 value tiles");
static_assert(NT == 4 || MODE == 7, "NT 2: the PV dequant pattern (mode 7)");
static_assert(NWG >= 1 && NWG <= 4, "NWG: 1-4");
constexpr int NTHREADS = 128 * (NWG > 2 ? NWG + 1 : 3);
#define STR_(x) #x
#define STR(x) STR_(x)
#if NWG > 2
#define CONS_SETMAXNREG STR(CONS_REGS)
#else
#define CONS_SETMAXNREG "240"
#endif
#ifndef NOMMA
#define NOMMA 0
#endif
// PG, PW (modes 7, 8): a commit group every PG wgmmas, then wait_group PW (default 4, 1: the
// decode kernel's groups). The registers in flight are the same for 4 / 1, 2 / 3 and 1 / 7.
// FEED (modes 7, 8): what the wgmmas read. 0: the dequantised registers (RS, as the decode kernel
// does); 1: fixed registers (RS), the dequantised values XORed into a register; 2: A from shared
// memory (SS), the dequantised values XORed into a register; 3: SS, the dequantised values stored
// to shared memory (what a kernel staging them through shared memory would do).
#ifndef FEED
#define FEED 0
#endif
#ifndef PG
#define PG 4
#endif
// DRAIN (modes 7, 8): wait_group 0 after every DRAIN steps, as the decode kernel retires each
// block's PV (4 steps) and QK (9 steps) before moving on; 0: never inside the loop.
#ifndef DRAIN
#define DRAIN 0
#endif
#ifndef PW
#define PW 1
#endif
#ifndef L16
#define L16 1
#endif
// CONS_REGS (NWG > 2): the consumers' setmaxnreg (112: what 640 threads at 96 a thread leave)
#ifndef CONS_REGS
#define CONS_REGS 112
#endif

namespace {
#include "../../vllm/kernels/cuda/sparse_mla_sm90_ptx.cuh"
// m64n256k16 (128 accumulators), A in registers
__device__ __forceinline__ void wgmma_f16_n256(float (&d)[128], uint32_t a0, uint32_t a1,
                                              uint32_t a2, uint32_t a3, uint64_t desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
      "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
      "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, "
      "%72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, "
      "%84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "
      "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, "
      "%120, %121, %122, %123, %124, %125, %126, %127"
      "}, {%128, %129, %130, %131}, %132, 1, 1, 1, 0;\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
        "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
        "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),
        "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]),
        "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
        "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]),
        "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),
        "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]),
        "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]),
        "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]),
        "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]),
        "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),
        "+f"(d[126]), "+f"(d[127])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
}

// Two e4m3 bytes -> f16x2 times 2^-8, exact, on the integer pipe (DEQ 1): prmt with selector SEL
// places byte A and its sign replicated in the low half, byte B likewise in the high half (each
// half the byte as a sign-extended int16); keeping bits 8 and 6..0 of each half and shifting left
// by 7 gives sign << 15 | (exponent, mantissa) << 7, the f16 of the e4m3 value times 2^-8
// (subnormals included). Three integer instructions per pair against one cvt.
template <uint32_t SEL>
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2_int(uint32_t a, uint32_t b) {
  uint32_t x;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(x) : "r"(a), "r"(b), "n"(SEL));
  return (x & 0x017F017Fu) << 7;
}

constexpr int ROW = 656;
constexpr int OFF_RAW = 9 * 8192;  // after the B atoms: 64 rows of raw e4m3 bytes
constexpr int OFF_SCR = OFF_RAW + 64 * 656;  // FEED 3: 2 warpgroups x 4 x 128 x 16 bytes
static_assert(OFF_SCR + 2 * 4 * 128 * 16 + 1024 <= 200 * 1024, "the probe's shared memory");

__device__ __forceinline__ uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}
// The QK's A operands of one step (4 k-steps, modes 8 and 9): 16 bytes of rows row0 and row1 at
// byte off, e4m3 -> f16 pairs (DEQ) times sig.
__device__ __forceinline__ void qk_operands(const uint8_t* row0, const uint8_t* row1, int off,
                                            uint32_t sig, uint32_t (&av)[4][4]) {
  const uint4 u0 = *reinterpret_cast<const uint4*>(row0 + off);
  const uint4 u1 = *reinterpret_cast<const uint4*>(row1 + off);
  const uint32_t x0[4] = {u0.x, u0.y, u0.z, u0.w};
  const uint32_t x1[4] = {u1.x, u1.y, u1.z, u1.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint32_t f0, f1, f2, f3;
    if (DEQ == 1 || (DEQ == 2 && k >= 2)) {
      f0 = e4m3x2_to_f16x2_int<0x9180>(x0[k], x0[k]);
      f2 = e4m3x2_to_f16x2_int<0xB3A2>(x0[k], x0[k]);
      f1 = e4m3x2_to_f16x2_int<0x9180>(x1[k], x1[k]);
      f3 = e4m3x2_to_f16x2_int<0xB3A2>(x1[k], x1[k]);
    } else {
      e4m3x4_to_f16x4(x0[k], f0, f2);
      e4m3x4_to_f16x4(x1[k], f1, f3);
    }
    av[k][0] = hmul2(f0, sig);
    av[k][1] = hmul2(f1, sig ^ 0x00010001u);
    av[k][2] = hmul2(f2, sig);
    av[k][3] = hmul2(f3, sig ^ 0x00010001u);
  }
}
// The PV's A operands for 2 value tiles from 4 bytes (x0..x3) of rows s0, s0 + 1, s0 + 8, s0 + 9:
// e4m3 -> f16 pairs of two rows (INT: on the integer pipe) times sig (modes 7 and 9).
template <bool INT>
__device__ __forceinline__ void pv_operands_words(uint32_t x0, uint32_t x1, uint32_t x2,
                                                  uint32_t x3, uint32_t sig, uint32_t (&av)[2][4]) {
  uint32_t f[8];
  if (INT) {
    f[0] = e4m3x2_to_f16x2_int<0xC480>(x0, x1);
    f[1] = e4m3x2_to_f16x2_int<0xD591>(x0, x1);
    f[2] = e4m3x2_to_f16x2_int<0xC480>(x2, x3);
    f[3] = e4m3x2_to_f16x2_int<0xD591>(x2, x3);
    f[4] = e4m3x2_to_f16x2_int<0xE6A2>(x0, x1);
    f[5] = e4m3x2_to_f16x2_int<0xF7B3>(x0, x1);
    f[6] = e4m3x2_to_f16x2_int<0xE6A2>(x2, x3);
    f[7] = e4m3x2_to_f16x2_int<0xF7B3>(x2, x3);
  } else {
    v_pairs_f16(x0, x1, x2, x3, f);  // (the decode kernel's)
  }
#pragma unroll
  for (int q = 0; q < 2; ++q)
#pragma unroll
    for (int e = 0; e < 4; ++e) av[q][e] = hmul2(f[4 * q + e], sig);
}
// The same from 4 bytes of each row at p (row s0's).
__device__ __forceinline__ void pv_operands2(const uint8_t* p, uint32_t sig, uint32_t (&av)[2][4]) {
  pv_operands_words<false>(*reinterpret_cast<const uint32_t*>(p),
                           *reinterpret_cast<const uint32_t*>(p + ROW),
                           *reinterpret_cast<const uint32_t*>(p + 8 * ROW),
                           *reinterpret_cast<const uint32_t*>(p + 9 * ROW), sig, av);
}
// The sum of retired accumulators (keeps them live)
template <int N>
__device__ __forceinline__ float acc_sum(float (&acc)[N][32]) {
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    fence_acc(acc[j]);
#pragma unroll
    for (int i = 0; i < 32; ++i) sum += acc[j][i];
  }
  return sum;
}
// A step's 4 operand sets from the fixed registers (modes other than 7, 8).
__device__ __forceinline__ void fixed_operands(uint32_t (&av)[4][4], const uint32_t (&a)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) av[j][e] = a[e];
}
// What becomes of a step's dequantised operands when the wgmmas do not read them (NOMMA, FEED 1
// and 2: XORed into sink; FEED 3: stored to shared memory for the async proxy).
__device__ __forceinline__ void feed_aside(const uint32_t (&av)[4][4], uint32_t& sink,
                                           uint8_t* smem, int wt, int wg) {
  if (NOMMA || FEED == 1 || FEED == 2) {
#pragma unroll
    for (int j = 0; j < 4; ++j) sink ^= av[j][0] ^ av[j][1] ^ av[j][2] ^ av[j][3];
  } else if (FEED == 3) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      *reinterpret_cast<uint4*>(smem + OFF_SCR + 16 * (wt + 128 * (j + 4 * (wg - 1)))) =
          make_uint4(av[j][0], av[j][1], av[j][2], av[j][3]);
    fence_proxy_async();
  }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) probe(long long* cycles, int groups) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // (offset from the __shared__ array itself, so the compiler keeps shared-memory instructions)
  const uint32_t s0 = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  uint8_t* smem = smem_raw + ((1024u - (s0 & 1023u)) & 1023u);
  const int tid = threadIdx.x;
  // B atoms: f16 in [0.5, 1) and [-1, -0.5); raw rows: e4m3 bytes with no NaN
  for (int i = tid; i < 9 * 8192 / 4; i += NTHREADS) {
    const uint32_t h = mix(i * 2654435761u + 1);
    const uint32_t lo = 0x3800u | (h & 0x83FFu), hi = 0x3800u | ((h >> 16) & 0x83FFu);
    reinterpret_cast<uint32_t*>(smem)[i] = lo | (hi << 16);
  }
  for (int i = tid; i < 64 * ROW / 4; i += NTHREADS)
    reinterpret_cast<uint32_t*>(smem + OFF_RAW)[i] = mix(i + 77) & 0x77777777u;
  fence_proxy_async();
  __syncthreads();
  const int wg = tid / 128, wt = tid % 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 " CONS_SETMAXNREG ";\n");
  if (wg > NWG) return;
  const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t db = desc_lo(sbase);
  const int w = wt >> 5, lane = wt & 31, g = lane >> 2, c = lane & 3;
  uint32_t a[4] = {0x3C003C00u ^ (uint32_t)(wt & 1), 0x3A003A00u, 0x38003800u, 0x3C003800u};
  const uint32_t sig = 0x3C003C00u;
  uint32_t sink = 0;
  long long t0 = clock64();
#if MODE == 9
  constexpr int NT9 = NWG > 2 ? 2 : 4, NPV = 8 / NT9;  // value tiles, PV calls an iteration
  float acc[NT9][32];
#pragma unroll
  for (int j = 0; j < NT9; ++j)
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[j][i] = 0.f;
  constexpr int NL = L16 ? 16 : 2;
  float l[NL];
#pragma unroll
  for (int i = 0; i < NL; ++i) l[i] = 0.f;
  const int dv0 = 2 * NT9 * (8 * w + g) + 64 * NT9 * (wg - 1);
  const uint8_t* row0 = smem + OFF_RAW + (16 * w + g) * ROW;
  const uint8_t* row1 = row0 + 8 * ROW;
  const float* m_s = reinterpret_cast<const float*>(smem + OFF_SCR);
#pragma unroll 1
  for (int it = 0; it < groups / 16; ++it) {
    float s[32];
#pragma unroll
    for (int mm = 0; mm < 9; ++mm) {  // the QK call: 9 steps of 4 k-steps
      uint32_t av[4][4];
      qk_operands(row0, row1, 128 * c + 16 * ((mm + 2 * c) & 7), sig, av);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k)
        wgmma_f16(s, av[k][0], av[k][1], av[k][2], av[k][3], desc(db + 2 * k + 512 * (mm & 7)),
                  mm > 0 || k > 0);
      wgmma_commit();
      if (mm > 0) wgmma_wait<1>();
    }
    wgmma_wait<0>();
    fence_acc(s);
    // the softmax's minimum: exponentials against the maxima, row sums, P^T (f16) stored
    float ls[16];
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const float2 x = *reinterpret_cast<const float2*>(m_s + 8 * jj + 2 * c);
#pragma unroll
      for (int k = 0; k < 4; ++k) s[4 * jj + k] = ex2(s[4 * jj + k] * 0.125f - ((k & 1) ? x.y : x.x));
#pragma unroll
      for (int bb = 0; bb < 2; ++bb) ls[2 * jj + bb] = s[4 * jj + bb] + s[4 * jj + 2 + bb];
    }
#if L16
#pragma unroll
    for (int i = 0; i < 16; ++i) l[i] += ls[i];
#else
    {  // reduce-scatter over the lanes holding the same heads (lane bits 2-4): 16 -> 8 -> 4 -> 2
      const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float keep = b4 ? ls[8 + i] : ls[i], give = b4 ? ls[i] : ls[8 + i];
        ls[i] = keep + __shfl_xor_sync(0xffffffffu, give, 16);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float keep = b3 ? ls[4 + i] : ls[i], give = b3 ? ls[i] : ls[4 + i];
        ls[i] = keep + __shfl_xor_sync(0xffffffffu, give, 8);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float keep = b2 ? ls[2 + i] : ls[i], give = b2 ? ls[i] : ls[2 + i];
        l[i] += keep + __shfl_xor_sync(0xffffffffu, give, 4);
      }
    }
#endif
    uint8_t* pt = smem + OFF_SCR + 16 * (wt + 128 * 4 * ((wg - 1) & 1));
#pragma unroll
    for (int q = 0; q < 4; ++q)
      *reinterpret_cast<uint4*>(pt + 2048 * q) =
          make_uint4(pack_f16(s[8 * q], s[8 * q + 1]), pack_f16(s[8 * q + 2], s[8 * q + 3]),
                     pack_f16(s[8 * q + 4], s[8 * q + 5]), pack_f16(s[8 * q + 6], s[8 * q + 7]));
    fence_proxy_async();
#pragma unroll 1
    for (int pc = 0; pc < NPV; ++pc) {  // the PV calls: 4 steps each
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint8_t* p0 = smem + OFF_RAW + (16 * kk + 2 * c) * ROW + dv0 % 512;
        uint32_t av[NT9][4];
#pragma unroll
        for (int wi = 0; wi < NT9 / 2; ++wi)  // 4 bytes of each of the 4 rows a pair of tiles
          pv_operands2(p0 + 4 * wi, sig, *reinterpret_cast<uint32_t(*)[2][4]>(&av[2 * wi]));
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < NT9; ++j)
          wgmma_f16(acc[j], av[j][0], av[j][1], av[j][2], av[j][3], desc(db + 2 * kk + 512 * j), 1);
        wgmma_commit();
        if (kk > 0) wgmma_wait<1>();
      }
      wgmma_wait<0>();
    }
  }
  wgmma_wait<0>();
  float sum = acc_sum(acc);
#pragma unroll
  for (int i = 0; i < NL; ++i) sum += l[i];
#elif MODE <= 2 || MODE == 4 || MODE == 7
  float acc[NT][32];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[j][i] = 0.f;
  const int dv0 = 2 * NT * (8 * w + g) + 64 * NT * (wg - 1);
#pragma unroll 1
  for (int it = 0; it < groups; ++it) {
    const int kk = it & 3;
    uint32_t av[4][4];
#if MODE == 7 && NT == 2
    const uint8_t* p0 = smem + OFF_RAW + (16 * kk + 2 * c) * ROW + dv0 % 512;
    pv_operands2(p0, sig, *reinterpret_cast<uint32_t(*)[2][4]>(&av[0]));
#pragma unroll
    for (int e = 0; e < 4; ++e) av[2][e] = av[3][e] = 0u;  // (unused)
#elif MODE == 7
    const uint8_t* p0 = smem + OFF_RAW + (16 * kk + 2 * c) * ROW;
    const uint2 r0 = *reinterpret_cast<const uint2*>(p0 + dv0 % 512);
    const uint2 r1 = *reinterpret_cast<const uint2*>(p0 + ROW + dv0 % 512);
    const uint2 r2 = *reinterpret_cast<const uint2*>(p0 + 8 * ROW + dv0 % 512);
    const uint2 r3 = *reinterpret_cast<const uint2*>(p0 + 9 * ROW + dv0 % 512);
#pragma unroll
    for (int wi = 0; wi < 2; ++wi) {
      uint32_t(&aw)[2][4] = *reinterpret_cast<uint32_t(*)[2][4]>(&av[2 * wi]);
      if (DEQ == 1 || (DEQ == 2 && wi == 1))
        pv_operands_words<true>(wi ? r0.y : r0.x, wi ? r1.y : r1.x, wi ? r2.y : r2.x,
                                wi ? r3.y : r3.x, sig, aw);
      else
        pv_operands_words<false>(wi ? r0.y : r0.x, wi ? r1.y : r1.x, wi ? r2.y : r2.x,
                                 wi ? r3.y : r3.x, sig, aw);
    }
#else
    fixed_operands(av, a);
#endif
    feed_aside(av, sink, smem, wt, wg);
    if (NOMMA) continue;
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#if MODE == 4
      wgmma_bf16_ss(acc[j], desc(db + 2 * j + 512 * (wg - 1)), desc(db + 2 * kk + 1024), 1);
#elif MODE == 7 && FEED >= 2
      wgmma_bf16_ss(acc[j], desc(db + 2 * j + 512 * (wg - 1)), desc(db + 2 * kk + 1024), 1);
#elif MODE == 7 && FEED == 1
      wgmma_f16(acc[j], a[0], a[1], a[2], a[3], desc(db + 2 * kk + 512 * j), 1);
#else
      wgmma_f16(acc[j], av[j][0], av[j][1], av[j][2], av[j][3], desc(db + 2 * kk + 512 * j), 1);
#endif
#if MODE == 7
      if ((j + 1) % PG == 0) {
        wgmma_commit();
        wgmma_wait<PW>();
      }
#endif
    }
#if MODE != 7
    wgmma_commit();
#endif
#if MODE == 7 && DRAIN > 0
    if (it % DRAIN == DRAIN - 1) wgmma_wait<0>();
#endif
#if MODE == 0 || MODE == 4
    wgmma_wait<1>();
#elif MODE == 1
    wgmma_wait<0>();
#endif
  }
  wgmma_wait<0>();
  float sum = acc_sum(acc);
#else
  constexpr int NR = MODE == 6 ? 128 : 32;
  float acc[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) acc[i] = 0.f;
  const uint8_t* row0 = smem + OFF_RAW + (16 * w + g) * ROW;
  const uint8_t* row1 = row0 + 8 * ROW;
#pragma unroll 1
  for (int it = 0; it < groups; ++it) {
    uint32_t av[4][4];
#if MODE == 8
    qk_operands(row0, row1, 128 * c + 16 * ((it + 2 * c) & 7), sig, av);
#else
    fixed_operands(av, a);
#endif
    feed_aside(av, sink, smem, wt, wg);
    if (NOMMA) continue;
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint64_t d = desc(db + 2 * k + 512 * ((it >> 2) & 7));
#if MODE == 6
      wgmma_f16_n256(acc, av[k][0], av[k][1], av[k][2], av[k][3], desc(db + 2 * k));
#elif MODE == 8 && FEED >= 2
      wgmma_bf16_ss(acc, desc(db + 2 * k + 512 * (wg - 1)), d, 1);
#elif MODE == 8 && FEED == 1
      wgmma_f16(acc, a[0], a[1], a[2], a[3], d, 1);
#else
      wgmma_f16(acc, av[k][0], av[k][1], av[k][2], av[k][3], d, 1);
#endif
#if MODE == 8
      if ((k + 1) % PG == 0) {
        wgmma_commit();
        wgmma_wait<PW>();
      }
#endif
    }
#if MODE != 8
    wgmma_commit();
    wgmma_wait<1>();
#endif
#if MODE == 8 && DRAIN > 0
    if (it % DRAIN == DRAIN - 1) wgmma_wait<0>();
#endif
  }
  wgmma_wait<0>();
  fence_acc(acc);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < NR; ++i) sum += acc[i];
#endif
  const long long t1 = clock64();
  if (wt == 0) cycles[4 * blockIdx.x + wg - 1] = t1 - t0;
  if (sum == 123.456f || sink == 0x12345678u) cycles[0] = -1;  // keeps the results live
}
