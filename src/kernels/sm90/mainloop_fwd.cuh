// The consumer warpgroups' mainloop: for each work item, its key tiles from the last (masked) one
// down to the first, S = Q K^T (QGMMA on E4M3 codes, or HGMMA on BF16 inputs), the online softmax
// (softmax.cuh), P~ converted to E4M3 in registers as the A operand of O_tile = P~ V (register-A
// QGMMA against V^T), and the two-level accumulation O = O * rescale + O_tile: each tile's product
// lands in fresh registers because the FP8 MMA keeps only about 14 significant bits when it chains.
//
// P~ needs no register shuffle (pack_a_fragments, fp8_convert.cuh): the quantizer stores every 16
// keys of V^T in the order the accumulator fragment hands them out.
#pragma once

#include "epilogue_fwd.cuh"
#include "fp8_convert.cuh"
#include "fwd_smem.cuh"
#include "mbarrier.cuh"
#include "named_barrier.cuh"

namespace flamia::sm90::fwd {

constexpr int kKSlices = kBlockN / wgmma::kKE4m3;  // k32 slices of the PV product
constexpr int kFragRegs = 4;                       // b32 registers of one A fragment

// The two consumer warpgroups take turns on the tensor cores (ping-pong): each turn is one
// warpgroup's MMAs between two softmaxes — the PV product of its last tile and the score product
// of its next — so one warpgroup's softmax runs while the other's MMAs do. A turn begins with a
// sync on the warpgroup's own barrier and ends with an arrive on the other's; warpgroup 0 starts.
enum class ConsumerBarrier : uint32_t {
  kTurn0 = kFirstNamedBarrier,  // warpgroup 0 may issue MMAs
  kTurn1,                       // warpgroup 1 may issue MMAs
};
static_assert(named_barrier_id_valid(ConsumerBarrier::kTurn1), "named barrier ids");
constexpr uint32_t kTurnThreads = 2 * kWarpgroupThreads;  // the waiter and the signaller

__device__ __forceinline__ ConsumerBarrier turn_of(int warpgroup) {
  return warpgroup == 0 ? ConsumerBarrier::kTurn0 : ConsumerBarrier::kTurn1;
}
__device__ __forceinline__ void begin_turn(int warpgroup) {
  named_barrier_sync(turn_of(warpgroup), kTurnThreads);
}
__device__ __forceinline__ void end_turn(int warpgroup) {
  named_barrier_arrive(turn_of(1 - warpgroup), kTurnThreads);
}

template <ScoreOperand kScore>
__device__ __forceinline__ void issue_score_product(float (&s)[kAccRegs],
                                                    const SharedStorage<kScore>& sm, int q_stage,
                                                    int k_stage, int warpgroup) {
  using L = SmemLayout<kScore>;
  wgmma::fence_operands(s);
  wgmma::fence();
#pragma unroll
  for (int step = 0; step < L::kSteps; ++step) {
    const int span = step / L::kStepsPerSpan;
    const uint32_t offset = (step % L::kStepsPerSpan) * wgmma::kKBytes;
    const uint64_t desc_q =
        wgmma::desc_advance(wgmma::make_desc_sw128(sm.q[q_stage] + span * L::kQSpanBytes +
                                                   warpgroup * L::kWarpgroupQBytes),
                            offset);
    const uint64_t desc_k =
        wgmma::desc_advance(wgmma::make_desc_sw128(sm.k[k_stage] + span * L::kKSpanBytes), offset);
    if constexpr (kScore == ScoreOperand::kE4m3) {
      wgmma::mma_e4m3<kBlockN>(s, desc_q, desc_k, step > 0);
    } else {
      wgmma::mma_bf16<kBlockN>(s, desc_q, desc_k, step > 0);
    }
  }
  wgmma::commit();
}

__device__ __forceinline__ void wait_all(float (&acc)[kAccRegs]) {
  wgmma::wait<0>();
  wgmma::fence_operands(acc);
}

__device__ __forceinline__ void issue_value_product(float (&o_tile)[kAccRegs],
                                                    const uint32_t (&a)[kKSlices][kFragRegs],
                                                    const uint8_t* vt) {
  const uint64_t desc_v = wgmma::make_desc_sw128(vt);
  wgmma::fence_operands(o_tile);
  wgmma::fence();
#pragma unroll
  for (int k = 0; k < kKSlices; ++k)
    wgmma::mma_e4m3_rs<kHeadDim>(o_tile, a[k], wgmma::desc_advance(desc_v, k * wgmma::kKBytes),
                                 k > 0);
  wgmma::commit();
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
  if (warpgroup == 1) end_turn(warpgroup);  // warpgroup 0 takes the first turn

  for (;;) {
    sm.q_pipe.consumer_wait(q_state);
    const WorkItem item = sm.item[q_state.index];
    if (item.doc < 0) return;
    const int64_t begin = p.cu_seqlens[item.doc];
    const int length = int(p.cu_seqlens[item.doc + 1] - begin);
    const int m0 = item.q_tile * kBlockM;

    int row[kRows];
    float row_factor[kRows];
    EpilogueRows out_rows;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row[r] = warpgroup * wgmma::kM + wgmma::acc_row(t, 2 * r);
      const int64_t token = begin + m0 + row[r];
      out_rows.token[r] = token;
      out_rows.valid[r] = m0 + row[r] < length;
      float e = 1.0f;
      if constexpr (kKeyScales)
        e = ue8m0::decode(token < p.tokens_padded
                              ? __ldg(p.q_exponents + item.head * p.tokens_padded + token)
                              : kUnitExponentCode);
      row_factor[r] = p.scale_log2 * e;
    }
    RowState st;
    st.init(row_factor);
    float o[kAccRegs];
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) o[i] = 0.0f;
    uint32_t a[kKSlices][kFragRegs];
    float o_rescale[kRows];

    // Score product of tile kb and its softmax, P~ packed into `a`; the first (kb = last) tile is
    // the masked one.
    auto score_turn_tail = [&](float(&s)[kAccRegs], int kb) {
      wait_all(s);
      if constexpr (kKeyScales) scale_columns(s, sm.kscale[k_state.index], quad);
      sm.k_pipe.warp_release(k_state);
      if (kb == 0) sm.q_pipe.warp_release(q_state);
      k_state.advance();
      sm.v_pipe.consumer_wait(v_state);
      const ValueScales& vs = sm.vscale[v_state.index];
      if (kb == item.key_blocks - 1) {
        const int n0 = kb * kBlockN;
        softmax_masked_tile<kFirstMask>(s, st, vs, quad, row, m0 - n0, length - n0, o_rescale);
      } else {
        softmax_visible_tile(s, st, vs, quad, o_rescale);
      }
      pack_a_fragments<kKSlices>(s, a);
    };
    // PV of the tile whose P~ is in `a`, then O = O * rescale + O_tile.
    auto value_turn = [&]() {
      float o_tile[kAccRegs];
      issue_value_product(o_tile, a, sm.vt[v_state.index]);
      wait_all(o_tile);
      sm.v_pipe.warp_release(v_state);
      v_state.advance();
#pragma unroll
      for (int i = 0; i < kAccRegs; ++i) o[i] = fmaf(o[i], o_rescale[acc_row_half(i)], o_tile[i]);
    };

    {
      float s[kAccRegs];
      begin_turn(warpgroup);
      sm.k_pipe.consumer_wait(k_state);
      issue_score_product<kScore>(s, sm, q_state.index, k_state.index, warpgroup);
      end_turn(warpgroup);
      score_turn_tail(s, item.key_blocks - 1);
    }
    // A turn: PV of the last tile (waited for, so O_tile and S are never live together), the O
    // update, then S of the next tile, left in flight for the other warpgroup's turn.
    for (int kb = item.key_blocks - 2; kb >= 0; --kb) {
      float s[kAccRegs];
      begin_turn(warpgroup);
      value_turn();
      sm.k_pipe.consumer_wait(k_state);
      issue_score_product<kScore>(s, sm, q_state.index, k_state.index, warpgroup);
      end_turn(warpgroup);
      score_turn_tail(s, kb);
    }
    begin_turn(warpgroup);
    value_turn();
    end_turn(warpgroup);
    store_outputs(p, o, st, out_rows, item.head, quad);
    q_state.advance();
  }
}

}  // namespace flamia::sm90::fwd
