// Online softmax of one key tile on the S = Q K^T accumulator fragment (DESIGN §4; the algorithm
// of flamia/emulator.h, step for step):
//   u_ij = S_ij * 2^e_k(j)                     K scale of the column (mxfp8 only; on K's tile
//                                              codes one per tile, in the row factor)
//   m_i  = running max of u_ij * rf_i           rf_i = softmax scale * log2(e) * 2^e_q(i)
//   P_ij = 2^(u_ij rf_i - m_i + 8) <= 2^8       the E4M3 budget's offset
//   R_i  = running max of the visible e_v(j);  P~_ij = P_ij * 2^(e_v(j) - R_i) <= 2^8 < 448
//   l_i  = sum of the unrounded P_ij;  O_i kept in units of 2^R_i
// A thread holds rows r and r + 8 of its warp's 16 (kRows) and, per 8 columns, columns 2t, 2t + 1
// of its quad (wgmma accumulator fragment); row statistics are reduced over the quad.
//
// Fully visible tiles read V's tile codes, whose codes carry 2^(e_v(j) - T) (T = the tile's
// largest e_v, flamia/quantize.h): the fold is 2^(T - R_i), row-uniform, in the exponent argument,
// and costs no instruction per element. The masked tile must not let invisible keys reach any
// rounding of a visible row (T would), so it reads the per-token codes and folds per element
// against the row's own reference exponent.
#pragma once

#include <climits>
#include <cmath>

#include "flamia/emulator.h"
#include "fwd_scales.cuh"
#include "mask.cuh"
#include "wgmma.cuh"

namespace flamia::sm90::fwd {

constexpr int kRows = 2;  // accumulator rows per thread
constexpr int kAccRegs = wgmma::acc_regs(kBlockN);
constexpr int kColPairs = kAccRegs / 4;  // 8-column groups: registers 4g..4g+3
constexpr float kPOffset = float(kPOffsetLog2);
constexpr int kNoReference = INT_MIN / 4;  // R before any visible key (differences stay finite)
constexpr unsigned kFullMask = 0xFFFFFFFFu;

// ex2.approx.ftz.f32: the one exponential of the forward and its backward recomputation.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 2^e for integer e <= 0, exactly, subnormals included, 0 below 2^-149 (the emulator's
// scale_by_pow2 of 1).
__device__ __forceinline__ float pow2_nonpositive(int e) {
  constexpr int kMinSubnormal = -149;
  return e >= kMinSubnormal ? exp2i(e) : 0.0f;
}

__device__ __forceinline__ int acc_row_half(int i) {
  return (i >> 1) & 1;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(kFullMask, x, 1));
  return fmaxf(x, __shfl_xor_sync(kFullMask, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(kFullMask, x, 1);
  return x + __shfl_xor_sync(kFullMask, x, 2);
}

struct RowState {
  float m[kRows];   // running max of the scaled logits (log2 units); -inf before any key
  float l[kRows];   // this thread's share of the row sum of P (quad-reduced in the epilogue)
  int ref[kRows];   // R: the running V reference exponent
  float rf[kRows];  // row factor softmax scale * log2(e) * 2^e_q

  __device__ __forceinline__ void init(const float (&row_factor)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      m[r] = -INFINITY;
      l[r] = 0.0f;
      ref[r] = kNoReference;
      rf[r] = row_factor[r];
    }
  }
};

// u = S * 2^e_k(column).
__device__ __forceinline__ void scale_columns(float (&s)[kAccRegs], const KeyScales& ks, int quad) {
#pragma unroll
  for (int g = 0; g < kColPairs; ++g) {
    const float2 k = *reinterpret_cast<const float2*>(&ks.scale[8 * g + 2 * quad]);
    s[4 * g + 0] *= k.x;
    s[4 * g + 1] *= k.y;
    s[4 * g + 2] *= k.x;
    s[4 * g + 3] *= k.y;
  }
}

__device__ __forceinline__ void row_maxima(const float (&s)[kAccRegs], float (&mx)[kRows]) {
  mx[0] = mx[1] = -INFINITY;
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) mx[acc_row_half(i)] = fmaxf(mx[acc_row_half(i)], s[i]);
  mx[0] = quad_max(mx[0]);
  mx[1] = quad_max(mx[1]);
}

// The new running max of a row; a row that has seen no visible key keeps the exponent base 0
// so that -inf - -inf never forms a NaN.
__device__ __forceinline__ float updated_max(float m, float tile_max_u, float rf) {
  return fmaxf(m, tile_max_u * rf);
}
__device__ __forceinline__ float exp_base(float m) {
  return m == -INFINITY ? 0.0f : m;
}

// A fully visible tile. On return s holds P~ and o_rescale the factor that takes the running O
// to the new max and reference exponent. s holds S on K's tile codes (or BF16 K), whose one key
// scale is key_unit: u = S key_unit.
__device__ __forceinline__ void softmax_visible_tile(float (&s)[kAccRegs], RowState& st,
                                                     const ValueScales& vs, float key_unit,
                                                     float (&o_rescale)[kRows]) {
  float mx[kRows];
  row_maxima(s, mx);
  const int tile_ref = vs.tile_max;
  float addend[kRows], lsum[kRows], undo[kRows], rf[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    rf[r] = st.rf[r] * key_unit;  // exact: a power of two
    const float m_new = updated_max(st.m[r], mx[r], rf[r]);
    const int ref_new = max(st.ref[r], tile_ref);
    const int delta = max(tile_ref - ref_new, -kFoldFloorLog2);  // <= 0
    const float alpha = exp2_approx(st.m[r] - exp_base(m_new));
    o_rescale[r] = alpha * pow2_nonpositive(st.ref[r] - ref_new);
    st.l[r] *= alpha;
    addend[r] = (kPOffset - exp_base(m_new)) + float(delta);
    undo[r] = pow2_normal(-delta);
    lsum[r] = 0.0f;
    st.m[r] = m_new;
    st.ref[r] = ref_new;
  }
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) {
    const int r = acc_row_half(i);
    s[i] = exp2_approx(fmaf(s[i], rf[r], addend[r]));
    lsum[r] += s[i];
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) st.l[r] = fmaf(lsum[r], undo[r], st.l[r]);
}

// The masked tile: keys past each row's last visible key get P = 0, and the fold uses the row's
// exact reference exponent (the prefix maximum of e_v up to its last visible key).
template <MaskKind kMask>
__device__ __forceinline__ void softmax_masked_tile(float (&s)[kAccRegs], RowState& st,
                                                    const ValueScales& vs, int quad,
                                                    const int (&row)[kRows], int diagonal,
                                                    int keys_left, float (&o_rescale)[kRows]) {
  int last[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) last[r] = last_visible_key<kMask>(row[r], diagonal, keys_left);
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i)
    if (wgmma::acc_col(quad, i) > last[acc_row_half(i)]) s[i] = -INFINITY;
  float mx[kRows];
  row_maxima(s, mx);
  float base[kRows], lsum[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float m_new = updated_max(st.m[r], mx[r], st.rf[r]);
    // last >= 0: a warpgroup's 64 rows and a key tile's start are both 64-aligned in the
    // document, so its rows either all precede the tile (an idle turn, mainloop_fwd.cuh) or all
    // see a key of it; rows past the document's end still see its keys up to the end.
    const int ref_new = max(st.ref[r], vs.prefix_max[last[r]]);
    const float alpha = exp2_approx(st.m[r] - exp_base(m_new));
    o_rescale[r] = alpha * pow2_nonpositive(st.ref[r] - ref_new);
    st.l[r] *= alpha;
    base[r] = kPOffset - exp_base(m_new);
    lsum[r] = 0.0f;
    st.m[r] = m_new;
    st.ref[r] = ref_new;
  }
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) {
    const int r = acc_row_half(i);
    const float p = exp2_approx(fmaf(s[i], st.rf[r], base[r]));
    lsum[r] += p;
    // Invisible keys may carry any exponent: the clamp keeps their factor finite (P is 0).
    const int e = min(max(vs.exponent[wgmma::acc_col(quad, i)] - st.ref[r], -kFoldFloorLog2), 0);
    s[i] = p * pow2_normal(e);
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) st.l[r] += lsum[r];
}

}  // namespace flamia::sm90::fwd
