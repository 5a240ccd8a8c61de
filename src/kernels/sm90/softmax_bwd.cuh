// The backward's elementwise stage on a consumer warpgroup's S^T and dP^T accumulators (64 keys x
// 64 queries; DESIGN §2, §4, the algorithm of flamia/emulator.h):
//   P_ij   = 2^(S_ij c 2^e_k(j) 2^e_q(i) - LSE_i log2 e) the forward's exp2 (ex2.approx); on K's
//                                                        tile codes e_k(j) is the block's largest
//   dS_ij  = P_ij (dP_ij 2^e_dO(i) 2^e_v(j) - D_i)
//   dV's A operand: E4M3(P_ij 2^(e_dO(i) - C + 8))^T      the dO scale folded into P^T
//   dK's A operand: E4M3(dS_ij 2^e_q(i) / 2^ec_j)^T       ec_j: key j's scale over the tile's rows
//   dQ's operand:   E4M3(dS_ij 2^e_k(j) / 2^er_i)         er_i: row i's scale over the block's
//                                                        keys, from both warpgroups (mainloop)
// The kernel computes the same codes from P'' = P 2^(e_dO - C + 8) and dS'' = dS 2^e_q 2^(8 - C)
// (bwd_smem.cuh's RowTerms): the row scales enter P's exponent instead of multiplying every entry.
// A thread holds keys r and r + 8 of its warp's 16 (rows of S^T) and, per 8 queries, queries 2t and
// 2t + 1 of its quad; key statistics reduce over the quad.
#pragma once

#include "bwd_smem.cuh"
#include "flamia/formats.h"
#include "fp8_convert.cuh"
#include "softmax.cuh"

namespace flamia::sm90::bwd {

using fwd::exp2_approx;
using fwd::quad_max;

constexpr int kKeyRows = 2;                            // keys per thread
constexpr int kTileRegs = wgmma::acc_regs(kBlockM);    // a warpgroup's 64 keys x 64 queries
constexpr int kColGroups = kTileRegs / 4;              // 8-query groups: registers 4g..4g+3
constexpr int kQuerySlices = kBlockM / wgmma::kKE4m3;  // k32 slices of the dV and dK products
constexpr int kThreadQueries = 2 * kColGroups;         // queries a thread holds

__device__ __forceinline__ int key_half(int i) {
  return (i >> 1) & 1;
}
// The query (column) of register i for a thread of quad position `quad`.
__device__ __forceinline__ int query_of(int quad, int i) {
  return wgmma::acc_col(quad, i);
}
// The thread's i-th query in its list of kThreadQueries (2 per 8-query group).
__device__ __forceinline__ int listed_query(int quad, int n) {
  return 8 * (n >> 1) + 2 * quad + (n & 1);
}

// Two 16-bit scale keys per word (e4m3_scale_key16), reduced with per-halfword maxima.
constexpr uint32_t kKeyMask = (1u << kE4m3ScaleKeyBits) - 1;
__device__ __forceinline__ uint32_t scale_key_pair(float amax_lo, float amax_hi) {
  return e4m3_scale_key16(amax_lo) | e4m3_scale_key16(amax_hi) << kE4m3ScaleKeyBits;
}
// The unclamped scale field of the key in half `half` (0: low) of a pair.
__device__ __forceinline__ uint32_t scale_field_of_pair(uint32_t keys, int half) {
  return e4m3_scale_field_of_key16((keys >> (half * kE4m3ScaleKeyBits)) & kKeyMask);
}
// An operand's scale field from a pair's reduced keys: a row or key without a nonzero value gets
// the floor field (its codes are zeros at any scale).
__device__ __forceinline__ uint32_t operand_field_of_pair(uint32_t keys, int half) {
  return max(scale_field_of_pair(keys, half), e4m3_scale::kMinField);
}
__device__ __forceinline__ uint32_t quad_max_u16x2(uint32_t keys) {
  constexpr unsigned kFull = 0xFFFFFFFFu;
  keys = __vmaxu2(keys, __shfl_xor_sync(kFull, keys, 1));
  return __vmaxu2(keys, __shfl_xor_sync(kFull, keys, 2));
}

// A thread's two keys of the block.
struct KeyRows {
  float score[kKeyRows];  // c 2^e_k: S's column factor with the softmax scale (c for BF16 K)
  float fold[kKeyRows];   // 2^e_k: folded into dS for dQ; 0 past the document
  float v[kKeyRows];      // 2^e_v: dP's column scale; 0 past the document
  int key[kKeyRows];      // document-relative key index
};

// The register A operands of the dV and dK products, and dK's per-key units 2^ec.
struct KeyOperands {
  uint32_t p[kQuerySlices][4];
  uint32_t ds[kQuerySlices][4];
  float ds_unit[kKeyRows];
};

// A thread's share of one step's DiagnosticCounters, and where the step's dS row sums go.
struct StepDiagnostics {
  uint32_t entries = 0, nonzero = 0, zero_dq = 0, zero_dk = 0, pt_underflow = 0;
  float* row_sum;  // Params::row_sum + head * T + the document's first token
  float* row_abs;
};

// Adds each listed query's dS sums over the warp's 16 keys to the row sums (lane group l / 4
// adds listed queries l / 4 and l / 4 + 8).
__device__ __forceinline__ void add_row_sums(const StepDiagnostics& diag, int n, float sum,
                                             float abs_sum, int query, int length) {
  constexpr unsigned kFull = 0xFFFFFFFFu;
#pragma unroll
  for (int d = 4; d < int(kWarpThreads); d *= 2) {
    sum += __shfl_xor_sync(kFull, sum, d);
    abs_sum += __shfl_xor_sync(kFull, abs_sum, d);
  }
  if ((n & 7) == int(lane_index()) / 4 && query < length) {
    atomicAdd(diag.row_sum + query, sum);
    atomicAdd(diag.row_abs + query, abs_sum);
  }
}

// A nonzero value whose E4M3 code is zero.
__device__ __forceinline__ bool rounds_to_zero(float x) {
  constexpr uint32_t kMagnitudeBits = 0x7F;
  return x != 0.0f && (e4m3x2_rn_satfinite(x, 0.0f) & kMagnitudeBits) == 0;
}

// One entry's P'' = 2^(S c 2^e_k 2^e_q + bias) (on BF16 scores: S c + bias) and, once masked,
// dS'' = P'' 2^e_q (dP 2^e_v - D 2^-e_dO) (bwd_smem.cuh's RowTerms). The split backward's dQ pass
// (dq_kernel.cuh) forms them with these too: its dQ must be the fused kernel's bit for bit.
template <bool kE4m3Scores>
__device__ __forceinline__ float scaled_probability(float s, float score, float rf, float bias) {
  return exp2_approx(kE4m3Scores ? fmaf(s * score, rf, bias) : fmaf(s, score, bias));
}
__device__ __forceinline__ float scaled_gradient(float p, float rf, float dp, float v,
                                                 float delta) {
  return (p * rf) * fmaf(dp, v, -delta);
}

// A thread's RowTerms: its quad position's run of sixteen queries (8 g + 2 quad + c in the order
// 2 g + c), two floats each, read for two column groups at a time: two 16-byte loads.
constexpr int kPairChunks = 2 * 2 * kRowTermFloats / 4;
static_assert(2 * 2 * kRowTermFloats % 4 == 0, "a pair of groups in whole 16-byte chunks");
struct GroupPairTerms {
  float4 chunk[kPairChunks];
  // Query c of group g (g's parity selects the pair's half).
  __device__ __forceinline__ RowTerms at(int g, int c) const {
    float w[kRowTermFloats];
#pragma unroll
    for (int j = 0; j < kRowTermFloats; ++j) {
      const int f = kRowTermFloats * (2 * (g % 2) + c) + j;
      const float4& v = chunk[f / 4];
      w[j] = f % 4 == 0 ? v.x : f % 4 == 1 ? v.y : f % 4 == 2 ? v.z : v.w;
    }
    return {row_factor_of(w[1]), w[0], w[1]};
  }
};
__device__ __forceinline__ GroupPairTerms load_pair_terms(const QueryRows& rows, int quad,
                                                          int pair) {
  GroupPairTerms t;
  const float4* run = reinterpret_cast<const float4*>(rows.terms[quad]) + pair * kPairChunks;
#pragma unroll
  for (int i = 0; i < kPairChunks; ++i) t.chunk[i] = run[i];
  return t;
}

// P'' = P 2^(e_dO - C + 8) and dS'' = dS 2^e_q 2^(8 - C) of one step (bwd_smem.cuh's RowTerms). On
// return dp holds dS'' 2^e_k (dQ's operand before its row scale, which therefore comes out
// 2^(e_q + 8 - C) too large: the dQ unit takes it back), ops the packed operands of dV and dK
// (dK's units with 2^(C - 8)), and query_max the thread's |dS'' 2^e_k| maxima over its two keys
// for each listed query. kMasked: keys past the document or (causal) after the query, and queries
// past the document, get P = 0; unmasked tiles lie inside the document. kDiagnostics: also counts
// into `diag` (the fast path compiles without it).
template <bool kMasked, bool kCausal, bool kDiagnostics, bool kE4m3Scores>
__device__ __forceinline__ void gradient_step(float (&s)[kTileRegs], float (&dp)[kTileRegs],
                                              const QueryRows& rows, const KeyRows& kr, int quad,
                                              int m0, int length, KeyOperands& ops,
                                              float (&query_max)[kThreadQueries],
                                              StepDiagnostics& diag) {
  GroupPairTerms terms;
#pragma unroll
  for (int g = 0; g < kColGroups; ++g) {
    const int c0 = 8 * g + 2 * quad;
    if (g % 2 == 0) terms = load_pair_terms(rows, quad, g / 2);
    const RowTerms t[2] = {terms.at(g, 0), terms.at(g, 1)};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = 4 * g + k, r = key_half(i), c = k & 1;
      float p = scaled_probability<kE4m3Scores>(s[i], kr.score[r], t[c].rf, t[c].bias);
      bool visible = true;
      if constexpr (kMasked) {
        const int query = m0 + c0 + c;
        // The query bound too: with BF16 score operands a row past the document may hold any
        // value, and P = 0 must not depend on it.
        visible = kr.key[r] < length && query < length && (!kCausal || kr.key[r] <= query);
        if (!visible) p = 0.0f;
      }
      // The scalings by powers of two are exact: dS'' = P'' 2^e_q (dP 2^e_v - D 2^-e_dO) is the
      // emulator's P ((dP 2^e_dO) 2^e_v - D) 2^e_q 2^(8 - C) with one rounding fewer.
      dp[i] = scaled_gradient(p, t[c].rf, dp[i], kr.v[r], t[c].delta);
      s[i] = p;
      if constexpr (kDiagnostics) {
        diag.entries += visible;
        diag.nonzero += dp[i] != 0.0f;
        diag.pt_underflow += p != 0.0f && rounds_to_zero(s[i]);
      }
    }
  }
  pack_a_fragments<kQuerySlices>(s, ops.p);

  // dK's operand: dS' (2^e_q folded in already) in the key's scale over the tile's 64 queries. The
  // thread's two keys' 16-bit scale keys share a word, reduced over the quad in one pass (a key
  // with no nonzero dS gets the floor field: its codes are zeros at any scale).
  float amax[kKeyRows] = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < kTileRegs; ++i) amax[key_half(i)] = fmaxf(amax[key_half(i)], fabsf(dp[i]));
  const uint32_t keys = quad_max_u16x2(scale_key_pair(amax[0], amax[1]));
#pragma unroll
  for (int r = 0; r < kKeyRows; ++r) {
    const uint32_t field = operand_field_of_pair(keys, r);
    ops.ds_unit[r] = exp2i(scale_exponent_up_e4m3_of_field(field)) * rows.dv_unit;  // 2^(C-8)
    amax[r] = inverse_scale_e4m3_of_field(field);  // now the inverse unit
  }
#pragma unroll
  for (int i = 0; i < kTileRegs; ++i) {
    s[i] = dp[i] * amax[key_half(i)];
    if constexpr (kDiagnostics) diag.zero_dk += dp[i] != 0.0f && rounds_to_zero(s[i]);
  }
  pack_a_fragments<kQuerySlices>(s, ops.ds);

  // dQ's operand: dS 2^e_k, left in dp, and each query's maximum of it over all 128 keys, of which
  // this is the thread's share.
#pragma unroll
  for (int n = 0; n < kThreadQueries; ++n) {
    const int i0 = 4 * (n >> 1) + (n & 1);  // key r's register of listed query n; key r + 8: +2
    if constexpr (kDiagnostics) {
      // dS'' back to dS: 2^-e_q before 2^(C - 8), whose product may leave float's range (a row
      // near the smallest exponent beside a large C) where each step alone stays inside it.
      const float q_inverse = rows.q_inverse[listed_query(quad, n)], unit = rows.dv_unit;
      add_row_sums(diag, n, (dp[i0] + dp[i0 + 2]) * q_inverse * unit,
                   (fabsf(dp[i0]) + fabsf(dp[i0 + 2])) * q_inverse * unit,
                   m0 + listed_query(quad, n), length);
    }
    dp[i0] *= kr.fold[0];
    dp[i0 + 2] *= kr.fold[1];
    query_max[n] = fmaxf(fabsf(dp[i0]), fabsf(dp[i0 + 2]));
  }
}

// Adds a warp's step counts to the kernel's counters (diagnostic runs only).
__device__ __forceinline__ void publish_diagnostics(DiagnosticCounters* totals,
                                                    const StepDiagnostics& diag) {
  constexpr unsigned kFull = 0xFFFFFFFFu;
  constexpr int kCounters = 5;
  uint32_t counts[kCounters] = {diag.entries, diag.nonzero, diag.zero_dq, diag.zero_dk,
                                diag.pt_underflow};
  unsigned long long* sums[kCounters] = {&totals->ds_entries, &totals->ds_nonzero,
                                         &totals->ds_zero_dq, &totals->ds_zero_dk,
                                         &totals->pt_underflow};
#pragma unroll
  for (int c = 0; c < kCounters; ++c) {
#pragma unroll
    for (int d = 1; d < int(kWarpThreads); d *= 2)
      counts[c] += __shfl_xor_sync(kFull, counts[c], d);
    if (lane_index() == 0) atomicAdd(sums[c], (unsigned long long)counts[c]);
  }
}

// The butterfly below works on the maxima's 16-bit scale keys (e4m3_scale_key16: the maximum's
// field is the keys' maximum shifted), two queries per 32-bit word reduced by one per-halfword
// maximum (VIMNMX.U16x2): half the shuffles of a float butterfly, and no field conversion after.
// One exchange of the transposing butterfly: over lane bit kBit, w[0, 2 kWidth) becomes
// w[0, kWidth), the lane keeping the half its bit selects.
template <int kBit, int kWidth>
__device__ __forceinline__ void butterfly_max_round(uint32_t (&w)[kThreadQueries / 2], int lane,
                                                    int& first) {
  constexpr unsigned kFull = 0xFFFFFFFFu;
  const bool upper = (lane >> kBit) & 1;
#pragma unroll
  for (int j = 0; j < kWidth; ++j) {
    const uint32_t lo = w[j], hi = w[j + kWidth];
    const uint32_t mine = upper ? hi : lo, theirs = upper ? lo : hi;
    w[j] = __vmaxu2(mine, __shfl_xor_sync(kFull, theirs, 1 << kBit));
  }
  first += upper ? 2 * kWidth : 0;
}

// Reduces each listed query's maximum over the warp's 16 keys (the 8 lanes of equal quad
// position) by a transposing butterfly: each exchange over lane bit b halves the words a lane
// keeps, so after bits 4, 3, 2 (7 shuffles) lane l holds listed queries 8 b4 + 4 b3 + 2 b2 and
// the next one, whose scale fields it publishes to the block-wide maxima.
__device__ __forceinline__ void publish_query_max(int* row_max, float (&query_max)[kThreadQueries],
                                                  int quad) {
  const int lane = int(lane_index());
  uint32_t w[kThreadQueries / 2];
#pragma unroll
  for (int k = 0; k < kThreadQueries / 2; ++k)
    w[k] = scale_key_pair(query_max[2 * k], query_max[2 * k + 1]);
  int first = 0;  // the listed query of w[0]'s low half
  butterfly_max_round<4, 4>(w, lane, first);
  butterfly_max_round<3, 2>(w, lane, first);
  butterfly_max_round<2, 1>(w, lane, first);
  // The buffers start at kMinField (kRowMaxFloor): the unclamped fields suffice.
  atomicMax(&row_max[listed_query(quad, first)], int(scale_field_of_pair(w[0], 0)));
  atomicMax(&row_max[listed_query(quad, first + 1)], int(scale_field_of_pair(w[0], 1)));
}

}  // namespace flamia::sm90::bwd
