// The consumer warpgroups' mainloop: for each work item, its key tiles from the last (masked) one
// down to the first, S = Q K^T (QGMMA on E4M3 codes, or HGMMA on BF16 inputs), the online softmax
// (softmax.cuh), P~ converted to E4M3 in registers as the A operand of O_tile = P~ V (register-A
// QGMMA against V^T), and the two-level accumulation O = O * rescale + O_tile: each tile's product
// lands in fresh registers because the FP8 MMA keeps only about 14 significant bits when it chains.
//
// P~ needs no register shuffle (pack_a_fragments, fp8_convert.cuh): the quantizer stores every 16
// keys of V^T in the order the accumulator fragment hands them out.
#pragma once

#include <type_traits>

#include "epilogue_fwd.cuh"
#include "fp8_convert.cuh"
#include "fwd_smem.cuh"
#include "mbarrier.cuh"
#include "named_barrier.cuh"

namespace flamia::sm90::fwd {

constexpr int kKSlices = kBlockN / wgmma::kKE4m3;  // k32 slices of the PV product
constexpr int kFragRegs = 4;                       // b32 registers of one A fragment

// The consumer warpgroups take turns on the tensor cores, round robin: each turn is one
// warpgroup's MMAs between two softmaxes — the PV product of its last tile and the score product
// of its next — so the others' softmaxes run while its MMAs do. A turn begins with a sync on the
// warpgroup's own barrier and ends with an arrive on the next one's; warpgroup 0 starts.
enum class ConsumerBarrier : uint32_t {
  kTurn0 = kFirstNamedBarrier,  // warpgroup w may issue MMAs: kTurn0 + w
  kTurnLast = kTurn0 + kConsumerWarpgroups - 1,
};
static_assert(named_barrier_id_valid(ConsumerBarrier::kTurnLast), "named barrier ids");
constexpr uint32_t kTurnThreads = 2 * kWarpgroupThreads;  // the waiter and the signaller

// Consumer warpgroups are warpgroups 1.. of the CTA (fwd_kernel.cuh). The turn barriers' ids are
// recomputed from %tid.x at each turn rather than held through the softmax, whose 160 registers
// are all taken: 1.5-3 % faster mxfp8 forward, mxfp8-qk16 unchanged (docs/PERF.md, seventh
// session).
constexpr uint32_t kFirstConsumerWarpgroup = 1;
__device__ __forceinline__ uint32_t turn_consumer() {
  return warpgroup_index_reread() - kFirstConsumerWarpgroup;
}
__device__ __forceinline__ ConsumerBarrier turn_of(uint32_t warpgroup) {
  return ConsumerBarrier(uint32_t(ConsumerBarrier::kTurn0) + warpgroup);
}
__device__ __forceinline__ void begin_turn() {
  named_barrier_sync(turn_of(turn_consumer()), kTurnThreads);
}
__device__ __forceinline__ void end_turn() {
  named_barrier_arrive(turn_of((turn_consumer() + 1) % kConsumerWarpgroups), kTurnThreads);
}

// Causal items start with the key tiles their 192 rows' diagonal crosses (two of 128 keys); the
// non-causal ones with the tile holding the document's end. Those run the masked softmax.
template <bool kCausal>
constexpr int kMaskedTiles = masked_tiles(kCausal);

// The other tiles are visible to every row of the item (item_sees_tile_whole): they take K's and
// V's tile codes (one exponent per tile each), so their softmax applies no per-key scale.
template <bool kCausal>
__device__ __forceinline__ bool visible_tile(int kb, int last) {
  return kb <= last - kMaskedTiles<kCausal>;
}

template <ScoreOperand kScore>
__device__ __forceinline__ void issue_score_product(float (&s)[kAccRegs],
                                                    const SharedStorage<kScore>& sm, int q_stage,
                                                    int k_stage, int warpgroup) {
  using L = SmemLayout<kScore>;
  wgmma::fence_operands(s);
  wgmma::fence();
  issue_score_steps<kScore, kBlockN>(s, sm.q[q_stage] + warpgroup * L::kWarpgroupQBytes,
                                     L::kQSpanBytes, sm.k[k_stage], L::kKSpanBytes);
  wgmma::commit();
}

// The PV product in PvSlices::kParts slices of the head dim, each waited for before its O update.
// One slice (all of O_tile, one wait per turn) measured 1.3-1.5 % faster than two on 1x65536. The
// mxfp8-qk16 kernels fit it in a consumer's 160 registers; ptxas -O1 spills 4 local accesses per
// tile in the mxfp8 causal kernel with it, and issue 6 asks for none, so mxfp8 keeps two slices of
// 32 registers: packing its row state to make room cost what the single slice gained
// (docs/PERF.md, items 34, 68, 77, 85 and 86).
template <ScoreOperand kScore>
struct PvSlices {
  static constexpr int kParts = kScore == ScoreOperand::kBf16 ? 1 : 2;
  static constexpr int kDim = kHeadDim / kParts;
  static constexpr int kRegs = kAccRegs / kParts;
};

template <ScoreOperand kScore>
__device__ __forceinline__ void issue_value_product(float (&o_part)[PvSlices<kScore>::kRegs],
                                                    const uint32_t (&a)[kKSlices][kFragRegs],
                                                    const uint8_t* vt, int part) {
  using Pv = PvSlices<kScore>;
  // V^T rows are head dims of kBlockN key bytes: part j starts j Pv::kDim rows in.
  const uint64_t desc_v = wgmma::make_desc_sw128(vt + part * Pv::kDim * kBlockN);
  wgmma::fence_operands(o_part);
  wgmma::fence();
#pragma unroll
  for (int k = 0; k < kKSlices; ++k)
    wgmma::mma_e4m3_rs<Pv::kDim>(o_part, a[k], wgmma::desc_advance(desc_v, k * wgmma::kKBytes),
                                 k > 0);
  wgmma::commit();
}

// The item row (0 .. kBlockM - 1) of a thread's accumulator row r.
__device__ __forceinline__ int thread_row(int warpgroup, int t, int r) {
  return warpgroup * wgmma::kM + wgmma::acc_row(t, 2 * r);
}
__device__ __forceinline__ void thread_rows(int warpgroup, int t, int (&row)[kRows]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) row[r] = thread_row(warpgroup, t, r);
}

template <ScoreOperand kScore, bool kCausal>
__device__ void consumer_mainloop(const Params& p, SharedStorage<kScore>& sm, int warpgroup) {
  constexpr bool kKeyScales = kScore == ScoreOperand::kE4m3;
  constexpr MaskKind kFirstMask = kCausal ? MaskKind::kCausal : MaskKind::kLength;
  static_assert(kHeadDim == kBlockN, "O and S share the accumulator shape");
  const int t = threadIdx.x % kWarpgroupThreads;
  const int quad = t % 4;
  PipelineState<kQStages> q_state;
  PipelineState<kStages> k_state, v_state;
  // The last warpgroup opens warpgroup 0's first turn.
  if (warpgroup == kConsumerWarpgroups - 1) end_turn();

  for (;;) {
    sm.q_pipe.consumer_wait(q_state);
    const WorkItem item = sm.item[q_state.index];
    if (item.doc < 0) {
      // The staged O rows must be read before the CTA's shared memory goes.
      if (kOStaged<kScore> && lane_index() < uint32_t(kWarpRows)) tma_store_wait_read<0>();
      return;
    }
    ItemRows rows;
    rows.begin = sm.item_doc[q_state.index].begin;
    rows.length = sm.item_doc[q_state.index].length;
    rows.m0 = item.first_row;
    RowState st;
    {
      float row_factor[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        row_factor[r] =
            kKeyScales ? sm.q_factor[q_state.index].row[thread_row(warpgroup, t, r)] : p.scale_log2;
      st.init(row_factor);
    }
    float o[kAccRegs];
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) o[i] = 0.0f;
    uint32_t a[kKSlices][kFragRegs];
    float o_rescale[kRows];

    // A warpgroup whose rows all lie past the document's end, or before its start (a leading
    // partial tile; rows are 64-aligned, so none straddles the start), has nothing to compute in
    // the item; under the causal mask, one whose rows all precede the first processed tile's keys
    // has nothing in that tile. Such a turn keeps its place in the round and the pipeline arrivals
    // and skips the MMAs and the softmax: for a row without visible keys the update is the
    // identity. (A path of its own: wgmma under a data-dependent branch serialises the pipeline.)
    const int first_row = rows.m0 + warpgroup * wgmma::kM;
    const int last = item.key_blocks - 1;
    auto idle_turn = [&](int kb) {
      begin_turn();
      sm.k_pipe.consumer_wait(k_state);
      end_turn();
      sm.k_pipe.warp_release(k_state);
      if (kb == 0) sm.q_pipe.warp_release(q_state);
      k_state.advance();
      sm.v_pipe.consumer_wait(v_state);
      sm.v_pipe.warp_release(v_state);
      v_state.advance();
    };
    if (first_row >= rows.length || first_row < 0) {
      for (int kb = last; kb >= 0; --kb) idle_turn(kb);
      begin_turn();  // the round's closing turn
      end_turn();
      q_state.advance();
      continue;
    }

    // Score product of tile kb and its softmax, P~ packed into `a`; the first kMaskedTiles tiles
    // (from kb = last) are masked, a compile-time flag so that the loop carries no mask code.
    auto score_turn_tail = [&](auto masked, float(&s)[kAccRegs], int kb) {
      wgmma::wait_all(s);
      // Masked tiles scale S's columns by the keys' own scales; visible ones (K's tile codes)
      // share one, which joins the row factor.
      float key_unit = 1.0f;
      if constexpr (kKeyScales && decltype(masked)::value)
        scale_columns(s, sm.kscale[k_state.index], quad);
      if constexpr (kKeyScales && !decltype(masked)::value)
        key_unit = sm.kscale[k_state.index].tile_unit;
      sm.k_pipe.warp_release(k_state);
      if (kb == 0) sm.q_pipe.warp_release(q_state);
      k_state.advance();
      sm.v_pipe.consumer_wait(v_state);
      const ValueScales& vs = sm.vscale[v_state.index];
      if constexpr (decltype(masked)::value) {
        const int n0 = kb * kBlockN;
        int row[kRows];
        thread_rows(warpgroup, t, row);
        softmax_masked_tile<kFirstMask>(s, st, vs, quad, row, rows.m0 - n0, rows.length - n0,
                                        o_rescale);
      } else {
        softmax_visible_tile(s, st, vs, key_unit, o_rescale);
      }
      pack_a_fragments<kKSlices>(s, a);
    };
    // PV of the tile whose P~ is in `a`, then O = O * rescale + O_tile, Pv::kDim columns at a
    // time.
    using Pv = PvSlices<kScore>;
    auto value_turn = [&]() {
#pragma unroll
      for (int part = 0; part < Pv::kParts; ++part) {
        float o_part[Pv::kRegs];
        issue_value_product<kScore>(o_part, a, sm.vt[v_state.index], part);
        wgmma::wait_all(o_part);
#pragma unroll
        for (int i = 0; i < Pv::kRegs; ++i) {
          float& oi = o[part * Pv::kRegs + i];
          oi = fmaf(oi, o_rescale[acc_row_half(i)], o_part[i]);
        }
      }
      sm.v_pipe.warp_release(v_state);
      v_state.advance();
    };
    // A turn: PV of the last tile (waited for, so O_tile and S are never live together), the O
    // update, then S of the next tile, left in flight for the other warpgroups' turns.
    auto next_turn = [&](auto masked, int kb) {
      float s[kAccRegs];
      begin_turn();
      value_turn();
      sm.k_pipe.consumer_wait(k_state);
      issue_score_product<kScore>(s, sm, q_state.index, k_state.index, warpgroup);
      end_turn();
      score_turn_tail(masked, s, kb);
    };

    int kb = last;
    if (kCausal && first_row + wgmma::kM <= last * kBlockN) idle_turn(kb--);
    {
      float s[kAccRegs];
      begin_turn();
      sm.k_pipe.consumer_wait(k_state);
      issue_score_product<kScore>(s, sm, q_state.index, k_state.index, warpgroup);
      end_turn();
      score_turn_tail(std::true_type{}, s, kb);
    }
    for (--kb; kb >= 0 && kb > last - kMaskedTiles<kCausal>; --kb) next_turn(std::true_type{}, kb);
    for (; kb >= 0; --kb) next_turn(std::false_type{}, kb);
    begin_turn();
    value_turn();
    end_turn();
    {
      int row[kRows];
      thread_rows(warpgroup, t, row);
      store_outputs(p, o, st, rows, row, item.head, quad,
                    kOStaged<kScore> ? &sm.o_stage[0][0] : nullptr);
    }
    q_state.advance();
  }
}

}  // namespace flamia::sm90::fwd
