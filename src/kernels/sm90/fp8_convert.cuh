// Hardware E4M3 conversion for the quantizer's hot loop. `cvt.rn.satfinite.e4m3x2.f32` is one
// instruction for two codes where e4m3::encode (formats.h) costs about a dozen integer operations
// each; tests/gpu/test_gpu_quantize.cu proves the two agree on every non-NaN float.
#pragma once

#include <cstdint>

namespace flamia::sm90 {

// Two E4M3 codes, round to nearest even with saturation to +-448: `lo` in the low byte.
__device__ __forceinline__ uint32_t e4m3x2_rn_satfinite(float lo, float hi) {
  uint16_t packed;
  // The first source lands in the upper byte.
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  return packed;
}

// The values of two E4M3 codes (`lo` in the low byte), exact: every E4M3 value is an FP16 one.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint16_t codes) {
  uint32_t halves;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(codes));
  float lo, hi;
  asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(uint16_t(halves)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(uint16_t(halves >> 16)));
  return make_float2(lo, hi);
}

// Four codes in one word, byte i from x[i].
__device__ __forceinline__ uint32_t e4m3x4_rn_satfinite(float x0, float x1, float x2, float x3) {
  return e4m3x2_rn_satfinite(x0, x1) | (e4m3x2_rn_satfinite(x2, x3) << 16);
}

// The four E4M3 codes of a word, each times its factor (a power of two, at most 1), rounded: the
// tile codes of flamia/quantize.h.
__device__ __forceinline__ uint32_t e4m3x4_scaled(uint32_t w, float f0, float f1, float f2,
                                                  float f3) {
  const float2 lo = e4m3x2_to_float2(uint16_t(w));
  const float2 hi = e4m3x2_to_float2(uint16_t(w >> 16));
  return e4m3x2_rn_satfinite(lo.x * f0, lo.y * f1) |
         (e4m3x2_rn_satfinite(hi.x * f2, hi.y * f3) << 16);
}

// E4M3 register A fragments (wgmma m64k32, four b32 per slice) from an f32 accumulator fragment
// whose columns are the next product's K index; slice k holds columns 32k..32k+31. No shuffle: a
// thread's accumulator columns {2t, 2t+1, 2t+8, 2t+9} of each 16 become its fragment bytes
// k = 4t..4t+3, so the B operand must store every 16 positions of K in that order (the quantizer's
// transposed_slot, flamia/quantize.h).
template <int kSlices>
__device__ __forceinline__ void pack_a_fragments(const float (&acc)[16 * kSlices],
                                                 uint32_t (&a)[kSlices][4]) {
#pragma unroll
  for (int k = 0; k < kSlices; ++k)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int lo = 4 * (4 * k + 2 * h) + 2 * r, hi = lo + 4;
        a[k][2 * h + r] = e4m3x4_rn_satfinite(acc[lo], acc[lo + 1], acc[hi], acc[hi + 1]);
      }
}

}  // namespace flamia::sm90
