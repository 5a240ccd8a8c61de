// The butterflies of flamia/hadamard.h's rotation for rows spread over a thread's registers and
// over lanes. Each stage is a set of correctly rounded a + b and a - b, so a row split any way over
// registers and lanes gets hadamard_rotate's bits as long as the stages run in its order (spans 1,
// 2, 4, ...) and the final multiply comes last.
#pragma once

#include <cstdint>

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

}  // namespace flamia::sm90
