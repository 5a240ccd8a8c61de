// The backward's outputs: dQ partials added to the FP32 accumulator in global memory by bulk
// reductions (unordered, or in key-block order for the statistics build's deterministic mode), and
// dK, dV of a work item's keys stored once as BF16, only for keys inside the document.
#pragma once

#include "bf16_rows.cuh"
#include "named_barrier.cuh"
#include "proxy_fence.cuh"
#include "softmax_bwd.cuh"
#include "tma.cuh"

namespace flamia::sm90::bwd {

// What a step needs of its work item.
struct StepItem {
  int64_t begin;  // the document's first token
  int length;
  int n0;  // the key block's first key
  int head;
  int key_block;
  // The dQ accumulator slot of (head, the document's first query tile); a query tile's is this
  // plus the tile. The step loop holds this one 32-bit index instead of a 64-bit base derived
  // from the document's begin (a spill fewer, docs/PERF.md item 164); the host refuses more
  // than INT32_MAX slots.
  int dq_slot0;
};

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Adds four consecutive floats to global memory in L2 (REDG.F32x4; it flushes subnormals, as the
// bulk reductions do).
__device__ __forceinline__ void reduce_add_float4(float* dst, float4 v) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(v.x), "f"(v.y),
               "f"(v.z), "f"(v.w)
               : "memory");
}

// Accumulator registers i..i+3 (rows r and r + 8) times their rows' units: one float4 of a slot.
__device__ __forceinline__ float4 scaled_group(const float (&dq)[kTileRegs], int i,
                                               const float (&unit)[kKeyRows]) {
  return make_float4(dq[i] * unit[0], dq[i + 1] * unit[0], dq[i + 2] * unit[1],
                     dq[i + 3] * unit[1]);
}

// A query row's dQ unit: 2^er (its dQ operand's scale field), then 2^-e_q and the step unit
// 2^(C - 8) that dS'' carries, in that order (2^(er - e_q) stays in float's range). Shared with the
// split backward's dQ pass (dq_kernel.cuh).
__device__ __forceinline__ float dq_row_unit(uint32_t field, float q_inverse, float step_unit) {
  return exp2i(scale_exponent_up_e4m3_of_field(field)) * q_inverse * step_unit;
}

// A warp's staged dQ partial whose bulk reduction is not issued yet (unordered mode).
struct PendingDq {
  float* dst = nullptr;  // null: none
  const float* src = nullptr;
};

// Issues the pending reduction, by the warp's first lane after a proxy fence (the stage's stores
// reach the bulk copy's async-proxy reads), which then waits until the reduction before it has
// read its stage (the step after this one rewrites that stage). Called at the next step's start,
// before its products: by then the stores have completed, so the fence no longer waits for them
// (right after the stores it was 4 % of the kernel's stall samples, docs/PERF.md).
__device__ __forceinline__ void flush_dq_partial(PendingDq& pending) {
  if (pending.dst == nullptr) return;
  fence_async_shared();
  __syncwarp();
  if (lane_index() == 0) {
    bulk_reduce_add(pending.dst, pending.src, kDqWarpFloats * sizeof(float));
    tma_store_commit();
    tma_store_wait_read<kDqStages - 1>();
  }
  pending.dst = nullptr;
}

// The warpgroup's dQ partial (queries x its 64 head-dim columns) times 2^er per row, er from the
// step's query maxima (of dS'' = dS 2^e_q 2^(8 - C), so times q_inverse = 2^-e_q and step_unit =
// 2^(C - 8) as well, in that order: 2^(er - e_q) stays in float's range), added to the
// accumulator's slot in fragment order. Unordered: staged in shared memory and added by bulk
// reductions, each warp its contiguous part (flush_dq_partial, at the next step's start). Ordered
// (the statistics build's deterministic mode, whose dQ the split backward's dQ pass reproduces bit
// for bit): after the additions of key blocks 0..n-1 (2n turns, one per warpgroup), every thread
// adds its float4 groups from the registers (a warp's group is 512 contiguous bytes), then the turn
// is counted. Measured (docs/PERF.md, sessions 5 and 6): here the register path is 3 to 23 %
// faster, because a bulk reduction had to complete before the turn; unordered it is 8 % slower.
// The fast kernels carry the bulk path alone (DqAddition): with both, unordered lost 1.3 %.
template <DqAddition kDq, typename Barrier>
__device__ __forceinline__ void add_dq_partial(const Params& p, const float (&dq)[kTileRegs],
                                               const int* row_max,
                                               const float (&q_inverse)[kKeyRows], float step_unit,
                                               float* stage, const StepItem& item, int q_tile,
                                               int t, int warpgroup, Barrier warpgroup_barrier,
                                               PendingDq& pending) {
  float unit[kKeyRows];
#pragma unroll
  for (int r = 0; r < kKeyRows; ++r)
    unit[r] = dq_row_unit(uint32_t(row_max[wgmma::acc_row(t, 2 * r)]), q_inverse[r], step_unit);
  const int64_t slot_index = int64_t(item.dq_slot0) + q_tile;
  float* half = p.dq_accum + slot_index * kDqSlotFloats + warpgroup * kDqHalfFloats;
  const bool ordered = kDq == DqAddition::kByParams && p.dq_turns != nullptr;
  if (!ordered) {
#pragma unroll
    for (int i = 0; i < kTileRegs; i += 4)
      *reinterpret_cast<float4*>(stage + dq_fragment_offset(t, i)) = scaled_group(dq, i, unit);
    const int part = (t / kDqLanes) * kDqWarpFloats;
    pending = {half + part, stage + part};
    return;
  }
  int* turn = p.dq_turns + slot_index;
  if (t == 0) {
    while (load_acquire(turn) < kOrderedTurnsPerKeyBlock * item.key_block) {
    }
  }
  named_barrier_sync(warpgroup_barrier, kWarpgroupThreads);
#pragma unroll
  for (int i = 0; i < kTileRegs; i += 4)
    reduce_add_float4(half + dq_fragment_offset(t, i), scaled_group(dq, i, unit));
  __threadfence();  // this thread's additions before the turn is counted
  named_barrier_sync(warpgroup_barrier, kWarpgroupThreads);
  if (t == 0) atomicAdd(turn, 1);
}

// With Hadamard-rotated Q and K: dK = scale * acc as FP32 rows of Params::dk_rotated, rotated back
// to the inputs' frame and rounded to BF16 by a pass after the kernel (launch_rotate_dk). Rotating
// here, across the quad's lanes after the step loop, cost the loop its uniform-register
// descriptors (+134 instructions, docs/PERF.md item 133).
__device__ __forceinline__ void store_key_gradient_rotated(const Params& p,
                                                           const float (&dk)[2][kTileRegs],
                                                           int64_t begin, int length, int key0,
                                                           int kv_head, int t) {
  const int quad = t % 4;
#pragma unroll
  for (int r = 0; r < kKeyRows; ++r) {
    const int key = key0 + wgmma::acc_row(t, 2 * r);
    if (key >= length) continue;
    const int heads_kv = p.heads_q / p.group;
    float* row = p.dk_rotated + ((begin + key) * heads_kv + kv_head) * kHeadDim + 2 * quad;
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int g = 0; g < kColGroups; ++g) {
        const int i = 4 * g + 2 * r;
        *reinterpret_cast<float2*>(row + half * (kHeadDim / 2) + 8 * g) =
            make_float2(dk[half][i] * p.scale, dk[half][i + 1] * p.scale);
      }
  }
}

// dK = scale * acc (unless kDk is false: store_key_gradient_rotated's), dV = acc for the
// warpgroup's keys key0.. (rows of the accumulators). Where the views allow (Params::wide_stores),
// 16 bytes a lane after quad transposes (bf16_rows.cuh), else BF16 pairs. The pairs took 8.5 k
// cycles an item (docs/PERF.md, item 80); the 16-byte stores took 3-4 % off the backward on 16x4096
// (item 91).
template <bool kDk>
__device__ __forceinline__ void store_key_gradients(const Params& p,
                                                    const float (&dk)[2][kTileRegs],
                                                    const float (&dv)[2][kTileRegs], int64_t begin,
                                                    int length, int key0, int kv_head, int t) {
  const int quad = t % 4;
#pragma unroll
  for (int r = 0; r < kKeyRows; ++r) {
    const int key = key0 + wgmma::acc_row(t, 2 * r);
    if (key >= length) continue;  // the quad's key: its lanes skip it together
    const int64_t token = begin + key;
    // The thread's first column, 2 quad (a pair's; a transposed group's is 8 quad).
    uint16_t* dk_row = p.dk + token * p.dk_stride_token + kv_head * p.dk_stride_head + 2 * quad;
    uint16_t* dv_row = p.dv + token * p.dv_stride_token + kv_head * p.dv_stride_head + 2 * quad;
    if (p.wide_stores) {
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int k = 0; k < kColGroups / kQuadLanes; ++k) {
          uint32_t k_words[kQuadLanes], v_words[kQuadLanes];
#pragma unroll
          for (int j = 0; j < kQuadLanes; ++j) {
            const int i = 4 * (kQuadLanes * k + j) + 2 * r;
            k_words[j] = bf16x2_bits(dk[half][i] * p.scale, dk[half][i + 1] * p.scale);
            v_words[j] = bf16x2_bits(dv[half][i], dv[half][i + 1]);
          }
          // Lane q stores group q of the span, its 8 columns: 8 q on (the row pointer is 2 q on).
          const int d = half * (kHeadDim / 2) + kQuadSpanElems * k + (kWideStoreElems - 2) * quad;
          if constexpr (kDk) *reinterpret_cast<uint4*>(dk_row + d) = quad_transpose(k_words);
          *reinterpret_cast<uint4*>(dv_row + d) = quad_transpose(v_words);
        }
    } else {
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int g = 0; g < kColGroups; ++g) {
          const int i = 4 * g + 2 * r, d = half * (kHeadDim / 2) + 8 * g;
          if constexpr (kDk)
            *reinterpret_cast<__nv_bfloat162*>(dk_row + d) =
                __floats2bfloat162_rn(dk[half][i] * p.scale, dk[half][i + 1] * p.scale);
          *reinterpret_cast<__nv_bfloat162*>(dv_row + d) =
              __floats2bfloat162_rn(dv[half][i], dv[half][i + 1]);
        }
    }
  }
}

}  // namespace flamia::sm90::bwd
