// QK_FP8: the scores on the FP8 tensor cores, no dequantisation (included by
// sparse_mla_fp8_seesaw.cuh, inside sparse_mla_fp8_sm90.cu's anonymous namespace).
//
// S^T[64 rows x 64 heads] = rope + sum over the 4 tiles t of scale[row, t] * (K_t . (Qhi_t + Qlo_t)^T)
// - K_t: the stage's raw e4m3 bytes of tile t (A, shared memory, placed by the producer in the
//   128-B-swizzled K-major layout: st_nope), so QK issues no conversion at all;
// - Qhi + Qlo: the query times a power of two 2^eq[h] per head, split into two e4m3 terms
//   (split_e4m3x2): exact for bf16 values within 2^10 of the head's largest, within 2^-10 (of
//   2^7..2^8 for the largest) below; each tile's k32 step is two wgmmas on the same A;
// - the tile's sum is taken out of the tensor core (its own fp32 accumulation over 128 features,
//   as DeepSeek-V3 promotes FP8 GEMM sums every 128) and scaled by the row's fp32 tile scale into S;
// - the rope (bf16, x 2^eq) is one more k64 of bf16 wgmmas into S.
// The softmax multiplies S by qf[h] = scale_log2 * 2^-eq[h] (OFF_QF).

constexpr int QT_HI = 16384, QT_LO = 8192, QT_ROPE = 65536;  // Q regions (bytes from OFF_QT)

// The whole query into its FP8 layout: tile t's Qhi at OFF_QT + 16384 t, Qlo 8192 further, 64
// heads x 128 bytes each (128-B swizzle); the rope as bf16 at QT_ROPE. Thread (head h, quarter
// qq) holds tile qq of head h; the 4 threads of a head share its amax by two shuffles.
__device__ __forceinline__ void load_query64_fp8(const __nv_bfloat16* __restrict__ qrow,
                                                 long long stride_qh, int num_heads, int half,
                                                 uint8_t* smem, int wt, float scale_log2,
                                                 long long* trace) {
  const int hl = wt >> 2, qq = wt & 3, h = 32 * half + hl;
  uint4 v[18];
  float amax = load_query_quarter(qrow, stride_qh, num_heads, half, wt, v);
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  stamp(trace, TRACE_ITERS - 1, 3, wt);
  bar_sync(3, 256);
  stamp(trace, TRACE_ITERS - 1, 4, wt);
  // (every consumer thread is past the previous piece's QKs and epilogue: the query regions and
  // the stabilisers can be rewritten)
  if (half == 0 && wt < 64) reinterpret_cast<float*>(smem + OFF_M)[wt] = -INFINITY;
  if (half == 1 && wt == 0) reinterpret_cast<int*>(smem + OFF_EX)[0] = E_NONE;
  // the head's largest |x| in [2^7, 2^8): within e4m3's normal range with room below 448
  int eq = amax > 0.f ? 7 - ilog2(amax) : 0;
  eq = eq < -120 ? -120 : (eq > 120 ? 120 : eq);
  const float qf = exp2i(eq);
  if (qq == 0) reinterpret_cast<float*>(smem + OFF_QF)[h] = scale_log2 * exp2i(-eq);
  uint8_t* hi = smem + OFF_QT + qq * QT_HI + h * 128;
#pragma unroll
  for (int j = 0; j < 8; ++j) {  // bytes 16j .. 16j + 15 of the tile: v[2j], v[2j + 1]
    const uint32_t ws[8] = {v[2 * j].x,     v[2 * j].y,     v[2 * j].z,     v[2 * j].w,
                            v[2 * j + 1].x, v[2 * j + 1].y, v[2 * j + 1].z, v[2 * j + 1].w};
    uint32_t hw[4], lw[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ws[2 * i]));
      const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ws[2 * i + 1]));
      uint32_t ha, la, hb, lb;
      split_e4m3x2(a.x * qf, a.y * qf, ha, la);
      split_e4m3x2(b.x * qf, b.y * qf, hb, lb);
      hw[i] = ha | (hb << 16);
      lw[i] = la | (lb << 16);
    }
    const int off = ((j ^ (h & 7)) << 4);
    *reinterpret_cast<uint4*>(hi + off) = make_uint4(hw[0], hw[1], hw[2], hw[3]);
    *reinterpret_cast<uint4*>(hi + QT_LO + off) = make_uint4(lw[0], lw[1], lw[2], lw[3]);
  }
  uint8_t* rope = smem + OFF_QT + QT_ROPE + h * 128;
#pragma unroll
  for (int k = 0; k < 2; ++k) {  // rope dims 16 qq + 8k .. + 8: bytes 32 qq + 16 k
    const uint32_t ws[4] = {v[16 + k].x, v[16 + k].y, v[16 + k].z, v[16 + k].w};
    uint32_t o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ws[e]));
      o[e] = pack_bf16(f.x * qf, f.y * qf);
    }
    *reinterpret_cast<uint4*>(rope + (((2 * qq + k) ^ (h & 7)) << 4)) =
        make_uint4(o[0], o[1], o[2], o[3]);
  }
  fence_proxy_async();
  bar_sync(3, 256);
}

// Tile t's K_t . (Qhi_t + Qlo_t)^T into acc (fresh): 4 k32 steps, each two wgmmas on one A.
__device__ __forceinline__ void qk8_tile(float (&acc)[32], uint32_t da, uint32_t dq, int t) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint64_t a = desc(da + t * (8192 >> 4) + 2 * kk);
    const uint32_t b = dq + t * (QT_HI >> 4) + 2 * kk;
    wgmma_e4m3_ss(acc, a, desc(b), kk > 0);
    wgmma_e4m3_ss(acc, a, desc(b + (QT_LO >> 4)), 1);
  }
}

// S^T for all 64 heads from the stage at shared address `stage` (generic pointer stg), rows r0,
// r1 of this thread; returns the rows' largest tile scales (mx0, mx1), their exponents (e0, e1)
// and this thread's tile c scales (ca, cb), as qk_block64 does.
__device__ __forceinline__ void qk_block64_fp8(float (&s)[32], const uint8_t* stg, uint32_t stage,
                                               uint32_t dq, int r0, int r1, int c, int& e0,
                                               int& e1, float& mx0, float& mx1, float& ca,
                                               float& cb) {
  const uint32_t da = desc_lo(stage);
  const float* sc0 = reinterpret_cast<const float*>(stg + ST_SC + 16 * r0);
  const float* sc1 = reinterpret_cast<const float*>(stg + ST_SC + 16 * r1);
  float acc[32];
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < 4; ++k)  // the rope: S = K_rope . Q_rope^T (bf16, k16 steps of 32 bytes)
    wgmma_bf16_ss(s, desc(da + (ST_ROPE >> 4) + 2 * k), desc(dq + (QT_ROPE >> 4) + 2 * k), k > 0);
  qk8_tile(acc, da, dq, 0);
  wgmma_commit();
  // one tile accumulator (a second one for the next tile needs registers the budget lacks:
  // ptxas then serialises every wgmma and spills ~1 KB)
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const float f0 = sc0[t], f1 = sc1[t];  // (loaded under the wgmmas)
    wgmma_wait<0>();
    fence_acc(acc);
    if (t == 0) fence_acc(s);
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = fmaf(acc[i], (i & 2) ? f1 : f0, s[i]);
    if (t < 3) {
      wgmma_fence();
      qk8_tile(acc, da, dq, t + 1);
      wgmma_commit();
    }
  }
  row_scales(*reinterpret_cast<const float4*>(sc0), *reinterpret_cast<const float4*>(sc1), c,
             mx0, mx1, e0, e1, ca, cb);
}
