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

// Four codes in one word, byte i from x[i].
__device__ __forceinline__ uint32_t e4m3x4_rn_satfinite(float x0, float x1, float x2, float x3) {
  return e4m3x2_rn_satfinite(x0, x1) | (e4m3x2_rn_satfinite(x2, x3) << 16);
}

}  // namespace flamia::sm90
