// Launch shape and shared-memory layout of the FP8 sparse-MLA decode kernel for Hopper
// (sparse_mla_fp8_sm90.cu), shared by its producer, consumers and epilogue.
#pragma once

#include <cstdint>

namespace vllm::sparse_mla_sm90 {

// 384 threads a CTA, one CTA per SM: warpgroup 0 produces, warpgroups 1 and 2 consume.
constexpr int THREADS = 384;
// Registers per thread of the producer and consumer warpgroups (setmaxnreg). The CTA's pool is
// what the launch allocated, 168 x 384 (__launch_bounds__(384, 1)): a consumer count the pool
// cannot cover makes setmaxnreg.inc wait forever. 24 / 240: no spills in the consumers' block
// loop (40 / 232 spilled 60 bytes there and left no room for 4 k-steps per QK commit group);
// measured 1-2 % faster than 40 / 232 from T=128 up on an H200.
constexpr int PROD_REGS = 24;
constexpr int CONS_REGS = 240;
static_assert(128 * PROD_REGS + 256 * CONS_REGS <= 168 * THREADS && PROD_REGS % 8 == 0 &&
                  CONS_REGS % 8 == 0 && PROD_REGS >= 24 && CONS_REGS <= 256,
              "setmaxnreg counts: multiples of 8 within the launch's 168 x 384 registers");

constexpr int ROW = 656;         // fp8_ds_mla row bytes: 512 e4m3, 4 fp32 tile scales, 64 bf16
constexpr int D_V = 512;         // value columns
constexpr int BN = 64;           // rows per block
constexpr int NUM_STAGES = 3;
constexpr int STAGE = BN * ROW;  // 41984: a block's rows as copied, ROW bytes apart
constexpr int NUM_PBUF = 3;      // P^T buffers
constexpr int OFF_QT = 0;
constexpr int OFF_PT = OFF_QT + 9 * 8192;                // P^T: NUM_PBUF x [64 heads x 128 B]
constexpr int OFF_ST = OFF_PT + NUM_PBUF * 8192;         // raw stages
constexpr int OFF_IDS = OFF_ST + NUM_STAGES * STAGE;     // [stages][64] int32
constexpr int OFF_RED = OFF_IDS + NUM_STAGES * BN * 4;   // [2 halves][4 warps][64] f32
constexpr int OFF_ALPHA = OFF_RED + 2 * 4 * 64 * 4;      // [NUM_PBUF][64] f32
constexpr int OFF_L = OFF_ALPHA + NUM_PBUF * 64 * 4;     // [64] f32
constexpr int OFF_MISC = OFF_L + 64 * 4;                 // [16] f32
constexpr int OFF_BAR = OFF_MISC + 64;                   // full, empty [3]; pfull, pempty [3]
constexpr int OFF_M = OFF_BAR + 12 * 8;                  // [64] f32: the shared max m
constexpr int OFF_FLAG = OFF_M + 64 * 4;                 // [NUM_PBUF] int32: block flags
constexpr int OFF_SIG = OFF_FLAG + 16;                   // f16 PV sigma: [3][4 tiles][64] f16
constexpr int OFF_EX = OFF_SIG + NUM_PBUF * 4 * 64 * 2;  // f16 PV: E, ef[3], [2][4] emax
constexpr int OFF_CTL = OFF_EX + 48;                     // [4] int32: the merge decision
constexpr int SMEM_BYTES = OFF_CTL + 16;
constexpr int SMEM_ALLOC = SMEM_BYTES + 1024;  // + room to align the base to 1024 bytes

static_assert(SMEM_ALLOC <= 227 * 1024, "one CTA per SM on an H200");
static_assert(64 * 1216 <= OFF_ST - OFF_QT, "the query's staging area: Q^T and P^T");
static_assert(OFF_PT % 1024 == 0 && OFF_ST % 16 == 0 && OFF_BAR % 8 == 0, "alignment");

// Pieces of one token (CTAs it is cut between) the in-kernel merge takes: the merge keeps their
// weights in OFF_RED. The launcher's grid size ensures it.
constexpr int MAX_PIECES = 8;
static_assert(MAX_PIECES * 64 * 4 <= OFF_ALPHA - OFF_RED, "the merge's weights live in OFF_RED");

struct Bars {
  uint32_t full, empty, pfull, pempty;  // base addresses; +8 per index
};

}  // namespace vllm::sparse_mla_sm90
