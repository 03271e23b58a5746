// The SCHEDULE_SEESAW=1 consumer of sparse_mla_fp8_sm90.cu (included inside its anonymous
// namespace, after the default consumer's helpers it reuses). Not yet run on a GPU.
#pragma once

// ---- SCHEDULE_SEESAW: each warpgroup scores alternate blocks for all 64 heads ------------------
// Warpgroup h scores blocks j = h, h + 2, ...: S^T[64 rows x 64 heads] (n64: half the QK wgmmas
// and half the K dequantisation per warpgroup of the 32-head split), its softmax, P^T[j & 1];
// both warpgroups then run PV of every block on their value half, in block order (per block j
// of its own: PV of block j - 1, QK_j, softmax_j, PV_j; QK_j overlaps the other warpgroup's
// softmax). The stabiliser m is one shared
// array (OFF_M): softmaxes run in block order (block j waits for block j-1's publication,
// pfull), so both warpgroups read the same m, and it moves (rarely) only in the scoring
// warpgroup's slow path; alpha and a moved-flag go with P^T. pempty[b]: both warpgroups have
// retired PV of the block that last used P^T[b].

// The whole query (64 heads) into the shared Q^T: 9 atoms of [64 heads x 128 B]; each
// warpgroup loads its 32 heads; one power of two for the query (both warpgroups' amax).
__device__ __forceinline__ float load_query64(const __nv_bfloat16* __restrict__ qrow,
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
  float* misc = reinterpret_cast<float*>(smem + OFF_MISC);
  if (lane == 0) misc[4 * half + w] = amax;
  bar_sync(3, 256);
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
      *reinterpret_cast<uint32_t*>(atom + (((x ^ sw) << 4) | (4 * qq))) = pack_f16(f.x * qf, f.y * qf);
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

// S^T for all 64 heads (n64): as qk_block, with 8192-byte atoms.
__device__ __forceinline__ void qk_block64(float (&s)[32], const uint8_t* row0, const uint8_t* row1,
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
    for (int hk = 0; hk < 2; ++hk) {
      uint32_t a[2][4];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        uint32_t f0, f1, f2, f3;
        e4m3x4_to_f16x4(x0[2 * hk + k], f0, f2);
        e4m3x4_to_f16x4(x1[2 * hk + k], f1, f3);
        a[k][0] = hmul2(f0, h0);
        a[k][1] = hmul2(f1, h1);
        a[k][2] = hmul2(f2, h0);
        a[k][3] = hmul2(f3, h1);
      }
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int kk = 4 * mm + 2 * hk + k;
        wgmma_f16(s, a[k][0], a[k][1], a[k][2], a[k][3],
                  desc(dq + (uint32_t)(((kk >> 2) * 8192 + (kk & 3) * 32) >> 4)), kk > 0);
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

// PV of block j (scored by either warpgroup) on this warpgroup's value half, after its
// published alpha; then release P^T[j & 1] and the stage.
__device__ __forceinline__ void seesaw_pv(float (&acc)[4][32], float (&l)[16], int j, bool mine,
                                          const float (&al_mine)[16], bool moved_mine,
                                          uint8_t* smem, uint32_t sbase, Bars b, int half, int w,
                                          int g, int c) {
  const int buf = j & 1, st = j % NUM_STAGES;
  float alpha[16];
  bool moved = moved_mine;
  if (mine) {
#pragma unroll
    for (int i = 0; i < 16; ++i) alpha[i] = al_mine[i];
  } else {
    mbar_wait(b.pfull + 8 * buf, (j >> 1) & 1);
    mbar_wait(b.full + 8 * st, (j / NUM_STAGES) & 1);  // orders our reads of the stage
    moved = reinterpret_cast<const int*>(smem + OFF_FLAG)[buf] != 0;
    const float* alpha_s = reinterpret_cast<const float*>(smem + OFF_ALPHA) + buf * 64;
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const float2 x = *reinterpret_cast<const float2*>(alpha_s + 8 * jj + 2 * c);
      alpha[2 * jj] = x.x;
      alpha[2 * jj + 1] = x.y;
    }
  }
  if (moved) {  // uniform: one flag per block
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) rescale(acc[jj], alpha);
    if (!mine) {
#pragma unroll
      for (int i = 0; i < 16; ++i) l[i] *= alpha[i];
    }
  }
  const uint8_t* stg = smem + OFF_ST + st * STAGE;
  pv_block(acc, stg, desc_lo(sbase + OFF_PT) + buf * (8192 >> 4), half, w, g, c);
  wgmma_wait<0>();
  mbar_arrive(b.pempty + 8 * buf);
  mbar_arrive(b.empty + 8 * st);
}

__device__ __forceinline__ void consumer_seesaw(const __nv_bfloat16* __restrict__ qrow,
                                                long long stride_qh, int num_heads, int nblk,
                                                float scale_log2, uint8_t* smem, uint32_t sbase,
                                                Bars b, int half, int wt, float (&acc)[4][32],
                                                float (&l)[16]) {
  const int w = wt >> 5, lane = wt & 31, g = lane >> 2, c = lane & 3;
  const float base_f = scale_log2 * load_query64(qrow, stride_qh, num_heads, half, smem, wt, lane, w);
  const uint32_t dq = desc_lo(sbase + OFF_QT);
  const int r0 = 16 * w + g, r1 = r0 + 8;
  const int* ids_s = reinterpret_cast<const int*>(smem + OFF_IDS);
  float* m_s = reinterpret_cast<float*>(smem + OFF_M);
  float* red_s = reinterpret_cast<float*>(smem + OFF_RED);
  float* alpha_s = reinterpret_cast<float*>(smem + OFF_ALPHA);
  int* flag_s = reinterpret_cast<int*>(smem + OFF_FLAG);
  const float none[16] = {};
#pragma unroll 1
  for (int j = half; j < nblk; j += 2) {
    const int st = j % NUM_STAGES, buf = j & 1;
    const uint8_t* stg = smem + OFF_ST + st * STAGE;
    // The other warpgroup's previous block first: its PV (which also publishes the m this
    // block's softmax starts from) frees its stage a block earlier, and no S is live across it.
    if (j > 0) seesaw_pv(acc, l, j - 1, false, none, false, smem, sbase, b, half, w, g, c);
    mbar_wait(b.full + 8 * st, (j / NUM_STAGES) & 1);
    float s[32];
    int e0, e1;
    qk_block64(s, stg + r0 * ROW, stg + r1 * ROW, dq, c, e0, e1);
    const bool v0 = ids_s[st * BN + r0] >= 0, v1 = ids_s[st * BN + r1] >= 0;
    const float f0 = base_f * exp2i(e0), f1 = base_f * exp2i(e1);
    float m[16], mb[16];
    bool over = false;
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const float2 x = *reinterpret_cast<const float2*>(m_s + 8 * jj + 2 * c);
      m[2 * jj] = x.x;
      m[2 * jj + 1] = x.y;
#pragma unroll
      for (int bb = 0; bb < 2; ++bb) {
        s[4 * jj + bb] = v0 ? s[4 * jj + bb] * f0 : -INFINITY;
        s[4 * jj + 2 + bb] = v1 ? s[4 * jj + 2 + bb] * f1 : -INFINITY;
        mb[2 * jj + bb] = fmaxf(s[4 * jj + bb], s[4 * jj + 2 + bb]);
        over |= mb[2 * jj + bb] > m[2 * jj + bb] + RESCALE_LOG2;
      }
    }
    // mb holds the block's row maxima, then (to save registers) each head's alpha
    const bool moved = bar_red_or(1 + half, 128, over);
    if (moved) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
#pragma unroll
        for (int hh = 0; hh < 16; ++hh)
          mb[hh] = fmaxf(mb[hh], __shfl_xor_sync(0xffffffffu, mb[hh], o));
      }
      float* red = red_s + half * 256;
      if (g == 0) {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj)
          *reinterpret_cast<float2*>(red + w * 64 + 8 * jj + 2 * c) =
              make_float2(mb[2 * jj], mb[2 * jj + 1]);
      }
      bar_sync(1 + half, 128);
#pragma unroll
      for (int ww = 0; ww < 4; ++ww) {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const float2 r = *reinterpret_cast<const float2*>(red + ww * 64 + 8 * jj + 2 * c);
          mb[2 * jj] = fmaxf(mb[2 * jj], r.x);
          mb[2 * jj + 1] = fmaxf(mb[2 * jj + 1], r.y);
        }
      }
#pragma unroll
      for (int hh = 0; hh < 16; ++hh) {
        const bool up = mb[hh] > m[hh] + RESCALE_LOG2;
        const float al = up && m[hh] != -INFINITY ? ex2(m[hh] - mb[hh]) : 1.f;
        m[hh] = up ? mb[hh] : m[hh];
        mb[hh] = al;
      }
      bar_sync(1 + half, 128);  // every warp has read m_s and red before they are rewritten
      if (w == 0 && g == 0) {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj)
          *reinterpret_cast<float2*>(m_s + 8 * jj + 2 * c) = make_float2(m[2 * jj], m[2 * jj + 1]);
      }
    } else {
#pragma unroll
      for (int hh = 0; hh < 16; ++hh) mb[hh] = 1.f;
    }
    const float (&al)[16] = mb;
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float ms = m[2 * jj + (k & 1)] == -INFINITY ? 0.f : m[2 * jj + (k & 1)];
        s[4 * jj + k] = ex2(s[4 * jj + k] - ms);
      }
#pragma unroll
      for (int bb = 0; bb < 2; ++bb)
        l[2 * jj + bb] = l[2 * jj + bb] * al[2 * jj + bb] + s[4 * jj + bb] + s[4 * jj + 2 + bb];
    }
    // P^T[buf] was last read by PV of block j - 2, by both warpgroups
    mbar_wait(b.pempty + 8 * buf, ((j >> 1) & 1) ^ 1);
    const uint32_t pt = sbase + OFF_PT + buf * 8192;
#pragma unroll
    for (int qq = 0; qq < 4; ++qq) {
      const int hf = qq >> 1, jb = 4 * (qq & 1);
      const int head = 8 * (jb + (lane >> 3)) + (lane & 7);
      const uint32_t addr = pt + head * 128 + ((((2 * w + hf) ^ (head & 7))) << 4);
      stmatrix_x4_trans(addr, pack_bf16(s[4 * jb + 2 * hf], s[4 * jb + 2 * hf + 1]),
                        pack_bf16(s[4 * (jb + 1) + 2 * hf], s[4 * (jb + 1) + 2 * hf + 1]),
                        pack_bf16(s[4 * (jb + 2) + 2 * hf], s[4 * (jb + 2) + 2 * hf + 1]),
                        pack_bf16(s[4 * (jb + 3) + 2 * hf], s[4 * (jb + 3) + 2 * hf + 1]));
    }
    if (w == 0 && g == 0) {
#pragma unroll
      for (int jj = 0; jj < 8; ++jj)
        *reinterpret_cast<float2*>(alpha_s + buf * 64 + 8 * jj + 2 * c) =
            make_float2(al[2 * jj], al[2 * jj + 1]);
      if (c == 0) flag_s[buf] = moved ? 1 : 0;
    }
    fence_proxy_async();
    mbar_arrive(b.pfull + 8 * buf);
    bar_sync(1 + half, 128);  // this warpgroup's PV reads every warp's part of P^T
    seesaw_pv(acc, l, j, true, al, moved, smem, sbase, b, half, w, g, c);
  }
  // the last block, if the other warpgroup scored it
  if (nblk > 0 && ((nblk - 1 - half) & 1))
    seesaw_pv(acc, l, nblk - 1, false, none, false, smem, sbase, b, half, w, g, c);
}

