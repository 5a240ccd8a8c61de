// V's codes_t_tiles (flamia/quantize.h): codes_t requantized, per document-relative key tile, to
// the tile's largest exponent. Memory-bound: each code is read and written once.
//
// A CTA takes 128 positions of one head's codes_t rows: eight 16-position groups, each inside one
// document's tile or in a gap between documents (documents start 16-aligned and tiles are eight
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

constexpr int kCtaPositions = kValueTileTokens;
constexpr int kGroups = kCtaPositions / kTransposedGroup;
constexpr int kTileThreads = 128;
constexpr int kTileWarps = kTileThreads / int(kWarpThreads);
constexpr int kGroupsPerWarp = kGroups / kTileWarps;
constexpr int kChunkBytes = 16;  // one uint4 per thread and row
constexpr int kChunksPerRow = kCtaPositions / kChunkBytes;
static_assert(kGroupsPerWarp * kTileWarps == kGroups, "warps split the groups evenly");
static_assert(kChunkBytes == kTransposedGroup, "a thread's chunk is one group");
static_assert(kValueTileTokens % int(kWarpThreads) == 0, "a warp reads a tile's exponents");

// The token of slot s of a 16-group: the inverse of transposed_slot.
__device__ __forceinline__ int slot_token(int s) {
  return 2 * (s >> 2) + (s & 1) + 8 * ((s >> 1) & 1);
}

// The last document b with transposed_doc_begin(cu_seqlens[b], b) <= pos.
__device__ int document_at(const int32_t* cu_seqlens, int num_docs, int64_t pos) {
  int lo = 0, hi = num_docs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (transposed_doc_begin(cu_seqlens[mid], mid) <= pos) {
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
    const int b = document_at(a.cu_seqlens, a.num_docs, pos);
    const int64_t begin = a.cu_seqlens[b];
    const int length = int(a.cu_seqlens[b + 1] - begin);
    const int64_t r0 = pos - transposed_doc_begin(begin, b);  // a multiple of 16
    // Gap positions (code 0) and tokens past the document take any finite factor.
    float factor = 1.0f;
    if (r0 < length) {
      const int n0 = int(r0) / kValueTileTokens * kValueTileTokens;
      const int keys = min(kValueTileTokens, length - n0);
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
    uint4 in = *reinterpret_cast<const uint4*>(a.codes_t + at);
    uint32_t* w = &in.x;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 lo = e4m3x2_to_float2(uint16_t(w[k]));
      const float2 hi = e4m3x2_to_float2(uint16_t(w[k] >> 16));
      const float* f = m + 4 * k;
      w[k] = e4m3x2_rn_satfinite(lo.x * f[0], lo.y * f[1]) |
             (e4m3x2_rn_satfinite(hi.x * f[2], hi.y * f[3]) << 16);
    }
    *reinterpret_cast<uint4*>(a.tiles + at) = in;
  }
}

}  // namespace

void launch_tile_codes(const TileCodesArgs& args, cudaStream_t stream) {
  if (args.tokens_t == 0 || args.heads == 0) return;
  const dim3 grid(unsigned((args.tokens_t + kCtaPositions - 1) / kCtaPositions),
                  unsigned(args.heads));
  tile_codes_kernel<<<grid, kTileThreads, 0, stream>>>(args);
  FLAMIA_CUDA_CHECK_LAUNCH();
}

}  // namespace flamia::sm90::quant
