// The backward main kernel (DESIGN §6), one persistent CTA per multiprocessor, 384 threads:
//   warpgroup 0, warp 0  producer: takes work items (document, key/value head, key block) through
//                        an atomic counter, TMA-loads the block's K, V and K^T once, then for each
//                        query head of the group and query tile from the diagonal on the tile's Q,
//                        dO and their K-major copies into a two-stage ring, staging the tile's
//                        per-row vectors (bwd_scales.cuh); the warpgroup's other warps exit.
//   warpgroups 1, 2      consumers: 64 keys each (mainloop_bwd.cuh).
// Included by the two instantiation files (bwd_mxfp8.cu, bwd_qk16.cu) only.
#pragma once

#include "check.h"
#include "flamia/quantize.h"
#include "mainloop_bwd.cuh"
#include "setmaxnreg.cuh"
#include "tma.cuh"

namespace flamia::sm90::bwd {

enum class Warpgroup : uint32_t { kProducer = 0, kFirstConsumer = 1 };
constexpr uint32_t kProducerWarpgroups = 1;
constexpr uint32_t kConsumerWarpgroups = 2;
constexpr uint32_t kThreads = (kProducerWarpgroups + kConsumerWarpgroups) * kWarpgroupThreads;
constexpr uint32_t kConsumerWarps = kConsumerWarpgroups * kWarpgroupWarps;
static_assert(kConsumerWarpgroups * wgmma::kM == kBlockN, "each consumer owns 64 keys");

// Registers: a consumer holds dK and dV (two halves each), dS of the step, one fresh product tile
// and the packed operands (S^T and dP^T are live together only before the packing). The producer
// stages the per-row vectors from registers too: at 24 it spilled about 50 local accesses per step
// (ptxas -v); at 40 (consumers 232) the mxfp8 kernels spill 44-56 B, none in the producer's step
// loop and one reload in the consumers' (at 48 the consumers' loop spills more).
constexpr uint32_t kProducerRegs = 40;
constexpr uint32_t kConsumerRegs =
    consumer_register_budget(kProducerWarpgroups, kProducerRegs, kConsumerWarpgroups);
constexpr uint32_t kConsumerRegHeadroom = 16;
static_assert(register_split_fits(kProducerWarpgroups, kProducerRegs, kConsumerWarpgroups,
                                  kConsumerRegs),
              "setmaxnreg budgets exceed the register file");
static_assert(4 * kTileRegs + kTileRegs + kTileRegs + 2 * kQuerySlices * 4 + kConsumerRegHeadroom <=
                  kConsumerRegs,
              "consumer register budget too small");

// Full barriers: the key block by the elected lane (one arrival plus the bytes); a query step by
// all 32 producer lanes, each after its row stores. Empty barriers: lane 0 of every consumer warp
// after a __syncwarp (Pipeline::warp_release).
constexpr uint32_t kKeyBlockArrivals = 1;
constexpr uint32_t kStepArrivals = kWarpThreads;

template <ScoreOperand kScore, bool kCausal>
__device__ void producer(const Params& p, SharedStorage<kScore>& sm) {
  using L = SmemLayout<kScore>;
  const int lane = int(lane_index());
  const bool elected = lane == 0;
  if (elected) {
    for (const CUtensorMap* map :
         {&p.map_q, &p.map_k, &p.map_v, &p.map_dout, &p.map_qt, &p.map_doutt, &p.map_kt})
      tma_prefetch_descriptor(map);
    if (L::kKeyTiles) tma_prefetch_descriptor(&p.map_k_tiles);
  }
  PipelineState<1> kv_state;
  PipelineState<kQStages> q_state;
  for (;;) {
    int index = 0;
    if (elected) index = atomicAdd(p.counter, 1);
    index = __shfl_sync(0xFFFFFFFFu, index, 0);
    WorkItem item{-1, 0, 0, 0};
    if (index < p.num_items) item = p.items[index];

    const int64_t begin = item.doc < 0 ? 0 : p.cu_seqlens[item.doc];
    const int n0 = item.key_block * kBlockN;
    // The score unit on K's tile codes: 2^ the largest exponent of the block's keys. A partial
    // block's maximum may take in the next document's keys: the forward never sees it whole.
    uint32_t k_tile_code = 0;
    if (L::kKeyTiles && item.doc >= 0) {
      const uint8_t* row = p.k_exponents + int64_t(item.kv_head) * p.tokens_padded + begin + n0;
      const int64_t left = p.tokens_padded - (begin + n0);
      for (int j = lane; j < kBlockN; j += int(kWarpThreads))
        k_tile_code = max(k_tile_code, j < left ? uint32_t(row[j]) : 0u);
      k_tile_code = __reduce_max_sync(0xFFFFFFFFu, k_tile_code);
    }
    sm.kv_pipe.producer_acquire(kv_state);
    if (elected) {
      sm.item = item;
      sm.k_tile_unit = ue8m0::decode(uint8_t(k_tile_code));
      if (item.doc < 0) {
        mbarrier_arrive(sm.kv_pipe.full_barrier(kv_state));
      } else {
        uint64_t* full = sm.kv_pipe.full_barrier(kv_state);
        sm.kv_pipe.producer_commit(kv_state, L::kKeyBlockBytes);
        const int32_t token = int32_t(begin + n0);
#pragma unroll
        for (int span = 0; span < L::kSpans; ++span)
          tma_load_3d(sm.k + span * L::kKSpanBytes, &p.map_k, span * L::kSpanElems, item.kv_head,
                      token, full);
        if constexpr (L::kKeyTiles) {
#pragma unroll
          for (int span = 0; span < L::kSpans; ++span)
            tma_load_3d(sm.k_tiles + span * L::kKSpanBytes, &p.map_k_tiles, span * L::kSpanElems,
                        item.kv_head, token, full);
        }
        tma_load_3d(sm.v, &p.map_v, 0, item.kv_head, token, full);
        tma_load_2d(sm.kt, &p.map_kt, int32_t(transposed_doc_begin(begin, item.doc) + n0),
                    item.kv_head * kHeadDim, full);
      }
    }
    kv_state.advance();
    if (item.doc < 0) return;

    const int length = int(p.cu_seqlens[item.doc + 1] - begin);
    const int tiles = (length + kBlockM - 1) / kBlockM;
    const int64_t t_begin = transposed_doc_begin(begin, item.doc);
    for (int hh = 0; hh < p.group; ++hh) {
      const int head = item.kv_head * p.group + hh;
      for (int m = first_query_tile(item.key_block, kCausal); m < tiles; ++m) {
        const StepGeometry g{begin, length, m * kBlockM, n0, head};
        const RowLoads in = load_query_rows(p, g, lane);
        sm.q_pipe.producer_acquire(q_state);
        // The tiles' copies first, in flight while the lanes stage the rows; every lane, the
        // elected one too, arrives after its row stores (docs/PERF.md, item 167).
        uint64_t* full = sm.q_pipe.full_barrier(q_state);
        if (elected) {
          mbarrier_expect_tx(full, L::kQStageBytes);
          const int32_t token = int32_t(begin + g.m0);
          const int32_t position = int32_t(t_begin + g.m0);
#pragma unroll
          for (int span = 0; span < L::kSpans; ++span)
            tma_load_3d(sm.q[q_state.index] + span * L::kQSpanBytes, &p.map_q, span * L::kSpanElems,
                        head, token, full);
          tma_load_3d(sm.dout[q_state.index], &p.map_dout, 0, head, token, full);
          tma_load_2d(sm.qt[q_state.index], &p.map_qt, position, head * kHeadDim, full);
          tma_load_2d(sm.doutt[q_state.index], &p.map_doutt, position, head * kHeadDim, full);
        }
        stage_query_rows<kScore, kCausal>(sm.rows[q_state.index], p, g, in, lane);
        mbarrier_arrive(full);
        q_state.advance();
      }
    }
  }
}

// Dynamic shared memory is only 16 B aligned: allocate slack and align up.
template <ScoreOperand kScore>
constexpr size_t kSmemBytes = sizeof(SharedStorage<kScore>) + wgmma::kSw128AtomBytes;
static_assert(kSmemBytes<ScoreOperand::kE4m3> <= kMaxDynamicSmemBytes &&
                  kSmemBytes<ScoreOperand::kBf16> <= kMaxDynamicSmemBytes,
              "shared memory of a CTA");

// kDiagnostics: the statistics build (Params::diagnostics set); the fast path carries none of it.
// kRotated: Hadamard-rotated Q and K (consumer_mainloop).
template <ScoreOperand kScore, bool kCausal, bool kDiagnostics, DqAddition kDq, bool kRotated>
__global__ void __launch_bounds__(kThreads, 1) backward_kernel(const __grid_constant__ Params p) {
  extern __shared__ uint8_t smem_raw[];
  SharedStorage<kScore>& sm = wgmma::sw128_aligned_storage<SharedStorage<kScore>>(smem_raw);
  if (threadIdx.x == 0) {
    sm.kv_pipe.init(kKeyBlockArrivals, kConsumerWarps);
    sm.q_pipe.init(kStepArrivals, kConsumerWarps);
  }
  for (int i = threadIdx.x; i < kMaxBuffers * kBlockM; i += blockDim.x)
    sm.row_max[i / kBlockM][i % kBlockM] = kRowMaxFloor;
  __syncthreads();
  const uint32_t warpgroup = warpgroup_index();
  if (warpgroup == uint32_t(Warpgroup::kProducer)) {
    setmaxnreg_dec<kProducerRegs>();
    if (warp_index() == 0) producer<kScore, kCausal>(p, sm);
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    consumer_mainloop<kScore, kCausal, kDiagnostics, kDq, kRotated>(
        p, sm, int(warpgroup - uint32_t(Warpgroup::kFirstConsumer)));
  }
}

template <ScoreOperand kScore, bool kCausal, bool kDiagnostics, DqAddition kDq,
          bool kRotated = false>
void launch_backward_impl(const Params& p, int ctas, cudaStream_t stream) {
  constexpr size_t kBytes = kSmemBytes<kScore>;
  const auto kernel = backward_kernel<kScore, kCausal, kDiagnostics, kDq, kRotated>;
  FLAMIA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kBytes)));
  kernel<<<ctas, kThreads, kBytes, stream>>>(p);
  FLAMIA_CUDA_CHECK_LAUNCH();
}

}  // namespace flamia::sm90::bwd
