// The butterflies of flamia/hadamard.h's rotation for rows spread over a thread's registers and
// over lanes. Each stage is a set of correctly rounded a + b and a - b, so a row split any way over
// registers and lanes gets hadamard_rotate's bits as long as the stages run in its order (spans 1,
// 2, 4, ...) and the final multiply comes last.
#pragma once

#include <cstdint>

#include "flamia/hadamard.h"

namespace flamia::sm90 {

// A pair of one stage inside a thread: (x[j], x[j + span]) becomes (a + b, a - b).
__device__ __forceinline__ void hadamard_pair(float& a, float& b) {
  const float sum = __fadd_rn(a, b), difference = __fsub_rn(a, b);
  a = sum;
  b = difference;
}

// A pair of one stage split over the lanes `lane_bit` apart: the lane without the bit holds x[j]
// and gets a + b, the one with it (`upper`) holds x[j + span] and gets a - b. A row's lanes must
// form an aligned group of the warp, so that lane_bit of the lane index is the same bit of the
// lane's position in the row (`upper`). Every lane of the warp must take part.
__device__ __forceinline__ float hadamard_across_lanes(float v, uint32_t lane_bit, bool upper) {
  constexpr unsigned kFull = 0xFFFFFFFFu;
  const float other = __shfl_xor_sync(kFull, v, lane_bit);
  return upper ? __fsub_rn(other, v) : __fadd_rn(v, other);
}

// Orthonormal Walsh-Hadamard rotation of kRows rows, each spread over kLanes lanes (an aligned
// group, hadamard_across_lanes) of kChunk consecutive values: hadamard_rotate's stages in its
// order (the spans inside the thread, then across lanes), then one multiply. `lane_c`: the lane's
// position in its row.
template <int kLanes, int kRows, int kChunk>
__device__ __forceinline__ void hadamard_rows(float (&v)[kRows][kChunk], int lane_c) {
#pragma unroll
  for (int span = 1; span < kChunk; span *= 2)
#pragma unroll
    for (int base = 0; base < kChunk; base += 2 * span)
#pragma unroll
      for (int j = base; j < base + span; ++j)
#pragma unroll
        for (int r = 0; r < kRows; ++r) hadamard_pair(v[r][j], v[r][j + span]);
#pragma unroll
  for (int bit = 1; bit < kLanes; bit *= 2) {
    const bool upper = lane_c & bit;  // holds x[j + span] of each pair
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int j = 0; j < kChunk; ++j) v[r][j] = hadamard_across_lanes(v[r][j], bit, upper);
  }
  const float scale = hadamard_scale<float>(kLanes * kChunk);
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int j = 0; j < kChunk; ++j) v[r][j] = __fmul_rn(v[r][j], scale);
}

}  // namespace flamia::sm90
