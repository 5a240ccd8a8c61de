// The forward attention kernel (DESIGN §6), one persistent CTA per multiprocessor, 512 threads:
//   warpgroup 0, warp 0  producer: takes work items from the GPU-built list through an atomic
//                        counter, TMA-loads each item's Q, then its K and V^T tiles (last first;
//                        K's and V's tile codes for the fully visible tiles) into two-stage rings,
//                        and stages Q's row factors and each tile's key scale vectors
//                        (fwd_scales.cuh); the other three warps of the warpgroup zero the
//                        backward's dQ accumulator if asked to (dq_clear.cuh), then exit.
//   warpgroups 1-3       consumers: 64 query rows each (mainloop_fwd.cuh).
// Included by the two instantiation files (fwd_mxfp8.cu, fwd_qk16.cu) only.
#pragma once

#include "check.h"
#include "flamia/quantize.h"
#include "mainloop_fwd.cuh"
#include "setmaxnreg.cuh"
#include "tma.cuh"

namespace flamia::sm90::fwd {

enum class Warpgroup : uint32_t { kProducer = 0, kFirstConsumer = kFirstConsumerWarpgroup };
constexpr uint32_t kProducerWarpgroups = 1;
constexpr uint32_t kThreads =
    (kProducerWarpgroups + uint32_t(kConsumerWarpgroups)) * kWarpgroupThreads;
constexpr uint32_t kConsumerWarps = uint32_t(kConsumerWarpgroups) * kWarpgroupWarps;
static_assert(kConsumerWarpgroups * wgmma::kM == kBlockM, "each consumer owns 64 query rows");

// Registers: the producer keeps loop state and one tile's exponent codes; a consumer holds O, S (or
// O_tile, in its turn), the packed P~ and the row state, which the budget below must cover. Three
// consumer warpgroups leave 160 each: three warps per scheduler instead of two to hide the
// softmax's dependent chain.
constexpr uint32_t kProducerRegs = 32;
constexpr uint32_t kConsumerRegs =
    consumer_register_budget(kProducerWarpgroups, kProducerRegs, kConsumerWarpgroups);
constexpr uint32_t kConsumerRegHeadroom = 16;
static_assert(register_split_fits(kProducerWarpgroups, kProducerRegs, kConsumerWarpgroups,
                                  kConsumerRegs),
              "setmaxnreg budgets exceed the register file");
static_assert(2 * kAccRegs + kKSlices * kFragRegs + kConsumerRegHeadroom <= kConsumerRegs,
              "consumer register budget too small");

// Full barriers: all 32 producer lanes, each after its own row-factor or scale-vector stores (the
// elected lane's arrival carries the TMA bytes). Empty barriers: lane 0 of every consumer warp,
// after its warpgroup's wgmma wait and a __syncwarp (Pipeline::warp_release).
constexpr uint32_t kQFullArrivals = kWarpThreads;
constexpr uint32_t kTileFullArrivals = kWarpThreads;

template <ScoreOperand kScore, bool kCausal>
__device__ void producer(const Params& p, SharedStorage<kScore>& sm) {
  using L = SmemLayout<kScore>;
  constexpr bool kKeyScales = kScore == ScoreOperand::kE4m3;
  const int lane = int(lane_index());
  const bool elected = lane == 0;
  if (elected) {
    tma_prefetch_descriptor(&p.map_q);
    tma_prefetch_descriptor(&p.map_k);
    tma_prefetch_descriptor(&p.map_vt);
    tma_prefetch_descriptor(&p.map_vt_tiles);
    if (kKeyScales) tma_prefetch_descriptor(&p.map_k_tiles);
  }
  PipelineState<kQStages> q_state;
  PipelineState<kStages> k_state, v_state;
  for (;;) {
    int index = 0;
    if (elected) index = atomicAdd(p.counter, 1);
    index = __shfl_sync(kFullMask, index, 0);
    WorkItem item{-1, 0, 0, 0};
    if (index < p.num_items) item = p.items[index];

    // A leading partial tile starts before the document: its rows there belong to idle
    // warpgroups (for the first document TMA fills them with zeros).
    const int64_t doc_begin = item.doc < 0 ? 0 : p.cu_seqlens[item.doc];
    const int32_t doc_length = item.doc < 0 ? 0 : int32_t(p.cu_seqlens[item.doc + 1] - doc_begin);
    const int64_t q_token = doc_begin + item.first_row;
    uint32_t q_codes[kQRowsPerLane];
    if constexpr (kKeyScales)
      load_row_codes(q_codes, p.q_exponents + int64_t(item.head) * p.tokens_padded, q_token,
                     item.doc < 0 ? 0 : p.tokens_padded, lane);
    sm.q_pipe.producer_acquire(q_state);
    if (elected) {
      sm.item[q_state.index] = item;
      sm.item_doc[q_state.index] = ItemDocument{doc_begin, doc_length};
    }
    if (kKeyScales && item.doc >= 0)
      stage_query_factors(sm.q_factor[q_state.index], q_codes, p.scale_log2, lane);
    if (elected && item.doc >= 0) {
      sm.q_pipe.producer_commit(q_state, L::kQBytes);
#pragma unroll
      for (int span = 0; span < L::kSpans; ++span)
        tma_load_3d(sm.q[q_state.index] + span * L::kQSpanBytes, &p.map_q, span * L::kSpanElems,
                    item.head, int32_t(q_token), sm.q_pipe.full_barrier(q_state));
    } else {
      mbarrier_arrive(sm.q_pipe.full_barrier(q_state));
    }
    q_state.advance();
    if (item.doc < 0) return;

    const int kv_head = item.head / p.group;
    const int64_t vt_begin = transposed_doc_begin(doc_begin, item.doc);
    const uint8_t* k_exps = p.k_exponents + int64_t(kv_head) * p.tokens_padded;
    const uint8_t* v_exps = p.v_exponents + int64_t(kv_head) * p.tokens_padded;
    for (int kb = item.key_blocks - 1; kb >= 0; --kb) {
      const int64_t t0 = doc_begin + int64_t(kb) * kBlockN;
      LaneExponents ek{};
      if constexpr (kKeyScales) ek = load_lane_exponents(k_exps, t0, p.tokens_padded, lane);
      const LaneExponents ev = load_lane_exponents(v_exps, t0, p.tokens_padded, lane);

      const bool whole = visible_tile<kCausal>(kb, item.key_blocks - 1);
      sm.k_pipe.producer_acquire(k_state);
      if constexpr (kKeyScales) stage_key_scales(sm.kscale[k_state.index], ek, lane);
      if (elected) {
        sm.k_pipe.producer_commit(k_state, L::kKBytes);
        const CUtensorMap* k = kKeyScales && whole ? &p.map_k_tiles : &p.map_k;
#pragma unroll
        for (int span = 0; span < L::kSpans; ++span)
          tma_load_3d(sm.k[k_state.index] + span * L::kKSpanBytes, k, span * L::kSpanElems, kv_head,
                      int32_t(t0), sm.k_pipe.full_barrier(k_state));
      } else {
        mbarrier_arrive(sm.k_pipe.full_barrier(k_state));
      }
      k_state.advance();

      sm.v_pipe.producer_acquire(v_state);
      stage_value_scales(sm.vscale[v_state.index], ev, lane);
      if (elected) {
        sm.v_pipe.producer_commit(v_state, L::kVtBytes);
        const CUtensorMap* vt = whole ? &p.map_vt_tiles : &p.map_vt;
        tma_load_2d(sm.vt[v_state.index], vt, int32_t(vt_begin + int64_t(kb) * kBlockN),
                    kv_head * kHeadDim, sm.v_pipe.full_barrier(v_state));
      } else {
        mbarrier_arrive(sm.v_pipe.full_barrier(v_state));
      }
      v_state.advance();
    }
  }
}

// The spare warps of the producer warpgroup zero the dQ accumulator, grid-strided, and mark it.
__device__ __forceinline__ void clear_dq(const DqClear& c) {
  const int64_t warp = int64_t(blockIdx.x) * kClearWarps + (warp_index() - 1);
  zero_vectors(c.accum, c.vectors, warp * kWarpThreads + lane_index(),
               int64_t(gridDim.x) * kClearWarps * kWarpThreads, c.pause_ns);
  // The backward reads the mark only after this kernel has completed.
  if (blockIdx.x == 0 && warp_index() == 1 && lane_index() == 0) *c.zeroed = 1;
}

// Dynamic shared memory is only 16 B aligned: allocate slack and align up.
template <ScoreOperand kScore>
constexpr size_t kSmemBytes = sizeof(SharedStorage<kScore>) + wgmma::kSw128AtomBytes;
static_assert(kSmemBytes<ScoreOperand::kE4m3> <= kMaxDynamicSmemBytes &&
                  kSmemBytes<ScoreOperand::kBf16> <= kMaxDynamicSmemBytes,
              "shared memory of a CTA");

template <ScoreOperand kScore, bool kCausal>
__global__ void __launch_bounds__(kThreads, 1) forward_kernel(const __grid_constant__ Params p) {
  extern __shared__ uint8_t smem_raw[];
  SharedStorage<kScore>& sm = wgmma::sw128_aligned_storage<SharedStorage<kScore>>(smem_raw);
  if (threadIdx.x == 0) {
    sm.q_pipe.init(kQFullArrivals, kConsumerWarps);
    sm.k_pipe.init(kTileFullArrivals, kConsumerWarps);
    sm.v_pipe.init(kTileFullArrivals, kConsumerWarps);
  }
  __syncthreads();
  const uint32_t warpgroup = warpgroup_index();
  if (warpgroup == uint32_t(Warpgroup::kProducer)) {
    setmaxnreg_dec<kProducerRegs>();
    if (warp_index() == 0) {
      producer<kScore, kCausal>(p, sm);
    } else if (p.dq_clear.accum != nullptr) {
      clear_dq(p.dq_clear);
    }
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    consumer_mainloop<kScore, kCausal>(p, sm, int(warpgroup - uint32_t(Warpgroup::kFirstConsumer)));
  }
}

template <ScoreOperand kScore, bool kCausal>
void launch_forward_impl(const Params& p, int ctas, cudaStream_t stream) {
  constexpr size_t kBytes = kSmemBytes<kScore>;
  FLAMIA_CUDA_CHECK(cudaFuncSetAttribute(forward_kernel<kScore, kCausal>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, int(kBytes)));
  forward_kernel<kScore, kCausal><<<ctas, kThreads, kBytes, stream>>>(p);
  FLAMIA_CUDA_CHECK_LAUNCH();
}

}  // namespace flamia::sm90::fwd
