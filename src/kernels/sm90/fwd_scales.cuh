// Per-key scale vectors of one key tile, staged in shared memory by the producer warp (DESIGN §2):
// the K scales multiply S's columns (a masked tile's; a visible tile's S is on K's tile codes,
// whose one scale is tile_unit); the V exponents fold into P~ relative to a reference exponent.
//
// Each lane reads the UE8M0 codes of kKeysPerLane consecutive keys from global memory (before it
// waits for the stage, so the latency overlaps the wait), converts them, and writes them next to
// the tile's TMA data; every lane then arrives on the stage's full barrier.
#pragma once

#include <climits>
#include <cstdint>

#include "arch.cuh"
#include "flamia/formats.h"
#include "fwd_params.h"

namespace flamia::sm90::fwd {

constexpr int kKeysPerLane = kBlockN / int(kWarpThreads);
static_assert(kKeysPerLane * int(kWarpThreads) == kBlockN, "one warp covers a key tile");

// Folds below 2^-kFoldFloorLog2 are clamped there (a row's reference exponent may lie far above
// a tile's): P~ <= 2^8 * 2^-64 rounds to E4M3 zero either way.
constexpr int kFoldFloorLog2 = 64;
constexpr uint8_t kUnitExponentCode = ue8m0::kBias;  // 2^0: keys past the exponent array

// 16-byte aligned: each lane stores its keys with one vector store per array.
struct alignas(16) KeyScales {
  float scale[kBlockN];  // 2^e_k(j): the masked tiles
  float tile_unit;       // 2^max_j e_k(j): the visible tiles, on K's tile codes
};

struct alignas(16) ValueScales {
  int exponent[kBlockN];    // e_v(j): the masked tile's exact per-row fold
  int prefix_max[kBlockN];  // max of e_v over keys 0..j: the masked tile's reference exponent
  int tile_max;
};

// 2^e for -126 <= e <= 127 (callers clamp into that range).
__device__ __forceinline__ float pow2_normal(int e) {
  return __uint_as_float(uint32_t(e + kFloatBias) << kFloatMantissaBits);
}

// Row factors of one work item's Q tile: softmax scale * log2(e) * 2^e_q per row, staged with the
// tile so that a consumer starts an item without a global load on its critical path.
constexpr int kQRowsPerLane = kBlockM / int(kWarpThreads);
static_assert(kQRowsPerLane * int(kWarpThreads) == kBlockM, "one warp covers a query tile");

struct alignas(16) QueryFactors {
  float row[kBlockM];
};

// Codes of rows t0 + lane + 32 j of one head's exponent row (rows outside [0, Tp) read as 2^0:
// a leading partial tile starts before the document).
__device__ __forceinline__ void load_row_codes(uint32_t (&code)[kQRowsPerLane], const uint8_t* row,
                                               int64_t t0, int64_t tokens_padded, int lane) {
#pragma unroll
  for (int j = 0; j < kQRowsPerLane; ++j) {
    const int64_t t = t0 + lane + int(kWarpThreads) * j;
    code[j] = t >= 0 && t < tokens_padded ? __ldg(row + t) : kUnitExponentCode;
  }
}

__device__ __forceinline__ void stage_query_factors(QueryFactors& dst,
                                                    const uint32_t (&code)[kQRowsPerLane],
                                                    float scale_log2, int lane) {
#pragma unroll
  for (int j = 0; j < kQRowsPerLane; ++j)
    dst.row[lane + int(kWarpThreads) * j] = scale_log2 * ue8m0::decode(uint8_t(code[j]));
}

struct LaneExponents {
  uint32_t code[kKeysPerLane];
};

// Codes of keys t0 + kKeysPerLane * lane + j of one head's exponent row; keys past the padded
// row (only in a masked tile) read as 2^0.
__device__ __forceinline__ LaneExponents load_lane_exponents(const uint8_t* row, int64_t t0,
                                                             int64_t tokens_padded, int lane) {
  LaneExponents e;
#pragma unroll
  for (int j = 0; j < kKeysPerLane; ++j) {
    const int64_t t = t0 + kKeysPerLane * lane + j;
    e.code[j] = t < tokens_padded ? __ldg(row + t) : kUnitExponentCode;
  }
  return e;
}

__device__ __forceinline__ void stage_key_scales(KeyScales& dst, const LaneExponents& e, int lane) {
  float4 v;
  v.x = ue8m0::decode(uint8_t(e.code[0]));
  v.y = ue8m0::decode(uint8_t(e.code[1]));
  v.z = ue8m0::decode(uint8_t(e.code[2]));
  v.w = ue8m0::decode(uint8_t(e.code[3]));
  static_assert(kKeysPerLane == 4, "one float4 per lane");
  *reinterpret_cast<float4*>(&dst.scale[kKeysPerLane * lane]) = v;
  // Powers of two compare as their exponents; keys past the exponent row read 2^0 (a masked
  // tile's only: visible tiles lie inside the document).
  const uint32_t top =
      __reduce_max_sync(0xFFFFFFFFu, __float_as_uint(fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w))));
  if (lane == 0) dst.tile_unit = __uint_as_float(top);
}

__device__ __forceinline__ void stage_value_scales(ValueScales& dst, const LaneExponents& e,
                                                   int lane) {
  constexpr unsigned kFull = 0xFFFFFFFFu;
  int ev[kKeysPerLane], prefix[kKeysPerLane];
  int run = INT_MIN;
#pragma unroll
  for (int j = 0; j < kKeysPerLane; ++j) {
    ev[j] = int(e.code[j]) - ue8m0::kBias;
    run = max(run, ev[j]);
    prefix[j] = run;
  }
  // Inclusive warp scan of the lane maxima, then the exclusive part folds into each key.
  int scan = run;
#pragma unroll
  for (int d = 1; d < int(kWarpThreads); d *= 2) {
    const int other = __shfl_up_sync(kFull, scan, d);
    if (lane >= d) scan = max(scan, other);
  }
  const int before = __shfl_up_sync(kFull, scan, 1);
  const int tile_max = __shfl_sync(kFull, scan, kWarpThreads - 1);
  int4 ex, pm;
  int* exs = &ex.x;
  int* pms = &pm.x;
#pragma unroll
  for (int j = 0; j < kKeysPerLane; ++j) {
    exs[j] = ev[j];
    pms[j] = lane > 0 ? max(prefix[j], before) : prefix[j];
  }
  *reinterpret_cast<int4*>(&dst.exponent[kKeysPerLane * lane]) = ex;
  *reinterpret_cast<int4*>(&dst.prefix_max[kKeysPerLane * lane]) = pm;
  if (lane == 0) dst.tile_max = tile_max;
}

}  // namespace flamia::sm90::fwd
