// K's codes_tiles and V's codes_t_tiles (flamia/quantize.h): codes requantized, per
// document-relative key tile, to the tile's largest exponent. Memory-bound: each code is read and
// written once.
//
// V: a CTA takes 128 positions of one head's codes_t rows: eight 16-position groups, each inside
// one document's tile or in a gap between documents (documents start 16-aligned and tiles are eight
// groups from there). First each warp finds its groups' documents and tile maxima and stages one
// multiplier per position; then the CTA rewrites every dim row of the 128 positions, 16 bytes a
// thread, consecutive threads on consecutive bytes of a row.
#include <climits>
#include <cstdint>

#include "arch.cuh"
#include "check.h"
#include "flamia/quantize.h"
#include "fp8_convert.cuh"
#include "tile_codes.h"

namespace flamia::sm90::quant {
namespace {

constexpr int kCtaPositions = kKeyTileTokens;
constexpr int kGroups = kCtaPositions / kTransposedGroup;
constexpr int kTileThreads = 128;
constexpr int kTileWarps = kTileThreads / int(kWarpThreads);
constexpr int kGroupsPerWarp = kGroups / kTileWarps;
constexpr int kChunkBytes = 16;  // one uint4 per thread and row
constexpr int kChunksPerRow = kCtaPositions / kChunkBytes;
static_assert(kGroupsPerWarp * kTileWarps == kGroups, "warps split the groups evenly");
static_assert(kChunkBytes == kTransposedGroup, "a thread's chunk is one group");
static_assert(kKeyTileTokens % int(kWarpThreads) == 0, "a warp reads a tile's exponents");

// The token of slot s of a 16-group: the inverse of transposed_slot.
__device__ __forceinline__ int slot_token(int s) {
  return 2 * (s >> 2) + (s & 1) + 8 * ((s >> 1) & 1);
}

// The last document b in [0, num_docs) with starts_by(b), a predicate that holds for a prefix of
// the documents (their starts are non-decreasing).
template <typename StartsBy>
__device__ int last_document(int num_docs, StartsBy starts_by) {
  int lo = 0, hi = num_docs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts_by(mid)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__global__ void __launch_bounds__(kTileThreads)
    tile_codes_kernel(const __grid_constant__ TileCodesArgs a) {
  __shared__ float multiplier[kCtaPositions];
  const int h = int(blockIdx.y);
  const int64_t first = int64_t(blockIdx.x) * kCtaPositions;
  const int warp = int(threadIdx.x / kWarpThreads), lane = int(lane_index());
  const uint8_t* exponents = a.exponents + int64_t(h) * a.tokens_padded;

  for (int i = 0; i < kGroupsPerWarp; ++i) {
    const int g = warp * kGroupsPerWarp + i;
    const int64_t pos = first + int64_t(g) * kTransposedGroup;
    const int b = last_document(
        a.num_docs, [&](int d) { return transposed_doc_begin(a.cu_seqlens[d], d) <= pos; });
    const int64_t begin = a.cu_seqlens[b];
    const int length = int(a.cu_seqlens[b + 1] - begin);
    const int64_t r0 = pos - transposed_doc_begin(begin, b);  // a multiple of 16
    // Gap positions (code 0) and tokens past the document take any finite factor.
    float factor = 1.0f;
    if (r0 < length) {
      const int n0 = int(r0) / kKeyTileTokens * kKeyTileTokens;
      const int keys = min(kKeyTileTokens, length - n0);
      int tile_max = INT_MIN;
      for (int j = lane; j < keys; j += int(kWarpThreads))
        tile_max = max(tile_max, int(exponents[begin + n0 + j]) - ue8m0::kBias);
      tile_max = __reduce_max_sync(0xFFFFFFFFu, tile_max);
      const int s = lane % kTransposedGroup;
      const int r = int(r0) + slot_token(s);
      if (r < length)
        factor = exp2i(tile_shift(int(exponents[begin + r]) - ue8m0::kBias, tile_max));
    }
    if (lane < kTransposedGroup) multiplier[g * kTransposedGroup + lane] = factor;
  }
  __syncthreads();

  const int chunk = int(threadIdx.x) % kChunksPerRow;
  const float* m = &multiplier[chunk * kChunkBytes];
  for (int d = int(threadIdx.x) / kChunksPerRow; d < a.dim; d += kTileThreads / kChunksPerRow) {
    const int64_t at = (int64_t(h) * a.dim + d) * a.tokens_t + first + chunk * kChunkBytes;
    if (first + chunk * kChunkBytes >= a.tokens_t) break;
    uint4 in = *reinterpret_cast<const uint4*>(a.codes + at);
    uint32_t* w = &in.x;
#pragma unroll
    for (int k = 0; k < 4; ++k)
      w[k] = e4m3x4_scaled(w[k], m[4 * k], m[4 * k + 1], m[4 * k + 2], m[4 * k + 3]);
    *reinterpret_cast<uint4*>(a.tiles + at) = in;
  }
}

// K: a warp takes 32 consecutive tokens of one head. A token's tile lies within 127 tokens of it,
// so the warp stages the exponents from 127 tokens before its first to 127 after its last, each
// lane finds its token's tile and the maximum there (lanes of one tile read the same words), and
// the warp rewrites its 32 rows (the head dim of one head each), 16 bytes a lane, a row's bytes on
// consecutive lanes.
constexpr int kKeyWarpTokens = int(kWarpThreads);
constexpr int kKeyWarps = kTileThreads / int(kWarpThreads);
constexpr int kReach = kKeyTileTokens - 1;
constexpr int kWindow = kKeyWarpTokens + 2 * kReach;

__global__ void __launch_bounds__(kTileThreads)
    key_tile_codes_kernel(const __grid_constant__ TileCodesArgs a) {
  __shared__ int16_t window[kKeyWarps][kWindow + 1];
  const int h = int(blockIdx.y);
  const int warp = int(threadIdx.x / kWarpThreads), lane = int(lane_index());
  const int64_t first = (int64_t(blockIdx.x) * kKeyWarps + warp) * kKeyWarpTokens;
  if (first >= a.tokens) return;
  const int64_t window0 = first - kReach;
  const uint8_t* row_exponents = a.exponents + int64_t(h) * a.tokens_padded;
  // Exponents as stored (biased): a shift is a difference of two.
  for (int i = lane; i < kWindow; i += int(kWarpThreads)) {
    const int64_t t = window0 + i;
    window[warp][i] = int16_t(t >= 0 && t < a.tokens ? int(row_exponents[t]) - ue8m0::kBias : 0);
  }
  __syncwarp();
  const int64_t t = first + lane;
  float factor = 1.0f;
  if (t < a.tokens) {
    const int b = last_document(a.num_docs, [&](int d) { return a.cu_seqlens[d] <= t; });
    const int64_t begin = a.cu_seqlens[b], end = a.cu_seqlens[b + 1];
    const int64_t n0 = begin + (t - begin) / kKeyTileTokens * kKeyTileTokens;
    const int64_t n1 = min(n0 + kKeyTileTokens, end);
    int tile_max = INT_MIN;
    for (int64_t j = n0; j < n1; ++j) tile_max = max(tile_max, int(window[warp][j - window0]));
    factor = exp2i(tile_shift(int(window[warp][t - window0]), tile_max));
  }
  constexpr int kLanesPerRow = kKeyTileTokens / kChunkBytes;  // a 128 B row: 8 lanes
  const int rows_per_pass = int(kWarpThreads) / kLanesPerRow;
  for (int r = lane / kLanesPerRow; r < kKeyWarpTokens; r += rows_per_pass) {
    const float f = __shfl_sync(0xFFFFFFFFu, factor, r);  // every lane: the same trip count
    if (first + r >= a.tokens) continue;
    const int64_t row = ((first + r) * a.heads + h) * a.dim;
    for (int c = (lane % kLanesPerRow) * kChunkBytes; c < a.dim; c += kLanesPerRow * kChunkBytes) {
      uint4 in = *reinterpret_cast<const uint4*>(a.codes + row + c);
      uint32_t* w = &in.x;
#pragma unroll
      for (int k = 0; k < 4; ++k) w[k] = e4m3x4_scaled(w[k], f, f, f, f);
      *reinterpret_cast<uint4*>(a.tiles + row + c) = in;
    }
  }
}

}  // namespace

void launch_key_tile_codes(const TileCodesArgs& args, cudaStream_t stream) {
  if (args.tokens == 0 || args.heads == 0) return;
  constexpr int64_t kCtaTokens = kKeyWarps * kKeyWarpTokens;
  const dim3 grid(unsigned((args.tokens + kCtaTokens - 1) / kCtaTokens), unsigned(args.heads));
  key_tile_codes_kernel<<<grid, kTileThreads, 0, stream>>>(args);
  FLAMIA_CUDA_CHECK_LAUNCH();
}

void launch_value_tile_codes(const TileCodesArgs& args, cudaStream_t stream) {
  if (args.tokens_t == 0 || args.heads == 0) return;
  const dim3 grid(unsigned((args.tokens_t + kCtaPositions - 1) / kCtaPositions),
                  unsigned(args.heads));
  tile_codes_kernel<<<grid, kTileThreads, 0, stream>>>(args);
  FLAMIA_CUDA_CHECK_LAUNCH();
}

}  // namespace flamia::sm90::quant
