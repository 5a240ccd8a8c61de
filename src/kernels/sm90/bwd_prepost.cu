// The backward's preprocess (D, and the dQ accumulator's clear unless a forward did it),
// postprocess (dQ to BF16) and, with Hadamard-rotated Q and K, the pass that rotates dK back.
#include <algorithm>

#include "arch.cuh"
#include "bf16_rows.cuh"
#include "bwd_params.h"
#include "check.h"
#include "dq_clear.cuh"
#include "flamia/formats.h"
#include "fp8_convert.cuh"
#include "hadamard_lanes.cuh"

namespace flamia::sm90::bwd {
namespace {

// Preprocess: 8 lanes per (token, query head) row, 4 rows per warp. Lane j of a row takes the
// row's elements 4j + 32k .. 4j + 32k + 3 for k = 0..3, so each of its four loads is, over the
// row's lanes, one contiguous 32-byte run of codes and 64-byte run of O.
constexpr int kPreThreads = 256;
constexpr int kLanesPerRow = 8;
constexpr int kRowsPerBlock = kPreThreads / kLanesPerRow;
constexpr int kQuadElems = 4;                                          // per load
constexpr int kQuadsPerLane = kHeadDim / (kLanesPerRow * kQuadElems);  // 4
constexpr int kQuadStride = kLanesPerRow * kQuadElems;                 // elements between them
static_assert(kQuadsPerLane * kQuadStride == kHeadDim, "the row's lanes cover the head dim");

// D_i = sum_d (dO code_id * 2^e_dO(i)) * O_id, the values dP uses times the forward's O; every
// lane sums its 16 products in order and the row's lanes reduce in a fixed tree, so D is the same
// on every run.
__global__ void __launch_bounds__(kPreThreads)
    preprocess_kernel(const __grid_constant__ PreprocessParams p) {
  // The clear's stores first: they leave while the loads below are in flight.
  const DqClear& c = p.dq_clear;
  if (*c.zeroed == 0)
    zero_vectors(c.accum, c.vectors, int64_t(blockIdx.x) * kPreThreads + threadIdx.x,
                 int64_t(gridDim.x) * kPreThreads);
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanesPerRow;
  const int part = int(threadIdx.x % kLanesPerRow);
  const bool active = row < p.tokens * p.heads_q;
  const int64_t token = active ? row / p.heads_q : 0;
  const int head = active ? int(row % p.heads_q) : 0;
  float sum = 0.0f;
  if (active) {
    const float unit =
        exp2i(int(p.dout_exponents[int64_t(head) * p.tokens_padded + token]) - ue8m0::kBias);
    const uint8_t* codes = p.dout_codes + row * kHeadDim + kQuadElems * part;
    const uint16_t* o = p.o + token * p.o_stride_token + head * p.o_stride_head + kQuadElems * part;
#pragma unroll
    for (int k = 0; k < kQuadsPerLane; ++k) {
      const uint32_t c = *reinterpret_cast<const uint32_t*>(codes + k * kQuadStride);
      const uint2 ob = *reinterpret_cast<const uint2*>(o + k * kQuadStride);
      const float2 d01 = e4m3x2_to_float2(uint16_t(c)), d23 = e4m3x2_to_float2(uint16_t(c >> 16));
      sum += (d01.x * unit) * bf16::decode(uint16_t(ob.x));
      sum += (d01.y * unit) * bf16::decode(uint16_t(ob.x >> 16));
      sum += (d23.x * unit) * bf16::decode(uint16_t(ob.y));
      sum += (d23.y * unit) * bf16::decode(uint16_t(ob.y >> 16));
    }
  }
#pragma unroll
  for (int d = kLanesPerRow / 2; d > 0; d /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, d);
  if (active && part == 0) p.delta[int64_t(head) * p.tokens + token] = sum;
}

// Postprocess: one CTA per (query head, dQ slot). The slot's float4s (coalesced 16-byte loads,
// dq_slot_quad's four elements each) go to a row-major tile in shared memory; then each warp
// converts whole rows, a lane four consecutive columns, so a row's 256 BF16 bytes leave in one
// coalesced store (straight from the fragment order, a store touched eight rows with 16 bytes each:
// 2.2 TB/s, docs/PERF.md). Only the rows of the slot's query tile inside its document are stored.
constexpr int kPostThreads = 256;
constexpr int kSlotQuads = kDqSlotFloats / 4;
constexpr int kRowQuads = kHeadDim / 4;  // float4s per row

// A row of dQ or dK of Hadamard-rotated Q and K back to the inputs' frame: a warp holds the row,
// four consecutive columns a lane (column 4 lane + j in component j).
static_assert(kRowQuads == int(kWarpThreads), "a warp holds a row");
__device__ __forceinline__ void rotate_row(float4& v, int lane) {
  float x[1][4] = {{v.x, v.y, v.z, v.w}};
  hadamard_rows<kRowQuads>(x, lane);
  v = make_float4(x[0][0], x[0][1], x[0][2], x[0][3]);
}

// Columns col .. col + 3 of row (token, head).
__device__ __forceinline__ void store_bf16x4(const Bf16Rows& rows, int64_t token, int head, int col,
                                             float4 v) {
  uint16_t* out = rows.data + token * rows.stride_token + head * rows.stride_head + col;
  const uint32_t lo = bf16x2_bits(v.x, v.y), hi = bf16x2_bits(v.z, v.w);
  if (rows.quad_stores) {
    *reinterpret_cast<uint2*>(out) = make_uint2(lo, hi);
  } else {
    reinterpret_cast<uint32_t*>(out)[0] = lo;
    reinterpret_cast<uint32_t*>(out)[1] = hi;
  }
}

// Padding: a warp's float2 stores into the tile cover rows r .. r + 7 at the same columns, which
// without it would fall in four banks.
constexpr int kTilePad = 8;

__global__ void __launch_bounds__(kPostThreads)
    postprocess_kernel(const __grid_constant__ PostprocessParams p) {
  const int64_t slot = blockIdx.x % p.dq_slots;
  const int head = int(blockIdx.x / p.dq_slots);
  // The slot's document: the last one whose first slot is at or before it.
  int lo = 0, hi = p.num_docs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (dq_tile_slot(p.cu_seqlens[mid], mid, 0) <= slot)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int64_t begin = p.cu_seqlens[lo];
  const int length = int(p.cu_seqlens[lo + 1] - begin);
  // This kernel reads the accumulator last: the next forward or preprocess zeroes it again.
  if (blockIdx.x == 0 && threadIdx.x == 0) *p.dq_zeroed = 0;
  const int first_row = int(slot - dq_tile_slot(begin, lo, 0)) * kBlockM;
  if (first_row >= length) return;  // a slot between documents
  __shared__ alignas(16) float tile[kBlockM][kHeadDim + kTilePad];
  const float4* in = reinterpret_cast<const float4*>(
      p.dq_accum + (int64_t(head) * p.dq_slots + slot) * kDqSlotFloats);
  for (int i = int(threadIdx.x); i < kSlotQuads; i += kPostThreads) {
    const float4 acc = in[i];
    const DqQuad at = dq_slot_quad(4 * i);
    *reinterpret_cast<float2*>(&tile[at.row][at.col]) = make_float2(acc.x, acc.y);
    *reinterpret_cast<float2*>(&tile[at.row + 8][at.col]) = make_float2(acc.z, acc.w);
  }
  __syncthreads();
  for (int e = int(threadIdx.x); e < kBlockM * kRowQuads; e += kPostThreads) {
    const int row = e / kRowQuads, col = 4 * (e % kRowQuads);
    const int r = first_row + row;
    if (r >= length) break;  // rows only grow with e; a warp's lanes share theirs (rotate_row)
    float4 v = *reinterpret_cast<const float4*>(&tile[row][col]);
    v = make_float4(v.x * p.scale, v.y * p.scale, v.z * p.scale, v.w * p.scale);
    if (p.rotate) rotate_row(v, col / 4);
    store_bf16x4(p.dq, begin + r, head, col, v);
  }
}

// The rotated dK rows: one warp a (token, key/value head) row, a lane four consecutive columns.
constexpr int kRotateThreads = 256;
constexpr int kRotateRowsPerBlock = kRotateThreads / int(kWarpThreads);

__global__ void __launch_bounds__(kRotateThreads)
    rotate_dk_kernel(const __grid_constant__ RotateDkParams p) {
  const int64_t row = int64_t(blockIdx.x) * kRotateRowsPerBlock + threadIdx.x / kWarpThreads;
  if (row >= p.tokens * p.heads_kv) return;  // the warp's lanes together
  const int lane = int(lane_index());
  float4 v = reinterpret_cast<const float4*>(p.dk_rotated + row * kHeadDim)[lane];
  rotate_row(v, lane);
  const int64_t token = row / p.heads_kv;
  const int head = int(row % p.heads_kv);
  store_bf16x4(p.dk, token, head, 4 * lane, v);
}

}  // namespace

void launch_rotate_dk(const RotateDkParams& p, cudaStream_t stream) {
  const int64_t rows = p.tokens * p.heads_kv;
  if (rows == 0) return;
  rotate_dk_kernel<<<unsigned((rows + kRotateRowsPerBlock - 1) / kRotateRowsPerBlock),
                     kRotateThreads, 0, stream>>>(p);
  FLAMIA_CUDA_CHECK_LAUNCH();
}

void launch_preprocess(const PreprocessParams& p, cudaStream_t stream) {
  const int64_t rows = p.tokens * p.heads_q;
  if (rows == 0) return;
  preprocess_kernel<<<unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock), kPreThreads, 0,
                      stream>>>(p);
  FLAMIA_CUDA_CHECK_LAUNCH();
}

void launch_postprocess(const PostprocessParams& p, cudaStream_t stream) {
  const int64_t blocks = p.dq_slots * p.heads_q;
  if (p.tokens == 0 || blocks == 0) return;
  postprocess_kernel<<<unsigned(blocks), kPostThreads, 0, stream>>>(p);
  FLAMIA_CUDA_CHECK_LAUNCH();
}

}  // namespace flamia::sm90::bwd
