// The backward's outputs: dQ partials added to the FP32 accumulator in global memory (unordered
// atomics, or in key-block order for the deterministic mode), and dK, dV of a work item's keys
// stored once as BF16, only for keys inside the document.
#pragma once

#include <cuda_bf16.h>

#include "named_barrier.cuh"
#include "softmax_bwd.cuh"

namespace flamia::sm90::bwd {

// Where a step's dQ partial goes.
struct DqTarget {
  int64_t begin;  // the document's first token
  int length;
  int m0;  // the query tile's first row
  int head;
  int doc;
  int q_tile;
  int key_block;
};

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// dQ rows (queries acc_row(t, 0) and + 8) times 2^er, er from the step's query maxima, added to
// columns 64 w.. of the accumulator. Ordered mode: the two warpgroups of key block n add after
// those of blocks 0..n-1 (2n turns), then count their own turn.
template <typename Barrier>
__device__ __forceinline__ void add_dq_partial(const Params& p, const float (&dq)[kTileRegs],
                                               const int* row_max, const DqTarget& at, int t,
                                               int warpgroup, Barrier warpgroup_barrier) {
  const int quad = t % 4;
  int* turn = nullptr;
  if (p.dq_turns != nullptr) {
    turn = p.dq_turns + int64_t(at.head) * p.dq_turn_stride +
           dq_tile_slot(at.begin, at.doc, at.q_tile);
    if (t == 0)
      while (load_acquire(turn) < 2 * at.key_block) {
      }
    named_barrier_sync(warpgroup_barrier, kWarpgroupThreads);
  }
#pragma unroll
  for (int r = 0; r < kKeyRows; ++r) {
    const int row = wgmma::acc_row(t, 2 * r);
    if (at.m0 + row >= at.length) continue;
    const float unit = exp2i(scale_exponent_up(__int_as_float(row_max[row]), kE4m3Max));
    float* dst = p.dq_accum + ((at.begin + at.m0 + row) * p.heads_q + at.head) * kHeadDim +
                 warpgroup * (kHeadDim / 2) + 2 * quad;
#pragma unroll
    for (int g = 0; g < kColGroups; ++g) {
      const int i = 4 * g + 2 * r;
      atomicAdd(reinterpret_cast<float2*>(dst + 8 * g),
                make_float2(dq[i] * unit, dq[i + 1] * unit));
    }
  }
  if (turn != nullptr) {
    __threadfence();
    named_barrier_sync(warpgroup_barrier, kWarpgroupThreads);
    if (t == 0) atomicAdd(turn, 1);
  }
}

// dK = scale * acc, dV = acc for the warpgroup's keys key0.. (rows of the accumulators).
__device__ __forceinline__ void store_key_gradients(const Params& p,
                                                    const float (&dk)[2][kTileRegs],
                                                    const float (&dv)[2][kTileRegs], int64_t begin,
                                                    int length, int key0, int kv_head, int t) {
  const int quad = t % 4;
#pragma unroll
  for (int r = 0; r < kKeyRows; ++r) {
    const int key = key0 + wgmma::acc_row(t, 2 * r);
    if (key >= length) continue;
    const int64_t token = begin + key;
    uint16_t* dk_row = p.dk + token * p.dk_stride_token + kv_head * p.dk_stride_head + 2 * quad;
    uint16_t* dv_row = p.dv + token * p.dv_stride_token + kv_head * p.dv_stride_head + 2 * quad;
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int g = 0; g < kColGroups; ++g) {
        const int i = 4 * g + 2 * r, d = half * (kHeadDim / 2) + 8 * g;
        *reinterpret_cast<__nv_bfloat162*>(dk_row + d) =
            __floats2bfloat162_rn(dk[half][i] * p.scale, dk[half][i + 1] * p.scale);
        *reinterpret_cast<__nv_bfloat162*>(dv_row + d) =
            __floats2bfloat162_rn(dv[half][i], dv[half][i + 1]);
      }
  }
}

}  // namespace flamia::sm90::bwd
