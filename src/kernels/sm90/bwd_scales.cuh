// Per-query-row vectors of one backward step, staged in shared memory by two producer warps (DESIGN
// §2, §4): the terms of P'' and dS'' (bwd_smem.cuh: dO's scale and the tile's reference exponent C
// of dV's fold in P's exponent, Q's scale in S's row factor), and the units that take them back.
#pragma once

#include <climits>
#include <cmath>

#include "arch.cuh"
#include "bwd_smem.cuh"
#include "flamia/attention.h"
#include "flamia/emulator.h"
#include "flamia/formats.h"

namespace flamia::sm90::bwd {

// Two producer warps stage a query tile's rows, lane l of row warp w row l + 32 w.
constexpr int kRowWarps = kBlockM / int(kWarpThreads);
static_assert(kRowWarps * int(kWarpThreads) == kBlockM, "two warps cover a query tile");
constexpr uint8_t kUnitExponentCode = ue8m0::kBias;

struct StepGeometry {
  int64_t begin;  // the document's first token
  int length;     // its tokens
  int m0;         // the tile's first (document-relative) query row
  int n0;         // the key block's first key
  int head;       // query head
};

// A lane's inputs for its row of one step, loaded from global memory before the stage they go to
// is free, so that their latency overlaps the warp's wait for it; and the dO exponents of the
// lane's rows in every row warp, as each warp forms the tile's reference C over all 64 rows itself.
struct RowLoads {
  int e_q;             // Q's scale exponent (0 past the document)
  int e_g[kRowWarps];  // dO's, of rows lane + 32 k (0 past the document)
  float lse;           // LSE and D (unused past the document)
  float delta;
};

__device__ __forceinline__ bool row_in_document(const StepGeometry& g, int r) {
  return g.m0 + r < g.length;
}

template <int kRowWarp>
__device__ __forceinline__ RowLoads load_query_rows(const Params& p, const StepGeometry& g,
                                                    int lane) {
  RowLoads in;
  const int64_t tile_token = g.begin + g.m0;
  const int64_t exp_row = int64_t(g.head) * p.tokens_padded + tile_token;
#pragma unroll
  for (int k = 0; k < kRowWarps; ++k) {
    const int r = lane + k * int(kWarpThreads);
    in.e_g[k] =
        row_in_document(g, r) ? int(__ldg(p.dout_exponents + exp_row + r)) - ue8m0::kBias : 0;
  }
  const int r = lane + kRowWarp * int(kWarpThreads);
  const bool valid = row_in_document(g, r);
  const int64_t stat_at = int64_t(g.head) * p.tokens + tile_token + r;
  in.e_q = valid ? int(__ldg(p.q_exponents + exp_row + r)) - ue8m0::kBias : 0;
  in.lse = valid ? __ldg(p.lse + stat_at) : 0.0f;
  in.delta = valid ? __ldg(p.delta + stat_at) : 0.0f;
  return in;
}

// All 32 lanes of row warp kRowWarp; lane l stages row l + 32 kRowWarp.
template <ScoreOperand kScore, bool kCausal, int kRowWarp>
__device__ __forceinline__ void stage_query_rows(QueryRows& dst, const Params& p,
                                                 const StepGeometry& g, const RowLoads& in,
                                                 int lane) {
  constexpr unsigned kFull = 0xFFFFFFFFu;
  // C: the largest dO exponent over the tile's rows that see the key block.
  int c_ref = INT_MIN;
#pragma unroll
  for (int k = 0; k < kRowWarps; ++k) {
    const int r = lane + k * int(kWarpThreads);
    if (row_in_document(g, r) && (!kCausal || g.m0 + r >= g.n0)) c_ref = max(c_ref, in.e_g[k]);
  }
#pragma unroll
  for (int d = 1; d < int(kWarpThreads); d *= 2)
    c_ref = max(c_ref, __shfl_xor_sync(kFull, c_ref, d));

  const int r = lane + kRowWarp * int(kWarpThreads);
  const bool valid = row_in_document(g, r);
  const bool sees = valid && (!kCausal || g.m0 + r >= g.n0);
  const int e_g = in.e_g[kRowWarp];
  // P'' = P 2^fold, dV's operand. Where a row's dO scale lies far below the tile's C, P'' (so
  // dS'') flushes the entries with P < 2^-126 / 2^fold: negligible beside the row's P elsewhere,
  // which sums to 1.
  const int fold = e_g - c_ref + kPOffsetLog2;
  // A row at the smallest exponent (all-zero, or nonzero and clamped there) keeps its own 2^-127:
  // the gradient forms P'' 2^e_q by a multiply, which keeps subnormals (ex2's flush would not),
  // and the row's dK share must stay at its scale. The stores' order is ptxas's schedule of the
  // producer's loop: q_inverse first measured 0.7 % faster for the whole kernel (docs/PERF.md,
  // item 193).
  dst.q_inverse[r] = valid ? exp2i(-in.e_q) : 0.0f;
  float* terms = row_terms_of(dst, r);  // bias, then the delta word (bwd_smem.cuh)
  terms[0] = sees ? float(fold) - in.lse * kLog2e : -INFINITY;
  terms[1] = delta_word(valid ? in.delta * exp2i(-e_g) : 0.0f, exp2i(in.e_q));
  if (r == 0) dst.dv_unit = c_ref == INT_MIN ? 0.0f : exp2i(c_ref - kPOffsetLog2);
}

}  // namespace flamia::sm90::bwd
