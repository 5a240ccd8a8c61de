// The backward's preprocess (D and the cleared dQ accumulator) and postprocess (dQ to BF16).
#include <cuda_bf16.h>

#include <algorithm>

#include "arch.cuh"
#include "bwd_params.h"
#include "check.h"
#include "flamia/formats.h"

namespace flamia::sm90::bwd {
namespace {

constexpr int kRowsPerBlock = 8;  // one warp per (token, query head) row
constexpr int kLaneElems = kHeadDim / int(kWarpThreads);
static_assert(kLaneElems == 4, "a lane reads 4 codes and 4 BF16 values");

// D_i = sum_d (dO code_id * 2^e_dO(i)) * O_id, the values dP uses times the forward's O; the
// warp reduces in a fixed tree, so D is the same on every run.
__global__ void __launch_bounds__(kRowsPerBlock* kWarpThreads)
    preprocess_kernel(const __grid_constant__ PreprocessParams p) {
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarpThreads;
  if (row >= p.tokens * p.heads_q) return;
  const int lane = int(threadIdx.x % kWarpThreads);
  const int64_t token = row / p.heads_q;
  const int head = int(row % p.heads_q);
  const float unit =
      exp2i(int(p.dout_exponents[int64_t(head) * p.tokens_padded + token]) - ue8m0::kBias);
  const uint32_t codes =
      *reinterpret_cast<const uint32_t*>(p.dout_codes + row * kHeadDim + kLaneElems * lane);
  const uint16_t* o = p.o + token * p.o_stride_token + head * p.o_stride_head + kLaneElems * lane;
  const uint2 o_bits = *reinterpret_cast<const uint2*>(o);
  const uint16_t ob[kLaneElems] = {uint16_t(o_bits.x), uint16_t(o_bits.x >> 16), uint16_t(o_bits.y),
                                   uint16_t(o_bits.y >> 16)};
  float sum = 0.0f;
#pragma unroll
  for (int e = 0; e < kLaneElems; ++e)
    sum += (e4m3::decode(uint8_t(codes >> (8 * e))) * unit) * bf16::decode(ob[e]);
#pragma unroll
  for (int d = int(kWarpThreads) / 2; d > 0; d /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, d);
  if (lane == 0) p.delta[int64_t(head) * p.tokens + token] = sum;
}

constexpr int kPostThreads = 256;
constexpr int kPairsPerRow = kHeadDim / 2;

__global__ void __launch_bounds__(kPostThreads)
    postprocess_kernel(const __grid_constant__ PostprocessParams p) {
  const int64_t pair = int64_t(blockIdx.x) * kPostThreads + threadIdx.x;
  if (pair >= p.tokens * p.heads_q * kPairsPerRow) return;
  const int64_t row = pair / kPairsPerRow;
  const int d = 2 * int(pair % kPairsPerRow);
  const int64_t token = row / p.heads_q;
  const int head = int(row % p.heads_q);
  // The token's document: the last one starting at or before it (zero-length ones skipped).
  int lo = 0, hi = p.num_docs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.cu_seqlens[mid] <= token)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int64_t begin = p.cu_seqlens[lo];
  const int r = int(token - begin);
  const float* slot =
      p.dq_accum +
      (int64_t(head) * p.dq_slots + dq_tile_slot(begin, lo, r / kBlockM)) * kDqSlotFloats;
  // Columns d and d + 1 sit in consecutive registers of one thread.
  const float2 acc =
      make_float2(slot[dq_slot_offset(r % kBlockM, d)], slot[dq_slot_offset(r % kBlockM, d + 1)]);
  *reinterpret_cast<__nv_bfloat162*>(p.dq + token * p.dq_stride_token + head * p.dq_stride_head +
                                     d) = __floats2bfloat162_rn(acc.x * p.scale, acc.y * p.scale);
}

}  // namespace

void launch_preprocess(const PreprocessParams& p, cudaStream_t stream) {
  const int64_t rows = p.tokens * p.heads_q;
  if (rows == 0) return;
  preprocess_kernel<<<unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock),
                      kRowsPerBlock * kWarpThreads, 0, stream>>>(p);
  FLAMIA_CUDA_CHECK_LAUNCH();
}

void launch_postprocess(const PostprocessParams& p, cudaStream_t stream) {
  const int64_t pairs = p.tokens * p.heads_q * kPairsPerRow;
  if (pairs == 0) return;
  postprocess_kernel<<<unsigned((pairs + kPostThreads - 1) / kPostThreads), kPostThreads, 0,
                       stream>>>(p);
  FLAMIA_CUDA_CHECK_LAUNCH();
}

}  // namespace flamia::sm90::bwd
