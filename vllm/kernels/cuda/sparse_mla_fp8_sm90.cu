// Sparse-MLA decode over fp8_ds_mla rows for Hopper (sm_90a), in CUDA C++.
//
// Same function as vllm.kernels.sparse_mla_fwd (per query token, all of its <= 64 heads at once)
// at GLM-5.3's dims: kv_lora 512 (e4m3 + 4 fp32 tile scales),
// rope 64 (bf16); a row is 656 bytes. What differs from the Gluon kernel (sparse_mla_ws.py) is
// where the FP8 rows are dequantised: never into shared memory.
//
// The grid's G CTAs share the T x ceil(topk / 64) blocks of 64 rows equally, in contiguous
// ranges of (token, block) items (see "work split" below). A CTA with several tokens moves from
// one to the next while its producer keeps filling stages. A token cut between CTAs is merged in
// the kernel by whichever of its pieces arrives last. The launcher's default (default_ctas):
// G = T from T >= #SMs / 2 (one token per CTA), else each token in #SMs / T equal pieces.
// The default build (the knobs below select the others):
// - Producer warpgroup (warpgroup 0, 24 registers; PRODUCER_CPASYNC 1): its 4 warps copy each
//   64-row block's selected rows in 16-byte cp.async pieces into a ring of NUM_STAGES raw stages
//   (a -1 id is zero-filled and masked). PRODUCER_CPASYNC 0: one warp, one cp.async.bulk per row
//   (5 % slower at 1024 queries: the per-row bulk copies become the limit once the consumers are
//   fast enough).
// - Two consumer warpgroups (240 registers each: PROD_REGS, CONS_REGS) that score alternate
//   blocks (consumer_seesaw in sparse_mla_fp8_seesaw.cuh). For its block j, warpgroup j % 2:
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
// - Per token (a CTA's piece): the query prologue (the query copied in order through a shared
//   staging area, QSTAGED), then the blocks, then the epilogue (row sums reduced across warps and
//   warpgroups, 1/l by rcp.approx, O and the LSE stored). Once the producer has issued its last
//   stage it prefetches into L2 the query and first rows of the CTA likely to start next on a
//   freed SM (NEXT_PREFETCH).
// QK_FP8 1 (a build knob, tested, measured 1-2 % slower): QK on the FP8 tensor cores from shared
// memory, see sparse_mla_qk_fp8.cuh. DIAG_TRACE 1: per-step clock64 stamps
// (benchmarks/kernels/trace_sparse_mla_cuda.py); BENCHMARKS.md's fifteenth and sixteenth
// sessions have what they showed (per CTA at T=1024: ~8K cycles of query load, ~11K of output
// stores that the replayed benchmark does not wait for, 9.5K per two blocks).
// The first design (both warpgroups score every block, 32 heads each, exact bf16 PV; 1.003 ms
// at T=1024 against this one's 0.886) is in the git history and BENCHMARKS.md.
// Files: this one (layout, producers, the exact PV, the kernel), the PTX wrappers in
// sparse_mla_sm90_ptx.cuh, the consumer in sparse_mla_fp8_seesaw.cuh, the QK_FP8 variant's
// query prologue and QK in sparse_mla_qk_fp8.cuh.
// Measurements, the profile and what limits it: BENCHMARKS.md, twelfth and thirteenth sessions.
//
// Shapes: q [T, H<=64, 576] bf16; kv [rows, 656] uint8; idx [T, K] int32 (-1 = none);
// out [T, H, 512] (bf16 or fp32), lse [T, H] fp32 natural log (-inf, zeros for a token with no
// valid row). Grid (G, 1), 384 threads, one CTA per SM.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// Build-time knobs (nvcc -D...), timed against each other by benchmarks/kernels/bench_sparse_mla_decode.py:
// PRODUCER_CPASYNC: how the raw rows reach shared memory (see the producers below).
#ifndef PRODUCER_CPASYNC
#define PRODUCER_CPASYNC 1
#endif
// PV_F16 1: PV in f16 (V = e4m3 x the tile scale over the row's largest, P times
// that largest over the block's stabiliser 2^E), falling back to the exact bf16 PV for a block
// whose scales the f16 range cannot hold (see consumer_seesaw); 0: always the exact bf16 PV.
#ifndef PV_F16
#define PV_F16 1
#endif
// SEESAW_ORDER: 1: per own block j, QK_j, then PV of the other warpgroup's block
// j - 1 (S live across it), softmax_j, PV_j; 0: QK_j, softmax_j, then both PVs; 2: PV of block
// j - 1 first (no S live across it, but QK_j waits for block j - 1's softmax), QK_j, softmax_j,
// PV_j.
#ifndef SEESAW_ORDER
#define SEESAW_ORDER 1
#endif
// RESCALE_LOG2: the running max moves (and O is rescaled) only when a block's max exceeds it by
// more than this, in log2 units (0: every increase, the textbook online softmax).
#ifndef RESCALE_LOG2
#define RESCALE_LOG2 8.0f
#endif
// DIAG_SKIP_FULL 1 (diagnostic, wrong results): the consumers never wait for a stage to fill, so
// the time shows what the refill of the stages costs.
#ifndef DIAG_SKIP_FULL
#define DIAG_SKIP_FULL 0
#endif
// DIAG_TRACE 1 (diagnostic): thread 0 of each consumer warpgroup writes clock64 stamps of its
// steps into ws_o (benchmarks/kernels/trace_sparse_mla_cuda.py reads them; one piece per CTA):
// 16 per slot, a slot per iteration of consumer_seesaw and the last one for the piece.
// DIAG_MEM_ONLY 1 (diagnostic, no results): the consumers only release each stage once it is
// full, so the time is what the producer's gathers of the rows alone take.
#ifndef DIAG_MEM_ONLY
#define DIAG_MEM_ONLY 0
#endif
// DIAG_NO_OUT 1 (diagnostic, wrong results): a whole token's output is not stored, so the time
// shows what the output stores cost.
#ifndef DIAG_NO_OUT
#define DIAG_NO_OUT 0
#endif
// QSTAGED 1: the query prologue copies the query in order through a staging area in shared
// memory (coalesced global loads) before each thread takes its quarter (load_query_quarter).
#ifndef QSTAGED
#define QSTAGED 1
#endif
// QAMAX_INT 1 (default; QSTAGED): the query's largest |value| (which sets its f16 power of two)
// from the bit patterns each thread loaded, by 16-bit unsigned maxima two an instruction; 0: a
// float pass over the quarter each thread reads back. Same value, so the same bits (GPU test);
// measured 0-1 % faster at T=64-128 (BENCHMARKS.md, nineteenth and twentieth sessions).
#ifndef QAMAX_INT
#define QAMAX_INT 1
#endif
// QSKEW 1 (default; QSTAGED): the query's staging rows skewed so each thread's read-back of its
// quarter is free of bank conflicts (load_query_quarter); 0: 4-way conflicts. The same bytes
// either way; the read-back step 2.7K -> 1.2K cycles a piece, ~1 % at T=64-128 (BENCHMARKS.md,
// twentieth session).
#ifndef QSKEW
#define QSKEW 1
#endif
// DIAG_NO_MERGE 1 (diagnostic, wrong results, bf16 output only): each piece of a split token
// stores its own normalised partial as the token's output (no ticket, partial, wait or merge), so
// the time shows what the merge costs. DIAG_NO_QLOAD 1 (diagnostic, wrong results): the query prologue
// stores zeros into Q^T without loading the query. Not a clean bound on the load's cost: zero
// queries also draw less power, and the power-capped clock rises (BENCHMARKS.md, twentieth
// session).
#ifndef DIAG_NO_MERGE
#define DIAG_NO_MERGE 0
#endif
// PARTIAL_BF16 1 (default): with bf16 output, a split token's non-merging pieces store their
// normalised partial O in bf16 (64 KB a piece, not 128 KB of fp32): one more bf16 rounding of a
// partial before the output's own (GPU test). fp32 output keeps fp32 partials. The merging
// piece loads the first PARTIAL_EARLY (0..16) of the 16 loads of its first other partial before
// it computes the weights (16: the build spills 264 bytes). Measured 1.5-2.5 % faster at T=64,
// where every token is split; 0.5-1 % slower from T=128 up, where none is (the register
// allocation of the whole kernel moves), so the launcher builds PARTIAL_BF16=0 for grids
// without split tokens (launch_defines; BENCHMARKS.md, twenty-first session).
#ifndef PARTIAL_BF16
#define PARTIAL_BF16 1
#endif
#ifndef PARTIAL_EARLY
#define PARTIAL_EARLY 8
#endif
#ifndef DIAG_NO_QLOAD
#define DIAG_NO_QLOAD 0
#endif
// DIAG_NO_CHECK 1 (diagnostic, wrong results): the softmax's check (does a score pass m +
// 2^RESCALE_LOG2, or leave the f16 PV's range) and its barrier-with-OR are skipped; only each
// warpgroup's first block of a piece moves m. The time shows what the check costs the loop.
// (Defined below, after DIAG_SM_MIN, which implies it.)
// DIAG_NO_PWAIT 1 (diagnostic, wrong results): a warpgroup does not wait for the other's P^T
// (pfull) before that block's PV, so the time shows what the two warpgroups' hand-off costs.
#ifndef DIAG_NO_PWAIT
#define DIAG_NO_PWAIT 0
#endif
// Diagnostics that strip the block loop towards probe_wgmma_rate.cu's mode 9 (wrong results):
// DIAG_SM_NOSCALE 1: no separate pass scaling and masking the scores (the row scale folded into
// the exponentials by an FFMA); it implies DIAG_NO_CHECK, whose check would otherwise compare
// unscaled scores and take the rare path every block. DIAG_SM_NOG 1: P^T without its per-row
// factors. DIAG_SM_MIN 1: both, so the softmax is only the exponentials, the row sums and the
// P^T stores. DIAG_PV_CONST 1: the f16 PV multiplies by a constant instead of the loaded sigma.
// DIAG_NO_COPY 1: the producer issues no copies (the stages keep what they hold) but still
// signals them full. Those that change the data (SM_MIN, NO_COPY) also change the power drawn,
// and so the power-capped clock: their times are not instruction costs alone (BENCHMARKS.md,
// twenty-second session).
#ifndef DIAG_SM_MIN
#define DIAG_SM_MIN 0
#endif
#if DIAG_SM_MIN
#undef DIAG_SM_NOSCALE
#undef DIAG_SM_NOG
#define DIAG_SM_NOSCALE 1
#define DIAG_SM_NOG 1
#endif
#if defined(DIAG_SM_NOSCALE) && DIAG_SM_NOSCALE
#undef DIAG_NO_CHECK
#define DIAG_NO_CHECK 1
#endif
#ifndef DIAG_SM_NOSCALE
#define DIAG_SM_NOSCALE 0
#endif
#ifndef DIAG_SM_NOG
#define DIAG_SM_NOG 0
#endif
#ifndef DIAG_NO_CHECK
#define DIAG_NO_CHECK 0
#endif
#ifndef DIAG_PV_CONST
#define DIAG_PV_CONST 0
#endif
#ifndef DIAG_NO_COPY
#define DIAG_NO_COPY 0
#endif
// DIAG_REPEAT 1 (diagnostic, bf16 output only): the query load and the output stores each run
// twice, the same code in a loop (stamps between the passes), so a DIAG_TRACE build shows what a
// second, warm pass of the same instructions costs.
#ifndef DIAG_REPEAT
#define DIAG_REPEAT 0
#endif
// DIAG_QTWICE 1 (diagnostic): the query prologue loads the query twice (the first copy is
// discarded), so a DIAG_TRACE build's "query load" minus the default's is a load from L1/L2.
#ifndef DIAG_QTWICE
#define DIAG_QTWICE 0
#endif
// Registers per thread of the producer and consumer warpgroups (setmaxnreg). The CTA's pool is
// what the launch allocated, 168 x 384 (__launch_bounds__(384, 1)): a consumer count the pool
// cannot cover makes setmaxnreg.inc wait forever. 24 / 240 (default): no spills in the consumers'
// block loop (40 / 232 spilled 60 bytes there) and room for QK_GROUP 4; measured 1-2 % faster
// from T=128 up (BENCHMARKS.md, seventeenth session).
#ifndef PROD_REGS
#define PROD_REGS 24
#endif
#ifndef CONS_REGS
#define CONS_REGS 240
#endif
static_assert(128 * PROD_REGS + 256 * CONS_REGS <= 168 * 384 && PROD_REGS % 8 == 0 &&
                  CONS_REGS % 8 == 0 && PROD_REGS >= 24 && CONS_REGS <= 256,
              "setmaxnreg counts: multiples of 8 within the launch's 168 x 384 registers");
#define STR_(x) #x
#define STR(x) STR_(x)
// QK_GROUP: k-steps per wgmma commit group in the QK: 4 (default, one 16-byte load's worth: up
// to 8 wgmmas in flight), or 2.
#ifndef QK_GROUP
#define QK_GROUP 4
#endif
static_assert(QK_GROUP == 2 || QK_GROUP == 4, "QK_GROUP: 2 or 4 k-steps");
#ifndef DIAG_TRACE
#define DIAG_TRACE 0
#endif
// NEXT_PREFETCH 1 (default): once the producer has issued its CTA's last stage, it prefetches into
// L2 the query and the first 3 blocks' rows of CTA blockIdx.x + #SMs, the CTA likely to start next
// when the grid runs in waves (cp.async.bulk.prefetch.L2), so that CTA's prologue reads L2
// (measured: its query load 12.4K -> 11.0K cycles; BENCHMARKS.md, fifteenth session).
#ifndef NEXT_PREFETCH
#define NEXT_PREFETCH 1
#endif
constexpr int TRACE_ITERS = 20;  // slots per warpgroup: 18 block iterations + the piece's stamps
// QK_FP8 1: QK on the FP8 tensor cores with both operands in shared memory and no dequantisation:
// K is the raw e4m3 rows (the producer places each 16-byte piece in the wgmma's 128-B-swizzled
// layout), the query is split per head into two e4m3 terms hi + lo (exact for bf16 values within
// 2^10 of the head's largest), and the tile scales are applied in fp32 to each 128-feature
// tile's sum (sparse_mla_qk_fp8.cuh).
#ifndef QK_FP8
#define QK_FP8 0
#endif
static_assert(!QK_FP8 || PRODUCER_CPASYNC, "QK_FP8 places 16-byte pieces: the cp.async producer");
static_assert(!(QK_FP8 && (DIAG_SM_NOSCALE || DIAG_NO_COPY)),
              "DIAG_SM_NOSCALE / DIAG_NO_COPY strip the default QK's scale pass and copies only");

namespace {

constexpr int ROW = 656;        // fp8_ds_mla row bytes
constexpr int D_V = 512;        // value columns
constexpr int BN = 64;          // rows per block
constexpr int NUM_STAGES = 3;
constexpr int STAGE = BN * ROW; // 41984
constexpr int NUM_PBUF = 3;     // P^T buffers
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
constexpr int OFF_QF = OFF_CTL + 16;                     // QK_FP8: [64] f32 per-head score factors
constexpr int SMEM_BYTES = OFF_QF + 64 * 4;
[[maybe_unused]] constexpr int SMEM_ALLOC = SMEM_BYTES + 1024;  // + alignment room; the launcher's size

static_assert(64 * 1216 <= OFF_ST - OFF_QT, "the query's staging area: Q^T and P^T");
static_assert(OFF_PT % 1024 == 0 && OFF_ST % 16 == 0 && OFF_BAR % 8 == 0, "alignment");

// A stage's bytes. QK_FP8 0: the rows as copied, ROW bytes apart. QK_FP8 1: the layout of the QK
// wgmma's A operand: 128-feature tile t of row r (128 e4m3 bytes) at t * 8192 + 128 r, its 16-byte
// chunks XOR-swizzled by r % 8 (128-B swizzle, 8-row atoms 1024 bytes apart); the bf16 rope the
// same at ST_ROPE; the 4 fp32 tile scales at ST_SC + 16 r.
constexpr int ST_ROPE = 4 * 8192;  // (QK_FP8 stage layout)
constexpr int ST_SC = 5 * 8192;
static_assert(!QK_FP8 || (ST_SC + 16 * BN == STAGE && OFF_ST % 1024 == 0 && STAGE % 1024 == 0),
              "QK_FP8 stage layout");
__device__ __forceinline__ int swz(int r, int byte) {  // 128-B swizzle within a 128-byte row
  return 128 * r + ((((byte >> 4) & 7) ^ (r & 7)) << 4) + (byte & 15);
}
// value byte b (0..511) of row r
__device__ __forceinline__ int st_nope(int r, int b) {
  return QK_FP8 ? (b >> 7) * 8192 + swz(r, b & 127) : r * ROW + b;
}
__device__ __forceinline__ int st_scale(int r) { return QK_FP8 ? ST_SC + 16 * r : r * ROW + 512; }
// rope byte b (0..127) of row r
__device__ __forceinline__ int st_rope(int r, int b) {
  return QK_FP8 ? ST_ROPE + swz(r, b) : r * ROW + 528 + b;
}
// The 8 value bytes [dv0, dv0 + 8) of rows s0, s0 + 1, s0 + 8, s0 + 9 (s0 even)
__device__ __forceinline__ void v_rows(const uint8_t* stg, int s0, int dv0, uint2& r0, uint2& r1,
                                       uint2& r2, uint2& r3) {
#if QK_FP8
  const uint8_t* p = stg + st_nope(s0, dv0);
  const uint8_t* p1 = stg + st_nope(s0 + 1, dv0);
  r0 = *reinterpret_cast<const uint2*>(p);
  r1 = *reinterpret_cast<const uint2*>(p1);
  r2 = *reinterpret_cast<const uint2*>(p + 8 * 128);  // rows + 8: same swizzle
  r3 = *reinterpret_cast<const uint2*>(p1 + 8 * 128);
#else
  const uint8_t* p0 = stg + s0 * ROW;
  r0 = *reinterpret_cast<const uint2*>(p0 + dv0);
  r1 = *reinterpret_cast<const uint2*>(p0 + ROW + dv0);
  r2 = *reinterpret_cast<const uint2*>(p0 + 8 * ROW + dv0);
  r3 = *reinterpret_cast<const uint2*>(p0 + 9 * ROW + dv0);
#endif
}
// where the 16-byte piece p (0..40) of row r goes
[[maybe_unused]] __device__ __forceinline__ int st_piece(int r, int p) {
  return p < 32 ? st_nope(r, 16 * p) : (p == 32 ? st_scale(r) : st_rope(r, 16 * (p - 33)));
}

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

// ---- producer ----------------------------------------------------------------------------
// Both producers walk this CTA's range of (token, block) work items, w in [w0, w1): token
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

// PRODUCER_CPASYNC 0: one warp, a cp.async.bulk of 656 bytes per row (lane l: rows 2l, 2l+1),
// completing on `full` with expect_tx = valid rows x 656.
__device__ __forceinline__ void producer(const uint8_t* __restrict__ kv, const Work& wk, int w0,
                                         int w1, uint8_t* smem, uint32_t sbase, Bars b,
                                         int lane) {
  int* ids_s = reinterpret_cast<int*>(smem + OFF_IDS);
  int id0 = w0 < w1 ? block_id(wk, w0, 2 * lane) : -1;
  int id1 = w0 < w1 ? block_id(wk, w0, 2 * lane + 1) : -1;
  for (int w = w0; w < w1; ++w) {
    const int i = w - w0, st = i % NUM_STAGES;
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
    if (w + 1 < w1) {
      id0 = block_id(wk, w + 1, 2 * lane);
      id1 = block_id(wk, w + 1, 2 * lane + 1);
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
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}
// NEXT_PREFETCH: the query (64 head rows of 1152 bytes) and the rows of the first 3 blocks of CTA
// blockIdx.x + #SMs into L2; pt: this producer thread (0..127).
struct QueryRef {
  const __nv_bfloat16* q;
  long long stride_qt, stride_qh;
  int num_heads, num_tokens;
};
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
__device__ __forceinline__ void producer_cpasync(const uint8_t* __restrict__ kv, const Work& wk,
                                                 int w0, int w1, uint8_t* smem, uint32_t sbase,
                                                 Bars b, int pw, int lane,
                                                 const QueryRef& q) {
  int* ids_s = reinterpret_cast<int*>(smem + OFF_IDS);
  int id = w0 < w1 ? block_id(wk, w0, 16 * pw + (lane & 15)) : -1;
  for (int w = w0; w < w1; ++w) {
    const int i = w - w0, st = i % NUM_STAGES;
    const uint32_t ph = (i / NUM_STAGES) & 1;
    mbar_wait(b.empty + 8 * st, ph ^ 1);
    if (lane < 16) ids_s[st * BN + 16 * pw + lane] = id;
#if QK_FP8
    const uint32_t dst0 = sbase + OFF_ST + st * STAGE;
#pragma unroll 4
    for (int rr = 0; rr < 16; ++rr) {
      const int r_id = __shfl_sync(0xffffffffu, id, rr);
      const uint8_t* src = kv + (size_t)(r_id < 0 ? 0 : r_id) * ROW;
      const uint32_t nb = r_id < 0 ? 0u : 16u;
      const int r = 16 * pw + rr;
      cp_async16(dst0 + st_piece(r, lane), src + 16 * lane, nb);
      if (lane < 9) cp_async16(dst0 + st_piece(r, lane + 32), src + 16 * (lane + 32), nb);
    }
#else
    const uint32_t dst0 = sbase + OFF_ST + st * STAGE + 16 * pw * ROW;
#pragma unroll 4
    for (int rr = 0; rr < (DIAG_NO_COPY ? 0 : 16); ++rr) {
      const int r_id = __shfl_sync(0xffffffffu, id, rr);
      const uint8_t* src = kv + (size_t)(r_id < 0 ? 0 : r_id) * ROW;
      const uint32_t nb = r_id < 0 ? 0u : 16u;
      const uint32_t dst = dst0 + rr * ROW;
      cp_async16(dst + 16 * lane, src + 16 * lane, nb);
      if (lane < 9) cp_async16(dst + 16 * (lane + 32), src + 16 * (lane + 32), nb);
    }
#endif
    cp_async_arrive_noinc(b.full + 8 * st);
    __syncwarp();
    if (lane == 0) mbar_arrive(b.full + 8 * st);
    if (w + 1 < w1) id = block_id(wk, w + 1, 16 * pw + (lane & 15));
  }
  if (DIAG_SKIP_FULL) asm volatile("cp.async.wait_all;" ::: "memory");
  if (NEXT_PREFETCH) prefetch_next_cta(kv, wk, q, 32 * pw + lane);
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
#if QK_FP8
    uint2 r0, r1, r2, r3;
    v_rows(stg, s0, dv0, r0, r1, r2, r3);
    const uint8_t* ps = stg + st_scale(s0) + 4 * ts;  // scales: 16 bytes a row
    const float c0 = *reinterpret_cast<const float*>(ps);
    const float c1 = *reinterpret_cast<const float*>(ps + 16);
    const float c2 = *reinterpret_cast<const float*>(ps + 8 * 16);
    const float c3 = *reinterpret_cast<const float*>(ps + 9 * 16);
#else
    const uint8_t* p0 = stg + s0 * ROW;
    const uint2 r0 = *reinterpret_cast<const uint2*>(p0 + dv0);
    const uint2 r1 = *reinterpret_cast<const uint2*>(p0 + ROW + dv0);
    const uint2 r2 = *reinterpret_cast<const uint2*>(p0 + 8 * ROW + dv0);
    const uint2 r3 = *reinterpret_cast<const uint2*>(p0 + 9 * ROW + dv0);
    const float c0 = *reinterpret_cast<const float*>(p0 + 512 + 4 * ts);
    const float c1 = *reinterpret_cast<const float*>(p0 + ROW + 512 + 4 * ts);
    const float c2 = *reinterpret_cast<const float*>(p0 + 8 * ROW + 512 + 4 * ts);
    const float c3 = *reinterpret_cast<const float*>(p0 + 9 * ROW + 512 + 4 * ts);
#endif
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

// acc[j][4jj + k] is (dv row, head 8jj + 2c + (k & 1)); alpha[2jj + b] that head's factor.
__device__ __forceinline__ void rescale(float (&d)[32], const float (&alpha)[16]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) d[i] *= alpha[2 * (i >> 2) + (i & 1)];
}

// Writes this thread's O^T values for its 16 heads: out[head, dv0 .. dv0+8), head rows D_V
// elements apart (the launcher's out is contiguous [T, H, 512]).
// The stores are at constant offsets from one base address. ALL: num_heads == 64, no per-head
// test. (With a test per head, each head is a branch of its own and ptxas staged every 16-byte
// store through the same 4 registers and a fresh address register: each head's packing then
// waited on the long scoreboard for the previous store to have read them; ncu, sixteenth
// session. 32-bit stores, which need no staging, were slower from T=256 up.)
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

// DIAG_TRACE: a clock64 stamp k of trace slot `slot`
__device__ __forceinline__ void stamp(long long* trace, int slot, int k, int wt) {
  if (DIAG_TRACE && wt == 0) {
    long long t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
    trace[16 * slot + k] = t;
  }
}
// (DIAG_TRACE) a value, not a clock: the piece's role in its token's merge, or %globaltimer (ns,
// one clock for all SMs) into slot TRACE_ITERS - 2
__device__ __forceinline__ void stamp_value(long long* trace, int slot, int k, int wt,
                                            long long v) {
  if (DIAG_TRACE && wt == 0) trace[16 * slot + k] = v;
}
__device__ __forceinline__ long long global_ns() {
  long long t = 0;
  if (DIAG_TRACE) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

#include "sparse_mla_fp8_seesaw.cuh"

// ---- work split -------------------------------------------------------------------------------
// The W = T * nb (token, 64-row block) items are cut into G = gridDim.x contiguous ranges, the
// first W % G of ceil(W / G) items, the others of floor(W / G). A token cut by a range boundary
// is a split token: each of its pieces takes a ticket on the token's first counter; all but the
// last to arrive write their normalised partial (O in fp32, or in bf16 with PARTIAL_BF16 and bf16
// output; the natural-log LSE in fp32) to a workspace
// slot and count it on the second counter; the last waits for that count and merges the others'
// partials with its own, which never leaves its registers. Only the last piece waits, and only
// for pieces that already hold tickets (so are running and wait on nothing): any number of CTAs
// may be resident at once. Each cut costs a second query prologue, a pipeline restart and the
// merge, so the default grid cuts tokens only to fill the SMs at small T.
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

// A split piece's partial, normalised O (acc * inv) in the accumulators' own layout: slot
// [32][256 threads] float4, value q of consumer thread tc = acc[q / 8][4 (q % 8) .. + 4) (heads
// 8 (q % 8) + 2c + {0, 1, 0, 1}), which is also the merging thread's own. Each store takes 4 consecutive accumulator registers and a warp writes 512 contiguous bytes.
// PARTIAL_BF16 (bf16 output): slot [16][256 threads] uint4, value p of thread tc the bf16 of
// values 2p and 2p + 1 of the fp32 layout (a warp writes 512 contiguous bytes).
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

// The last piece of a split token to arrive merges the partials of all its pieces (slots of
// CTAs c_a..c_b; at most MAX_PIECES, which the launcher's grid size ensures) into acc and writes
// the token's LSE. Its own piece (index own) never left its registers: acc holds it unnormalised
// (inv its 1/l). Every load of a phase is independent of the others, so each costs about one L2
// latency: (a) the pieces' LSEs into wts [MAX_PIECES][64] (shared), (b) per head, the LSE and
// each piece's weight, (c) acc = the weighted sum of the pieces' normalised partials.
constexpr int MAX_PIECES = 8;
static_assert(MAX_PIECES * 64 * 4 <= OFF_ALPHA - OFF_RED, "the merge's weights live in OFF_RED");
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
template <bool BF16>
__device__ __forceinline__ void merge_pieces(float (&acc)[4][32], const float (&inv)[16],
                                             const float* __restrict__ ws_o,
                                             const float* __restrict__ ws_l, float* wts, int c_a,
                                             int c_b, int own, int tw, int W, int G, float* lse,
                                             int num_heads, int tc, int c) {
  const int np = c_b - c_a + 1;
  // BF16: the first PARTIAL_EARLY loads of the first other piece's partial are issued before the
  // weights (they do not depend on them)
  const int k0 = own == 0 ? 1 : 0;
  uint4 x[16];
  if constexpr (BF16 && PARTIAL_EARLY > 0) {
    const uint4* src = reinterpret_cast<const uint4*>(
                           ws_o + (long long)piece_slot(c_a + k0, tw, W, G) * 64 * D_V) + tc;
#pragma unroll
    for (int p = 0; p < PARTIAL_EARLY; ++p) x[p] = __ldcg(src + 256 * p);
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
  {
    const float* wk = wts + 64 * own + 2 * c;
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const float f0 = inv[2 * jj] * wk[8 * jj], f1 = inv[2 * jj + 1] * wk[8 * jj + 1];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        acc[j][4 * jj] *= f0;
        acc[j][4 * jj + 1] *= f1;
        acc[j][4 * jj + 2] *= f0;
        acc[j][4 * jj + 3] *= f1;
      }
    }
  }
  if constexpr (BF16) {
    for (int k = 0; k < np; ++k) {
      if (k == own) continue;
      const uint4* src = reinterpret_cast<const uint4*>(
                             ws_o + (long long)piece_slot(c_a + k, tw, W, G) * 64 * D_V) + tc;
#pragma unroll
      for (int p = 0; p < 16; ++p)
        if (k != k0 || p >= PARTIAL_EARLY) x[p] = __ldcg(src + 256 * p);
      add_partial_bf16(acc, x, wts + 64 * k + 2 * c);
    }
    return;
  }
  for (int k = 0; k < np; ++k) {
    if (k == own) continue;
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

}  // namespace

// Grid (G, 1), any G >= 1 (more than the SMs run in waves), 384 threads, one CTA per SM.
// out [T, H, 512] (bf16 or fp32; contiguous: stride_oh must be 512), lse [T, H] fp32; ws_o
// [2G, 64, 512] fp32 (DIAG_TRACE: then G x 5 KB of stamps) and ws_l [2G, 64] the split tokens'
// partials; counters [2T] int32, zero on entry (the merging piece re-zeroes its token's two, so
// they are zero again on exit).
extern "C" __global__ void __launch_bounds__(384, 1) sparse_mla_fp8_sm90(
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
      mbar_init(b.full + 8 * s, PRODUCER_CPASYNC ? 132 : 1);
      mbar_init(b.empty + 8 * s, 256);
    }
    for (int s = 0; s < NUM_PBUF; ++s) {
      mbar_init(b.pfull + 8 * s, 128);
      mbar_init(b.pempty + 8 * s, 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // PRODUCER_CPASYNC 0: rows of a -1 id keep what the stage held (masked, never NaN), so the
  // stages are zeroed once. The cp.async producer zero-fills those rows itself (src-size 0).
  if (!PRODUCER_CPASYNC)
    for (int o = tid * 16; o < NUM_STAGES * STAGE; o += 384 * 16)
      *reinterpret_cast<uint4*>(smem + OFF_ST + o) = make_uint4(0, 0, 0, 0);
  fence_proxy_async();
  __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 " STR(PROD_REGS) ";\n");
    if (PRODUCER_CPASYNC)
      producer_cpasync(kv, wk, w0, w1, smem, sbase, b, warp, lane,
                       QueryRef{q, stride_qt, stride_qh, num_heads, num_tokens});
    else if (warp == 0)
      producer(kv, wk, w0, w1, smem, sbase, b, lane);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 " STR(CONS_REGS) ";\n");
  if (DIAG_MEM_ONLY) {
    for (int i = 0; i < w1 - w0; ++i) {
      mbar_wait(b.full + 8 * (i % NUM_STAGES), (i / NUM_STAGES) & 1);
      mbar_arrive(b.empty + 8 * (i % NUM_STAGES));
    }
    return;
  }
  const int half = wg - 1;
  const int wt = tid - 128 * wg;  // thread within its warpgroup
  const int w = wt >> 5, g = (wt & 31) >> 2, c = wt & 3;
  const int dv0 = 256 * half + 8 * (8 * w + g);
  int* ctl_s = reinterpret_cast<int*>(smem + OFF_CTL);
  // (DIAG_TRACE: past the 2G partial slots, which split tokens write; the launcher adds room)
  long long* trace = DIAG_TRACE ? reinterpret_cast<long long*>(ws_o + (long long)2 * G * 64 * D_V) +
                                      (long long)(2 * blockIdx.x + half) * TRACE_ITERS * 16
                                : nullptr;
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
                        scale_log2, smem, sbase, b, half, wt, acc, l, trace);
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
      stamp(trace, TRACE_ITERS - 1, 5, wt);
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
      stamp(trace, TRACE_ITERS - 1, 6, wt);
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
#if PV_F16
    {  // O accumulated in units of 2^E (E_NONE: nothing had a scale, O is zero)
      const int E = reinterpret_cast<const int*>(smem + OFF_EX)[0];
      const float fe = E == E_NONE ? 0.f : exp2i(E);
#pragma unroll
      for (int i = 0; i < 16; ++i) inv[i] *= fe;
    }
#endif
    const Piece pc = piece_at(wi, nb, num_tokens);
    stamp(trace, TRACE_ITERS - 1, 7, wt);
    if (!pc.split) {
#if DIAG_REPEAT
#pragma unroll 1
      for (int pass = 0; pass < 2; ++pass) {  // the same stores twice (same values)
        store_out<false>(acc, inv, out, pc.t * stride_ot, num_heads, dv0, c);
        if (pass == 0) stamp(trace, TRACE_ITERS - 2, 4, wt);
      }
#else
      if (DIAG_NO_OUT) {
      } else if (out_fp32)
        store_out<true>(acc, inv, out, pc.t * stride_ot, num_heads, dv0, c);
      else
        store_out<false>(acc, inv, out, pc.t * stride_ot, num_heads, dv0, c);
#endif
    } else if (DIAG_NO_MERGE) {
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
      stamp(trace, TRACE_ITERS - 1, 11, wt);
      stamp_value(trace, TRACE_ITERS - 1, 14, wt, ctl_s[0] ? 1 : 2);  // 1 merges, 2 stores
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
        stamp(trace, TRACE_ITERS - 1, 12, wt);
      } else {
        if (wt == 0 && half == 0) {
          while (ld_acquire_gpu(cnt + 1) < c_b - c_a) {
          }
          cnt[0] = 0;  // zero again for the next launch
          cnt[1] = 0;
        }
        bar_sync(3, 256);
        stamp(trace, TRACE_ITERS - 1, 12, wt);
        if (pbf)
          merge_pieces<true>(acc, inv, ws_o, ws_l, reinterpret_cast<float*>(smem + OFF_RED), c_a,
                             c_b, pc.cta - c_a, pc.tw, pc.W, pc.G, lse + pc.t * stride_lt,
                             num_heads, 128 * half + wt, c);
        else
          merge_pieces<false>(acc, inv, ws_o, ws_l, reinterpret_cast<float*>(smem + OFF_RED), c_a,
                              c_b, pc.cta - c_a, pc.tw, pc.W, pc.G, lse + pc.t * stride_lt,
                              num_heads, 128 * half + wt, c);
        stamp(trace, TRACE_ITERS - 1, 13, wt);
        float one[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) one[i] = 1.f;
#if DIAG_REPEAT
#pragma unroll 1
        for (int pass = 0; pass < 2; ++pass) {
          store_out<false>(acc, one, out, pc.t * stride_ot, num_heads, dv0, c);
          if (pass == 0) stamp(trace, TRACE_ITERS - 2, 4, wt);
        }
#else
        if (out_fp32)
          store_out<true>(acc, one, out, pc.t * stride_ot, num_heads, dv0, c);
        else
          store_out<false>(acc, one, out, pc.t * stride_ot, num_heads, dv0, c);
#endif
      }
    }
    stamp(trace, TRACE_ITERS - 1, 2, wt);
    stamp_value(trace, TRACE_ITERS - 2, 1, wt, global_ns());
    wi += pc.npb;
  }
}
