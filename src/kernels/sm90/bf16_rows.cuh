// 16-byte BF16 row stores from a wgmma accumulator fragment (the backward's dK and dV, the
// forward's O). There a thread holds, per row and 8-column group, 2 adjacent columns: stored as
// they are, each warp store writes 8 rows x 16 B, half sectors, 4 bytes a lane. A 4 x 4 word
// transpose over the quad (the 4 lanes of a row, two shuffle rounds) gives each lane 8 adjacent
// columns instead: 16 bytes a lane, 8 rows x 64 B (whole sectors) a warp store, a quarter of the
// store instructions.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

namespace flamia::sm90 {

constexpr int kQuadLanes = 4;
constexpr int kWideStoreElems = 8;                            // BF16 elements per 16-byte store
constexpr int kQuadSpanElems = kQuadLanes * kWideStoreElems;  // one transpose's 4 groups

// Two floats rounded to BF16, `lo` in the low half, as one word (also the dQ postprocess's).
__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t bits;
  memcpy(&bits, &v, sizeof(bits));
  return bits;
}

// Lane q of a quad holds w[j], its 2 columns of group j (j < 4); returns the quad's 4 words of
// group q in lane order: the group's 8 columns. Round 1 swaps word pairs with lane q ^ 2, round 2
// single words with lane q ^ 1. Only the quad's lanes take part, so a quad may skip its row. The
// lane comes from %laneid: of the forms measured, this one left the backward's step loop its best
// schedule (ptxas re-schedules that loop for any change here; docs/PERF.md, item 91).
template <bool kWholeWarp = false>
__device__ __forceinline__ uint4 quad_transpose(const uint32_t (&w)[kQuadLanes]) {
  uint32_t lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  const unsigned quad_mask =
      kWholeWarp ? 0xFFFFFFFFu : ((1u << kQuadLanes) - 1) << (lane & ~(kQuadLanes - 1u));
  const bool high = lane & 2, odd = lane & 1;
  const uint32_t s0 = __shfl_xor_sync(quad_mask, high ? w[0] : w[2], 2);
  const uint32_t s1 = __shfl_xor_sync(quad_mask, high ? w[1] : w[3], 2);
  const uint32_t c0 = high ? s0 : w[0], c1 = high ? s1 : w[1];
  const uint32_t c2 = high ? w[2] : s0, c3 = high ? w[3] : s1;
  const uint32_t t0 = __shfl_xor_sync(quad_mask, odd ? c0 : c1, 1);
  const uint32_t t1 = __shfl_xor_sync(quad_mask, odd ? c2 : c3, 1);
  return make_uint4(odd ? t0 : c0, odd ? c1 : t0, odd ? t1 : c2, odd ? c3 : t1);
}

// The same, called by the whole warp (full-mask shuffles: no convergence scope around them).
__device__ __forceinline__ uint4 quad_transpose_warp(const uint32_t (&w)[kQuadLanes]) {
  return quad_transpose<true>(w);
}

}  // namespace flamia::sm90
