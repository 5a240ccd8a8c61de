// Per-query-row vectors of one backward step, staged in shared memory by the producer warp (DESIGN
// §2, §4): the terms of P' and dS' (bwd_smem.cuh: the Q and dO scales in P's exponent), and the
// fold of P'^T to dV's operand relative to the tile's reference exponent C (constant along dV's
// contraction).
#pragma once

#include <climits>
#include <cmath>

#include "arch.cuh"
#include "bwd_smem.cuh"
#include "flamia/attention.h"
#include "flamia/emulator.h"
#include "flamia/formats.h"

namespace flamia::sm90::bwd {

constexpr int kRowsPerLane = kBlockM / int(kWarpThreads);
static_assert(kRowsPerLane * int(kWarpThreads) == kBlockM, "one warp covers a query tile");
// P^T * 2^(e_dO - C + 8) <= 2^8: folds below 2^-kFoldFloorLog2 give E4M3 zero either way.
constexpr int kFoldFloorLog2 = 64;
constexpr uint8_t kUnitExponentCode = ue8m0::kBias;

struct StepGeometry {
  int64_t begin;  // the document's first token
  int length;     // its tokens
  int m0;         // the tile's first (document-relative) query row
  int n0;         // the key block's first key
  int head;       // query head
};

// A lane's inputs for its rows (l and l + 32) of one step, loaded from global memory before the
// stage they go to is free, so that their latency overlaps the producer's wait for it.
struct RowLoads {
  int e_q[kRowsPerLane];  // Q and dO scale exponents (0 past the document)
  int e_g[kRowsPerLane];
  float lse[kRowsPerLane];  // LSE and D (unused past the document)
  float delta[kRowsPerLane];
};

__device__ __forceinline__ RowLoads load_query_rows(const Params& p, const StepGeometry& g,
                                                    int lane) {
  RowLoads in;
#pragma unroll
  for (int k = 0; k < kRowsPerLane; ++k) {
    const int r = lane + k * int(kWarpThreads);
    const int64_t token = g.begin + g.m0 + r;
    const bool valid = g.m0 + r < g.length;
    const int64_t exp_at = int64_t(g.head) * p.tokens_padded + token;
    const int64_t stat_at = int64_t(g.head) * p.tokens + token;
    in.e_q[k] = valid ? int(__ldg(p.q_exponents + exp_at)) - ue8m0::kBias : 0;
    in.e_g[k] = valid ? int(__ldg(p.dout_exponents + exp_at)) - ue8m0::kBias : 0;
    in.lse[k] = valid ? __ldg(p.lse + stat_at) : 0.0f;
    in.delta[k] = valid ? __ldg(p.delta + stat_at) : 0.0f;
  }
  return in;
}

// All 32 lanes of the producer warp; lane l stages rows l and l + 32.
template <ScoreOperand kScore, bool kCausal>
__device__ __forceinline__ void stage_query_rows(QueryRows& dst, const Params& p,
                                                 const StepGeometry& g, const RowLoads& in,
                                                 int lane) {
  constexpr unsigned kFull = 0xFFFFFFFFu;
  int e_g[kRowsPerLane], e_qg[kRowsPerLane];
  RowTerms terms[kRowsPerLane];
  bool sees[kRowsPerLane];
  int c_ref = INT_MIN;
#pragma unroll
  for (int k = 0; k < kRowsPerLane; ++k) {
    const int r = lane + k * int(kWarpThreads);
    const bool valid = g.m0 + r < g.length;
    const int e_q = in.e_q[k];
    e_g[k] = in.e_g[k];
    const float q_unit = exp2i(e_q);
    terms[k].rf = kScore == ScoreOperand::kE4m3 ? p.scale_log2 * q_unit : p.scale_log2;
    terms[k].bias = valid ? float(e_q + e_g[k]) - in.lse[k] * kLog2e : -INFINITY;
    terms[k].delta = valid ? in.delta[k] * exp2i(-e_g[k]) : 0.0f;
    e_qg[k] = e_q + e_g[k];
    dst.q_inverse[r] = valid ? exp2i(-e_q) : 0.0f;
    sees[k] = valid && (!kCausal || g.m0 + r >= g.n0);
    if (sees[k]) c_ref = max(c_ref, e_g[k]);
  }
#pragma unroll
  for (int d = 1; d < int(kWarpThreads); d *= 2)
    c_ref = max(c_ref, __shfl_xor_sync(kFull, c_ref, d));
#pragma unroll
  for (int k = 0; k < kRowsPerLane; ++k) {
    const int r = lane + k * int(kWarpThreads);
    terms[k].p_fold =
        sees[k] ? exp2i(max(e_g[k] - c_ref + kPOffsetLog2, -kFoldFloorLog2) - e_qg[k]) : 0.0f;
    dst.terms[r] = terms[k];
  }
  if (lane == 0) dst.dv_unit = c_ref == INT_MIN ? 0.0f : exp2i(c_ref - kPOffsetLog2);
}

}  // namespace flamia::sm90::bwd
