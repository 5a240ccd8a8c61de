// The backward main kernel (DESIGN §6), one persistent CTA per multiprocessor, 384 threads:
//   warpgroup 0          producer, on 24 registers. Warp 0 takes work items (document, key/value
//                        head, key block) through an atomic counter, TMA-loads the block's K, V and
//                        K^T once, then for each query head of the group and query tile from the
//                        diagonal on the tile's Q, dO and their K-major copies into a two-stage
//                        ring; warps 1 and 2 stage the tiles' per-row vectors (bwd_scales.cuh), a
//                        row a lane; warp 3 exits.
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
// warpgroup takes the minimum, which leaves the consumers 240: at 232 their step loop reloaded a
// spill, at 240 it has none (the backward on 1x65536 is 3 % faster, docs/PERF.md item 172). A
// producer of one warp would leave them no more: it shares a sub-partition's registers with two
// consumer warps (24 + 2 x 248 > 512, setmaxnreg.cuh; item 205). On 24,
// one warp staging all 64 rows spilled about 50 local accesses a step (item 128); with a row a
// lane over two warps, each reloads a few loop variables (4-9 local accesses a step, off
// the consumers' path).
constexpr uint32_t kProducerRegs = 24;
constexpr uint32_t kConsumerRegs =
    consumer_register_budget(kProducerWarpgroups, kProducerRegs, kConsumerWarpgroups);
constexpr uint32_t kConsumerRegHeadroom = 16;
static_assert(register_split_fits(kProducerWarpgroups, kProducerRegs, kConsumerWarpgroups,
                                  kConsumerRegs),
              "setmaxnreg budgets exceed the register file");
static_assert(4 * kTileRegs + kTileRegs + kTileRegs + 2 * kQuerySlices * 4 + kConsumerRegHeadroom <=
                  kConsumerRegs,
              "consumer register budget too small");

// The producer warpgroup's working warps: one takes the work items and issues every copy, two
// stage the query tiles' per-row vectors.
enum class ProducerWarp : uint32_t { kCopies = 0, kFirstRows = 1 };
static_assert(kRowWarps == 2, "backward_kernel starts two row warps");

// Full barriers: the key block by the copy warp's elected lane (one arrival plus the bytes); a
// query step by that lane (an arrival plus the bytes, before its copies) and the row warps' lanes,
// each after its row store. Empty barriers: lane 0 of every consumer warp after a
// __syncwarp (Pipeline::warp_release). The item barrier (item_ready): the copy warp's elected
// lane once sm.item holds the next work item.
constexpr uint32_t kKeyBlockArrivals = 1;
constexpr uint32_t kStepArrivals = 1 + kRowWarps * kWarpThreads;
constexpr uint32_t kItemArrivals = 1;

// The copy warp: work items through an atomic counter, the key block's K, V and K^T once, then for
// each query head of the group and query tile from the diagonal on the tile's Q, dO and their
// K-major copies into the query ring. kKeysT: K^T only for a dQ product (the split backward's
// dK/dV pass runs none; 16 KB of L2 reads an item, 2.5 % of the backward on tiny-unaligned).
template <ScoreOperand kScore, bool kCausal, bool kKeysT>
__device__ void produce_copies(const Params& p, SharedStorage<kScore>& sm) {
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
      sm.k_tile_unit = ue8m0::decode(uint8_t(k_tile_code)) * p.scale_log2;
      mbarrier_arrive(&sm.item_ready);
      if (item.doc < 0) {
        mbarrier_arrive(sm.kv_pipe.full_barrier(kv_state));
      } else {
        uint64_t* full = sm.kv_pipe.full_barrier(kv_state);
        sm.kv_pipe.producer_commit(kv_state, L::kKeyBlockBytes - (kKeysT ? 0u : L::kCodesKBytes));
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
        if constexpr (kKeysT)
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
        sm.q_pipe.producer_acquire(q_state);
        if (elected) {
          uint64_t* full = sm.q_pipe.full_barrier(q_state);
          sm.q_pipe.producer_commit(q_state, L::kQStageBytes);
          const int32_t token = int32_t(begin + m * kBlockM);
          const int32_t position = int32_t(t_begin + m * kBlockM);
#pragma unroll
          for (int span = 0; span < L::kSpans; ++span)
            tma_load_3d(sm.q[q_state.index] + span * L::kQSpanBytes, &p.map_q, span * L::kSpanElems,
                        head, token, full);
          tma_load_3d(sm.dout[q_state.index], &p.map_dout, 0, head, token, full);
          tma_load_2d(sm.qt[q_state.index], &p.map_qt, position, head * kHeadDim, full);
          tma_load_2d(sm.doutt[q_state.index], &p.map_doutt, position, head * kHeadDim, full);
        }
        q_state.advance();
      }
    }
  }
}

// A row warp: follows the copy warp's work items (each read as soon as it is written, before its
// key block lands; the next one is written only once the consumers have released this one, which
// needs this warp's rows) and stages its half of each step's per-row vectors (bwd_scales.cuh) into
// the query ring.
template <ScoreOperand kScore, bool kCausal, int kRowWarp>
__device__ void produce_rows(const Params& p, SharedStorage<kScore>& sm) {
  const int lane = int(lane_index());
  uint32_t item_phase = 0;
  PipelineState<kQStages> q_state;
  for (;;) {
    mbarrier_wait(&sm.item_ready, item_phase);
    item_phase ^= 1;
    const WorkItem item = sm.item;
    if (item.doc < 0) return;
    const int64_t begin = p.cu_seqlens[item.doc];
    const int length = int(p.cu_seqlens[item.doc + 1] - begin);
    const int tiles = (length + kBlockM - 1) / kBlockM;
    for (int hh = 0; hh < p.group; ++hh) {
      const int head = item.kv_head * p.group + hh;
      for (int m = first_query_tile(item.key_block, kCausal); m < tiles; ++m) {
        const StepGeometry g{begin, length, m * kBlockM, item.key_block * kBlockN, head};
        const RowLoads in = load_query_rows<kRowWarp>(p, g, lane);
        sm.q_pipe.producer_acquire(q_state);
        stage_query_rows<kScore, kCausal, kRowWarp>(sm.rows[q_state.index], p, g, in, lane);
        mbarrier_arrive(sm.q_pipe.full_barrier(q_state));
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
    mbarrier_init(&sm.item_ready, kItemArrivals);
    mbarrier_init_fence();
  }
  for (int i = threadIdx.x; i < kMaxBuffers * kBlockM; i += blockDim.x)
    sm.row_max[i / kBlockM][i % kBlockM] = kRowMaxFloor;
  __syncthreads();
  const uint32_t warpgroup = warpgroup_index();
  if (warpgroup == uint32_t(Warpgroup::kProducer)) {
    setmaxnreg_dec<kProducerRegs>();
    if (warp_index() == uint32_t(ProducerWarp::kCopies))
      produce_copies<kScore, kCausal, kDq != DqAddition::kNone>(p, sm);
    const uint32_t warp = warp_index();
    if (warp == uint32_t(ProducerWarp::kFirstRows)) produce_rows<kScore, kCausal, 0>(p, sm);
    if (warp == uint32_t(ProducerWarp::kFirstRows) + 1) produce_rows<kScore, kCausal, 1>(p, sm);
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
