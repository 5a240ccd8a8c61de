// The GPU forward (flamia/attention_gpu.h) against the CPU emulator run with the kernel's tiles
// (EmulatorConfig::forward = kGpuForwardTiles, forward only): packed documents of 0..2048 tokens at
// unaligned offsets, GQA, causal and not, mxfp8 (token, block32, tensor policies, Hadamard) and
// mxfp8-qk16, normal, heavy-tail and outlier inputs; then poisoned and strided outputs, the
// quantized-operand entry point, non-finite inputs, argument checks, and the causality probe run
// on the GPU.
//
// Tolerances (derived, not tuned; every test prints what it measured as "[measured]" lines):
//
// The GPU computes the emulator's algorithm; the two differ only by
//   (a) ex2.approx.ftz: <= 2 ulp from the correctly rounded 2^x (PTX ISA), subnormals flushed;
//   (b) summation order: l, and the P~V products inside a key tile (FP32 either way);
//   (c) the tensor cores' accumulator, which keeps about 14 significant bits: products are aligned
//       to the largest and truncated (docs/PERF.md; tests/gpu/test_gpu_gemm.cu measured 2^-13 of
//       sum |a b| per k32 instruction on average over 64 of them). One instruction whose sum is
//       dominated by a few products can lose a few times more; the bound here allows 2^-11 of
//       sum |a b| per instruction. For the score product over D = 128 (4 k32 FP8 instructions;
//       mxfp8-qk16's BF16 product is given 8 k16 instructions, pessimistically) the base-2 logit
//       then moves by
//         |dt_ij| <= delta_i = instructions 2^-11 A_i,  A_i = max_j scale log2(e) sum_d |q_d k_d|
//       (A_i from the quantized operands, FP64).
// Each P = 2^(t - m + 8) then changes by a factor within 2^(+-delta) (plus 2 ulp), and its E4M3
// rounding P~ by that factor and at most one E4M3 step (2^-3 relative for normal codes, 2^-9
// absolute for subnormal ones) when P lies near a rounding midpoint. Hence, per element:
//
//   LSE: |LSE_gpu - LSE_emu| <= ln2 delta_i + 1e-5 + 4e-6 |LSE|
//        (ln2 delta: LSE is a softmax-weighted mean of the logits; 1e-5: |d ln l| from the two
//        summation orders, about sqrt(n) 2^-24 <= 3e-6 at n = 2048 keys, and 2 ulp of ex2, with
//        margin; 4e-6 |LSE|: the FP32 roundings of m - 8 + log2 l, 1 ulp each side, 20x margin).
//   O:   |O_gpu - O_emu| <= ulp_bf16 + (2^-3 2^delta + 2 (2^delta - 1) + 2^-10) W + U
//        W_id = sum_j p_ij |v_jd| (softmax of the quantized operands, FP64): one E4M3 step of
//        every P~ (2^-3 W), the factor 2^delta on P~ and on l, the P~V accumulator ((D/32) 2^-13
//        per key tile, summed over tiles: 2^-11 W, doubled); U_id = 2^-9 sum_j |v_jd| 2^(R - ev_j)
//        / l: one subnormal step of every P~; ulp_bf16: the two final BF16 roundings.
//        This is a worst case (every P~ flips); it catches wrong rows, heads, documents, masks or
//        dropped tiles, not small drifts. The statistic below does.
//   rel L2(O_gpu - O_emu) <= 0.5 rel L2(O_emu - O_fp64)
//        A P~ flips when its perturbation |dP/P| ~ ln2 |dt| reaches the nearest E4M3 rounding
//        midpoint, so a fraction f ~ 2 ln2 |dt| / 2^-3.5 of the P~ move by one step. The rms of
//        those steps is sqrt(12 f) times the rms of the emulator's own rounding of P~, which is one
//        part of rel L2(O_emu - O_fp64) (with the rounding of Q, K, V): the bound 0.5 holds while
//        f <= ~2%, i.e. |dt| <~ 1.3e-3.
// Calibration, on a CPU model of (a)-(c) (14-bit aligned truncation per k32 step, +-2 ulp ex2,
// key-tile-wise PV, 4-way split l) on the cases below: ratio 0.01-0.18 (0.02-0.27 at 13 bits),
// |dO| and |dLSE| within 0.16-0.51 and 0.03-0.29 of their bounds (at 13 bits: 0.18-0.56,
// 0.05-0.66). Injected faults fail them: a missing 2^(R_old - R_new) rescale (ratio up to 20,
// |dO| 30x its bound), a wrong softmax scale (|dLSE| 3-17x). The emulator run with 128x64 tiles
// (the same algorithm up to P~'s roundings) passes them; the exact-score tests below catch it.
//
// Exact-score inputs (GpuAttentionFwdExactScores): Q and K rows of small integers times a power
// of two per token make every partial sum of the score products exact in 11 bits, so (c) vanishes
// for the score product, t and m are bitwise equal (delta = 0), and only (a), (b) and the P~V
// accumulator remain. Then, besides the bounds above with delta = 0 (LSE within 1e-5 + 4e-6
// |LSE|), 99% of the O elements must lie within ulp_bf16 + 2^-10 W (the rest: P~ that ex2's
// 2 ulp flipped, ~1e-5 of them, each moving its row's O).
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <functional>
#include <iostream>
#include <iterator>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "device_buffer.h"
#include "flamia/attention_gpu.h"
#include "flamia/emulator.h"
#include "flamia/inputs.h"
#include "flamia/metrics.h"
#include "flamia/probe.h"
#include "flamia/quantize.h"
#include "flamia/quantize_gpu.h"
#include "flamia/reference.h"
#include "gpu_test.h"
#include "quantize_outputs.h"

namespace flamia {
namespace {

using cuda::DeviceBuffer;

constexpr int kDim = 128;
constexpr int kScoreLossLog2 = -11;  // per tensor-core instruction, of sum |a b| (header)
constexpr double kLog2e = 1.4426950408889634, kLn2 = 0.6931471805599453;
constexpr double kRatioBound = 0.5;  // rel L2 of O, as a fraction of the emulator's own error
constexpr double kExactScoresTightShare = 0.99;  // exact-score inputs: within the tight bound
constexpr double kLseAbs = 1e-5, kLseRel = 4e-6;

// Documents of 0, 1, 31, 33, 127, 129 tokens at unaligned offsets (626 tokens).
const std::vector<int64_t> kOddDocs = {5, 0, 1, 31, 33, 127, 129, 300};

struct FwdCase {
  std::string name;
  std::vector<int64_t> docs;
  int heads_q = 4, heads_kv = 4;
  bool causal = true;
  Recipe recipe = Recipe::kMxfp8;
  ScalePolicy policy = ScalePolicy::kToken;
  bool hadamard = false;
  InputKind inputs = InputKind::kNormal;
  uint64_t seed = 1;
};

std::ostream& operator<<(std::ostream& os, const FwdCase& c) {
  return os << c.name;
}

std::vector<int64_t> with(std::vector<int64_t> docs, std::initializer_list<int64_t> more) {
  docs.insert(docs.end(), more);
  return docs;
}

GpuAttentionOptions gpu_options(const FwdCase& c) {
  GpuAttentionOptions o;
  o.recipe = c.recipe;
  o.policy = c.policy;
  o.hadamard = c.hadamard;
  o.attention.causal = c.causal;
  return o;
}

EmulatorConfig emulator_config(const FwdCase& c) {
  EmulatorConfig e;
  e.recipe = c.recipe;
  e.policy = c.policy;
  e.hadamard = c.hadamard;
  e.attention.causal = c.causal;
  e.forward = kGpuForwardTiles;
  e.backward_pass = false;
  return e;
}

AttentionBatch make_batch(const FwdCase& c) {
  InputSpec spec;
  spec.kind = c.inputs;
  spec.seed = c.seed;
  return generate_batch(c.docs, c.heads_q, c.heads_kv, kDim, spec);
}

// Exact-score inputs: every (token, head) row of Q, K, V, dO is x_d 2^k with x_d uniform in
// {-2..2} and k uniform in {-2..1} per row. Under the token policy a row's codes are x_d 2^7 or
// x_d 2^8 (row maximum 2 or 1), so the score products are multiples of 2^14 (mxfp8) or of the
// rows' 2^(kq + kk) (BF16, mxfp8-qk16) and a sum of 128 of them has at most 10 significant bits:
// exact in any accumulator of 11 bits or more. V is exact in E4M3 too.
AttentionBatch exact_score_batch(const FwdCase& c) {
  AttentionBatch b = make_batch(c);
  std::mt19937_64 rng(c.seed * 7919 + 17);
  for (std::vector<uint16_t>* t : {&b.q, &b.k, &b.v, &b.dout})
    for (size_t row = 0; row < t->size() / kDim; ++row) {
      const int k = int(rng() % 4) - 2;
      for (int d = 0; d < kDim; ++d)
        (*t)[row * kDim + d] = bf16::encode(std::ldexp(float(int(rng() % 5) - 2), k));
    }
  return b;
}

// What the tolerances scale with, from the quantized operands in FP64 (header comment):
// w, u [T][Hq][D]; a [Hq][T] (A_i).
struct Yardstick {
  std::vector<double> w, u, a;
};

Yardstick yardstick(const AttentionBatch& b, const FwdCase& c) {
  QuantizeOptions qo;
  qo.policy = c.policy;
  qo.hadamard = c.hadamard;
  qo.transposed = false;
  AttentionInputs in = b.inputs();
  in.dout.data = nullptr;
  const QuantizedAttention qa = quantize_cpu(in, qo);
  const PackedLayout layout = b.layout();
  const int64_t T = b.tokens;
  const int hq = b.heads_q, group = b.heads_q / b.heads_kv, D = b.head_dim;
  const double scale = AttentionConfig{c.causal}.scale_for(D);
  const bool bf16_scores = c.recipe == Recipe::kMxfp8Qk16;  // unrotated BF16 Q, K (as emulated)
  Yardstick y;
  y.w.assign(size_t(T * hq * D), 0.0);
  y.u.assign(y.w.size(), 0.0);
  y.a.assign(size_t(T * hq), 0.0);

  auto head_task = [&](int h) {
    const int hk = h / group;
    std::vector<double> q(D), s, a;
    std::vector<int> ev;
    for (int doc = 0; doc < layout.num_docs; ++doc) {
      const int64_t begin = layout.doc_begin(doc);
      const int L = layout.doc_length(doc);
      // K and V of the document, as the products see them.
      std::vector<double> k(size_t(L) * D), v(size_t(L) * D);
      ev.assign(size_t(L), 0);
      for (int j = 0; j < L; ++j) {
        const int64_t t = begin + j;
        ev[size_t(j)] = qa.v.exponent(t, hk, 0);
        for (int d = 0; d < D; ++d) {
          k[size_t(j) * D + d] = bf16_scores
                                     ? bf16::decode(b.k[size_t((t * b.heads_kv + hk) * D + d)])
                                     : qa.k.value(t, hk, d);
          v[size_t(j) * D + d] = qa.v.value(t, hk, d);
        }
      }
      for (int i = 0; i < L; ++i) {
        const int64_t t = begin + i;
        for (int d = 0; d < D; ++d)
          q[size_t(d)] =
              bf16_scores ? bf16::decode(b.q[size_t((t * hq + h) * D + d)]) : qa.q.value(t, h, d);
        const int n = c.causal ? i + 1 : L;
        s.assign(size_t(n), 0.0);
        a.assign(size_t(n), 0.0);
        double m = -INFINITY, amax = 0;
        int R = INT32_MIN;
        for (int j = 0; j < n; ++j) {
          double dot = 0, mag = 0;
          for (int d = 0; d < D; ++d) {
            const double x = q[size_t(d)] * k[size_t(j) * D + d];
            dot += x;
            mag += std::fabs(x);
          }
          s[size_t(j)] = dot * scale * kLog2e;
          m = std::max(m, s[size_t(j)]);
          amax = std::max(amax, mag * scale * kLog2e);
          R = std::max(R, ev[size_t(j)]);
        }
        double l = 0;
        for (int j = 0; j < n; ++j) l += (s[size_t(j)] = std::exp2(s[size_t(j)] - m + 8));
        double* w = &y.w[size_t((t * hq + h) * D)];
        double* u = &y.u[size_t((t * hq + h) * D)];
        for (int j = 0; j < n; ++j) {
          // One subnormal step (2^-9) of P~_j moves O by 2^-9 |code_jd| 2^R / l, and
          // |code| = |v| 2^-ev.
          const double p = s[size_t(j)] / l, sub = std::ldexp(1.0, -9 + R - ev[size_t(j)]) / l;
          for (int d = 0; d < D; ++d) {
            const double x = std::fabs(v[size_t(j) * D + d]);
            w[d] += p * x;
            u[d] += sub * x;
          }
        }
        y.a[size_t(h * T + t)] = amax;
      }
    }
  };
  std::vector<std::thread> threads;
  for (int h = 0; h < hq; ++h) threads.emplace_back(head_task, h);
  for (std::thread& th : threads) th.join();
  return y;
}

double ulp_bf16(double x) {
  x = std::fabs(x);
  if (!(x >= 1.1754943508222875e-38)) return std::ldexp(1.0, -133);  // BF16's subnormal step
  return std::ldexp(1.0, std::ilogb(x) - 7);
}

std::string where(const AttentionBatch& b, int64_t t, int h) {
  const PackedLayout l = b.layout();
  int doc = 0;
  while (doc + 1 < l.num_docs && l.doc_begin(doc + 1) <= t) ++doc;
  while (l.doc_length(doc) == 0) ++doc;
  std::ostringstream os;
  os << "token " << t << " (document " << doc << " of " << l.doc_length(doc) << " tokens, row "
     << t - l.doc_begin(doc) << "), head " << h;
  return os.str();
}

// Runs the case on the GPU and the emulator and checks the bounds of the header comment;
// `exact_scores`: the tight bounds of exact-score inputs too.
void expect_matches_emulator(const AttentionBatch& b, const FwdCase& c, bool exact_scores) {
  const AttentionOutputs<float> gpu = forward_gpu_to_host(b, gpu_options(c));
  const AttentionOutputs<float> emu = emulate(b, emulator_config(c)).out;
  const AttentionOutputs<double> ref = reference_attention(b, AttentionConfig{c.causal}, false);
  const Yardstick y = yardstick(b, c);
  ASSERT_EQ(gpu.o.size(), emu.o.size());
  ASSERT_EQ(gpu.lse.size(), emu.lse.size());
  const int64_t T = b.tokens;
  const int hq = b.heads_q, D = b.head_dim;
  const int steps = c.recipe == Recipe::kMxfp8Qk16 ? D / 16 : D / 32;

  // Every token lies in a document: every O and LSE value must be finite.
  int64_t nonfinite = 0;
  std::string first_nonfinite;
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < hq; ++h) {
      bool bad = !std::isfinite(gpu.lse[size_t(h * T + t)]);
      for (int d = 0; d < D; ++d) bad |= !std::isfinite(gpu.o[size_t((t * hq + h) * D + d)]);
      if (bad && nonfinite++ == 0) first_nonfinite = where(b, t, h);
    }

  const Similarity emu_err = compare(emu.o, ref.o);
  const Similarity gpu_emu = compare(gpu.o, std::vector<double>(emu.o.begin(), emu.o.end()));
  const double ratio = emu_err.rel_l2 > 0 ? gpu_emu.rel_l2 / emu_err.rel_l2 : gpu_emu.rel_l2;

  double worst_o = 0, worst_lse = 0, max_dlse = 0, max_delta = 0;
  std::string worst_o_at, worst_lse_at;
  int64_t tight_fail = 0, bitwise_equal = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < hq; ++h) {
      const double delta =
          exact_scores ? 0.0 : steps * std::ldexp(y.a[size_t(h * T + t)], kScoreLossLog2);
      max_delta = std::max(max_delta, delta);
      const double grow = std::exp2(delta);
      const size_t li = size_t(h * T + t);
      const double dl = std::fabs(double(gpu.lse[li]) - emu.lse[li]);
      const double lse_bound = kLn2 * delta + kLseAbs + kLseRel * std::fabs(emu.lse[li]);
      max_dlse = std::max(max_dlse, dl);
      if (!(dl / lse_bound <= worst_lse)) {  // NaN included
        worst_lse = dl / lse_bound;
        std::ostringstream os;
        os << where(b, t, h) << ": gpu " << gpu.lse[li] << ", emulator " << emu.lse[li]
           << ", bound " << lse_bound;
        worst_lse_at = os.str();
      }
      for (int d = 0; d < D; ++d) {
        const size_t i = size_t((t * hq + h) * D + d);
        const double g = gpu.o[i], e = emu.o[i], diff = std::fabs(g - e);
        bitwise_equal += std::memcmp(&gpu.o[i], &emu.o[i], sizeof(float)) == 0;
        const double ulp = ulp_bf16(std::max(std::fabs(g), std::fabs(e)));
        const double loose =
            ulp + (std::ldexp(grow, -3) + 2 * (grow - 1) + std::ldexp(1.0, -10)) * y.w[i] + y.u[i];
        if (!(diff / loose <= worst_o)) {
          worst_o = diff / loose;
          std::ostringstream os;
          os << where(b, t, h) << ", dim " << d << ": gpu " << g << ", emulator " << e
             << ", |diff| " << diff << ", bound " << loose << " (W " << y.w[i] << ", U " << y.u[i]
             << ", delta " << delta << ")";
          worst_o_at = os.str();
        }
        tight_fail += !(diff <= ulp + std::ldexp(y.w[i], -10));
      }
    }
  const double n = double(gpu.o.size());
  const double tight_share = n > 0 ? 1.0 - double(tight_fail) / n : 1.0;

  std::ostringstream report;
  report << c.name << ": rel L2 O emulator-FP64 " << emu_err.rel_l2 << ", gpu-emulator "
         << gpu_emu.rel_l2 << " (ratio " << ratio << ", bound " << kRatioBound
         << "); O bitwise equal " << bitwise_equal / std::max(n, 1.0) << ", within the tight bound "
         << tight_share << "; worst |dO| / bound " << worst_o << "; max |dLSE| " << max_dlse
         << ", worst |dLSE| / bound " << worst_lse << "; max delta " << max_delta;
  std::cout << "[measured] " << report.str() << std::endl;
  ::testing::Test::RecordProperty("measured", report.str());

  EXPECT_EQ(nonfinite, 0) << "non-finite O or LSE, first at " << first_nonfinite;
  EXPECT_LE(ratio, kRatioBound) << report.str();
  EXPECT_LE(worst_o, 1.0) << "worst O element: " << worst_o_at << "\n" << report.str();
  EXPECT_LE(worst_lse, 1.0) << "worst LSE: " << worst_lse_at << "\n" << report.str();
  if (exact_scores) EXPECT_GE(tight_share, kExactScoresTightShare) << report.str();
}

class GpuAttentionFwdVsEmulator : public ::testing::TestWithParam<FwdCase> {};

TEST_P(GpuAttentionFwdVsEmulator, WithinTheAlgorithmsTolerance) {
  FLAMIA_REQUIRE_GPU();
  const FwdCase& c = GetParam();
  expect_matches_emulator(make_batch(c), c, false);
}

FwdCase fwd_case(std::string name, std::vector<int64_t> docs, int hq, int hkv, bool causal,
                 Recipe r, ScalePolicy p, bool hadamard, InputKind inputs, uint64_t seed) {
  return {std::move(name), std::move(docs), hq, hkv, causal, r, p, hadamard, inputs, seed};
}

constexpr Recipe kMx = Recipe::kMxfp8, kQk16 = Recipe::kMxfp8Qk16;
constexpr ScalePolicy kToken = ScalePolicy::kToken, kBlock = ScalePolicy::kBlock32;
constexpr InputKind kNormal = InputKind::kNormal, kHeavy = InputKind::kHeavyTail;

INSTANTIATE_TEST_SUITE_P(
    Cases, GpuAttentionFwdVsEmulator,
    ::testing::Values(
        fwd_case("odd_docs_token", kOddDocs, 4, 4, true, kMx, kToken, false, kNormal, 1),
        fwd_case("odd_docs_gqa_non_causal", kOddDocs, 8, 2, false, kMx, kToken, false, kNormal, 2),
        fwd_case("odd_docs_block32_heavy", kOddDocs, 4, 4, true, kMx, kBlock, false, kHeavy, 3),
        fwd_case("long_doc_token_heavy", {2048}, 4, 4, true, kMx, kToken, false, kHeavy, 4),
        fwd_case("long_doc_block32", {2048}, 4, 4, true, kMx, kBlock, false, kNormal, 5),
        fwd_case("several_docs_gqa_hadamard_heavy", {700, 1, 900, 257, 190}, 8, 2, true, kMx,
                 kToken, true, kHeavy, 6),
        fwd_case("several_docs_tensor_outliers", {400, 1000, 77}, 4, 4, true, kMx,
                 ScalePolicy::kTensor, false, InputKind::kOutlierChannels, 7),
        fwd_case("odd_docs_floor_non_causal", kOddDocs, 4, 2, false, kMx, ScalePolicy::kFloor,
                 false, kNormal, 8),
        fwd_case("qk16_odd_docs_long_heavy", with(kOddDocs, {1024}), 4, 4, true, kQk16, kToken,
                 false, kHeavy, 9),
        fwd_case("qk16_odd_docs_gqa_non_causal", kOddDocs, 8, 2, false, kQk16, kToken, false,
                 kNormal, 10),
        fwd_case("qk16_block32_several_docs", {513, 3, 1200}, 4, 4, true, kQk16, kBlock, false,
                 kNormal, 11)),
    [](const ::testing::TestParamInfo<FwdCase>& info) { return info.param.name; });

class GpuAttentionFwdExactScores : public ::testing::TestWithParam<FwdCase> {};

TEST_P(GpuAttentionFwdExactScores, MatchesTheEmulatorClosely) {
  FLAMIA_REQUIRE_GPU();
  const FwdCase& c = GetParam();
  expect_matches_emulator(exact_score_batch(c), c, true);
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuAttentionFwdExactScores,
                         ::testing::Values(fwd_case("mxfp8_causal", with(kOddDocs, {1024}), 4, 4,
                                                    true, kMx, kToken, false, kNormal, 21),
                                           fwd_case("mxfp8_gqa_non_causal", kOddDocs, 8, 2, false,
                                                    kMx, kToken, false, kNormal, 22),
                                           fwd_case("qk16_causal", with(kOddDocs, {1024}), 4, 4,
                                                    true, kQk16, kToken, false, kNormal, 23),
                                           fwd_case("qk16_gqa_non_causal", kOddDocs, 8, 2, false,
                                                    kQk16, kToken, false, kNormal, 24)),
                         [](const ::testing::TestParamInfo<FwdCase>& info) {
                           return info.param.name;
                         });

// ---------------------------------------------------------------------------------------------
// Device-buffer tests: GpuAttention directly.

constexpr uint16_t kPoisonO = 0xFFFF;         // a BF16 NaN
constexpr uint32_t kPoisonLse = 0x7FC0DEADu;  // a float NaN with a payload
constexpr int64_t kPadHead = 64;              // elements between heads of a strided O (128 B)
constexpr int64_t kPadToken = 72;             // ... after each token row (144 B)
constexpr int64_t kPadHeadPair = 2;           // strides aligned to BF16 pairs only
constexpr int64_t kPadTokenPair = 6;
constexpr int64_t kExtraTokens = 3;  // rows after the last token
constexpr int64_t kLseTail = 64;     // floats after [Hq][T]

float lse_poison() {
  float f;
  std::memcpy(&f, &kPoisonLse, sizeof f);
  return f;
}

// Host inputs uploaded with padded strides (token and head strides multiples of 16 bytes).
struct DeviceInputs {
  std::vector<DeviceBuffer> buffers;
  DeviceBuffer cu;
  DeviceAttentionInputs in;
};

DeviceInputs upload(const AttentionBatch& b, int64_t head_pad, int64_t token_pad) {
  DeviceInputs d;
  const PackedLayout l = b.layout();
  d.cu = DeviceBuffer::upload(b.cu_seqlens);
  d.in.layout = l;
  d.in.cu_seqlens = d.cu.get<int32_t>();
  auto put = [&](const std::vector<uint16_t>& src, int heads) {
    const int64_t sh = l.head_dim + head_pad, st = heads * sh + token_pad;
    std::vector<uint16_t> host(size_t(std::max<int64_t>(l.tokens, 1) * st), 0x7FC0);  // NaN gaps
    for (int64_t t = 0; t < l.tokens; ++t)
      for (int h = 0; h < heads; ++h)
        std::copy_n(&src[size_t((t * heads + h) * l.head_dim)], l.head_dim,
                    &host[size_t(t * st + h * sh)]);
    d.buffers.push_back(DeviceBuffer::upload(host));
    return TokenTensor<const uint16_t>{d.buffers.back().get<const uint16_t>(), st, sh};
  };
  d.buffers.reserve(3);
  d.in.q = put(b.q, l.heads_q);
  d.in.k = put(b.k, l.heads_kv);
  d.in.v = put(b.v, l.heads_kv);
  return d;
}

// A poisoned strided O and LSE on the device.
struct DeviceOutputs {
  DeviceBuffer o, lse;
  DeviceAttentionOutputs out;
  int64_t stride_token = 0, stride_head = 0, tokens = 0;
  int heads = 0, dim = 0;

  DeviceOutputs(const PackedLayout& l, int64_t head_pad, int64_t token_pad)
      : tokens(l.tokens), heads(l.heads_q), dim(l.head_dim) {
    stride_head = l.head_dim + head_pad;
    stride_token = l.heads_q * stride_head + token_pad;
    o = DeviceBuffer::upload(
        std::vector<uint16_t>(size_t((l.tokens + kExtraTokens) * stride_token), kPoisonO));
    lse = DeviceBuffer::upload(
        std::vector<float>(size_t(l.heads_q * l.tokens + kLseTail), lse_poison()));
    out.o = {o.get<uint16_t>(), stride_token, stride_head};
    out.lse = lse.get<float>();
    // The poison lands before a kernel on any stream runs: a cudaMemcpy from pageable memory may
    // still be in flight when it returns, in the legacy stream a non-blocking stream ignores.
    FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
  }
};

// Downloads a DeviceOutputs, checks the poison outside [T][Hq][D] and [Hq][T] is intact and every
// value inside is finite, and returns the values densely (O as BF16 bits).
struct DenseOutputs {
  std::vector<uint16_t> o;
  std::vector<float> lse;
};

DenseOutputs check_and_gather(const DeviceOutputs& d, const std::string& what) {
  FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> o = d.o.download<uint16_t>();
  const std::vector<float> lse = d.lse.download<float>();
  DenseOutputs r;
  r.o.resize(size_t(d.tokens * d.heads * d.dim));
  r.lse.assign(lse.begin(), lse.begin() + d.heads * d.tokens);
  int64_t touched = 0, nonfinite = 0;
  std::string first_touched, first_nonfinite;
  for (int64_t t = 0; t < d.tokens + kExtraTokens; ++t)
    for (int64_t e = 0; e < d.stride_token; ++e) {
      const int64_t h = e / d.stride_head, k = e % d.stride_head;
      const bool inside = t < d.tokens && h < d.heads && k < d.dim;
      const uint16_t bits = o[size_t(t * d.stride_token + e)];
      if (inside) {
        r.o[size_t((t * d.heads + h) * d.dim + k)] = bits;
        if (!std::isfinite(bf16::decode(bits)) && nonfinite++ == 0)
          first_nonfinite = "O token " + std::to_string(t) + " head " + std::to_string(h) +
                            " dim " + std::to_string(k);
      } else if (bits != kPoisonO && touched++ == 0) {
        first_touched = "O padding at token " + std::to_string(t) + ", element " +
                        std::to_string(e) + " of the token row";
      }
    }
  for (size_t i = 0; i < lse.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &lse[i], sizeof bits);
    if (i < r.lse.size()) {
      if (!std::isfinite(lse[i]) && nonfinite++ == 0)
        first_nonfinite = "LSE head " + std::to_string(int64_t(i) / d.tokens) + " token " +
                          std::to_string(int64_t(i) % d.tokens);
    } else if (bits != kPoisonLse && touched++ == 0) {
      first_touched = "LSE past [Hq][T] at " + std::to_string(i);
    }
  }
  EXPECT_EQ(touched, 0) << what << ": wrote outside the outputs, first: " << first_touched;
  EXPECT_EQ(nonfinite, 0) << what
                          << ": non-finite output inside documents, first: " << first_nonfinite;
  return r;
}

std::vector<uint16_t> bits_of(const std::vector<float>& o) {
  std::vector<uint16_t> r(o.size());
  for (size_t i = 0; i < o.size(); ++i) r[i] = bf16::encode(o[i]);  // exact: BF16 values
  return r;
}

size_t first_mismatch(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (a[i] != b[i]) return i;
  return a.size() == b.size() ? size_t(-1) : std::min(a.size(), b.size());
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class GpuAttentionFwdOutputs : public ::testing::TestWithParam<Recipe> {};

// Strided inputs, a strided O with padding between heads and after each token row and extra rows
// after the last token, O poisoned with BF16 NaNs and LSE with a NaN sentinel: the kernel writes
// exactly [T][Hq][D] and [Hq][T], all finite, bitwise equal to the dense forward_gpu_to_host; the
// quantized-operand entry point gives the same bits; repeated calls are deterministic.
TEST_P(GpuAttentionFwdOutputs, PoisonStridesEntryPointsAndDeterminism) {
  FLAMIA_REQUIRE_GPU();
  FwdCase c;
  c.name = "poison";
  c.docs = kOddDocs;
  c.heads_q = 4;
  c.heads_kv = 2;
  c.recipe = GetParam();
  c.seed = 31;
  const AttentionBatch batch = make_batch(c);
  const PackedLayout layout = batch.layout();
  const GpuAttentionOptions options = gpu_options(c);
  const std::vector<uint16_t> dense = bits_of(forward_gpu_to_host(batch, options).o);
  const std::vector<float> dense_lse = forward_gpu_to_host(batch, options).lse;

  cudaStream_t stream;
  FLAMIA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const DeviceInputs in = upload(batch, 16, 32);
  // Uploaded in the legacy stream, which the non-blocking one does not wait for.
  FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
  GpuAttention attention(layout, options);
  std::cout << "[measured] " << attention.work_items() << " work items, " << attention.ctas()
            << " CTAs" << std::endl;

  // The BF16 entry, twice: O with 16-byte aligned strides, then with strides aligned to BF16 pairs
  // only; poison intact, equal to the dense run, deterministic.
  struct Pads {
    int64_t head, token;
  };
  for (const Pads pads : {Pads{kPadHead, kPadToken}, Pads{kPadHeadPair, kPadTokenPair}}) {
    const DeviceOutputs out(layout, pads.head, pads.token);
    attention.forward(in.in, out.out, stream);
    FLAMIA_CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_FALSE(attention.quantizer_status().any());
    const DenseOutputs got =
        check_and_gather(out, "BF16 entry, O head pad " + std::to_string(pads.head));
    const size_t at = first_mismatch(got.o, dense);
    EXPECT_EQ(at, size_t(-1)) << "strided O differs from the dense run at flat index " << at;
    EXPECT_TRUE(same_bits(got.lse, dense_lse)) << "LSE differs from the dense run";
  }

  // The quantized-operand entry on the quantizer's own outputs: the same bits.
  QuantizeOptions qo;
  qo.policy = c.policy;
  qo.hadamard = c.hadamard;
  qo.transposed = true;
  const cuda::QuantizeOutputs quant(layout, qo, /*backward=*/false);
  quantize_gpu(in.in, qo, quant.view(), stream);
  const DeviceOutputs out(layout, kPadHead, kPadToken);
  attention.forward(in.in, quant.view(), out.out, stream);
  FLAMIA_CUDA_CHECK(cudaStreamSynchronize(stream));
  const DenseOutputs got = check_and_gather(out, "quantized entry");
  const size_t at = first_mismatch(got.o, dense);
  EXPECT_EQ(at, size_t(-1)) << "quantized-operand entry differs from the BF16 entry at " << at;
  EXPECT_TRUE(same_bits(got.lse, dense_lse)) << "LSE of the quantized-operand entry differs";
  FLAMIA_CUDA_CHECK(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(Recipes, GpuAttentionFwdOutputs, ::testing::Values(kMx, kQk16),
                         [](const ::testing::TestParamInfo<Recipe>& info) {
                           return info.param == kMx ? "mxfp8" : "mxfp8_qk16";
                         });

// One head: O's head stride is free (0 here, as a [T][D] view may have it), and mxfp8's TMA stores
// of O (whole warps' rows and single rows where a document ends) give the dense run's bits.
TEST(GpuAttentionFwd, SingleHeadOWithZeroHeadStride) {
  FLAMIA_REQUIRE_GPU();
  FwdCase c;
  c.docs = kOddDocs;
  c.heads_q = c.heads_kv = 1;
  c.seed = 37;
  const AttentionBatch batch = make_batch(c);
  const PackedLayout layout = batch.layout();
  const AttentionOutputs<float> dense = forward_gpu_to_host(batch, gpu_options(c));
  const DeviceInputs in = upload(batch, 0, 0);
  const int64_t stride_token = kDim + kPadHead;
  DeviceBuffer o = DeviceBuffer::upload(
      std::vector<uint16_t>(size_t((layout.tokens + kExtraTokens) * stride_token), kPoisonO));
  DeviceBuffer lse = DeviceBuffer::upload(std::vector<float>(size_t(layout.tokens), 0.0f));
  FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
  DeviceAttentionOutputs out;
  out.o = {o.get<uint16_t>(), stride_token, /*stride_head=*/0};
  out.lse = lse.get<float>();
  GpuAttention attention(layout, gpu_options(c));
  attention.forward(in.in, out, nullptr);
  FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> got = o.download<uint16_t>();
  const std::vector<uint16_t> want = bits_of(dense.o);
  int64_t wrong = 0, touched = 0;
  for (int64_t t = 0; t < layout.tokens + kExtraTokens; ++t)
    for (int64_t e = 0; e < stride_token; ++e) {
      const uint16_t bits = got[size_t(t * stride_token + e)];
      if (t < layout.tokens && e < kDim)
        wrong += bits != want[size_t(t * kDim + e)];
      else
        touched += bits != kPoisonO;
    }
  EXPECT_EQ(wrong, 0) << "O elements differing from the dense run";
  EXPECT_EQ(touched, 0) << "O elements written outside [T][D]";
  EXPECT_TRUE(same_bits(lse.download<float>(), dense.lse)) << "LSE differs from the dense run";
}

// A NaN and an Inf in one document: the quantizer reports them and zeroes them, so every output
// stays finite and the other documents are bitwise unchanged; forward_gpu_to_host throws, naming
// the tensor and the position.
TEST(GpuAttentionFwd, NonFiniteInputsStayInTheirDocument) {
  FLAMIA_REQUIRE_GPU();
  FwdCase c;
  c.docs = kOddDocs;
  c.heads_q = 4;
  c.heads_kv = 2;
  const AttentionBatch clean = make_batch(c);
  const PackedLayout layout = clean.layout();
  const int doc = 6;  // 129 tokens at offset 197
  const int64_t t0 = layout.doc_begin(doc) + 40;
  AttentionBatch dirty = clean;
  dirty.k[size_t((t0 * 2 + 1) * kDim + 7)] = 0x7FC0;          // NaN in K
  dirty.v[size_t(((t0 + 50) * 2) * kDim + 3)] = 0xFF80;       // -Inf in V
  dirty.q[size_t(((t0 + 5) * 4 + 2) * kDim + 100)] = 0x7F80;  // +Inf in Q

  try {
    forward_gpu_to_host(dirty, gpu_options(c));
    ADD_FAILURE() << "forward_gpu_to_host accepted non-finite inputs";
  } catch (const Error& e) {
    const std::string m = e.what();
    std::cout << "[message] " << m << std::endl;
    EXPECT_NE(m.find("non-finite"), std::string::npos) << m;
    EXPECT_NE(m.find("token"), std::string::npos) << m;
  }

  GpuAttention attention(layout, gpu_options(c));
  DenseOutputs runs[2];
  for (int k = 0; k < 2; ++k) {
    const DeviceInputs in = upload(k ? dirty : clean, 0, 0);
    const DeviceOutputs out(layout, 0, 0);
    attention.forward(in.in, out.out, nullptr);
    EXPECT_EQ(attention.quantizer_status().any(), k == 1);
    runs[k] = check_and_gather(out, k ? "non-finite inputs" : "clean inputs");
  }
  const int64_t T = layout.tokens, begin = layout.doc_begin(doc),
                end = begin + layout.doc_length(doc);
  int64_t changed_outside = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (t >= begin && t < end) continue;
    for (int h = 0; h < layout.heads_q; ++h) {
      changed_outside += std::memcmp(&runs[0].lse[size_t(h * T + t)],
                                     &runs[1].lse[size_t(h * T + t)], sizeof(float)) != 0;
      for (int d = 0; d < kDim; ++d) {
        const size_t i = size_t((t * layout.heads_q + h) * kDim + d);
        changed_outside += runs[0].o[i] != runs[1].o[i];
      }
    }
  }
  EXPECT_EQ(changed_outside, 0) << "non-finite inputs of document " << doc
                                << " changed outputs of other documents";
}

// Collects the message of the Error `f` throws; fails when it throws nothing or no Error.
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-flamia exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

std::string lower(std::string s) {
  for (char& ch : s) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

// Expects `f` to throw an Error whose message contains each of `words` (case-insensitive).
void expect_error(const std::string& what, const std::function<void()>& f,
                  std::initializer_list<const char*> words) {
  const std::string m = error_of(f);
  std::cout << "[message] " << what << ": " << m << std::endl;
  for (const char* w : words)
    EXPECT_NE(lower(m).find(lower(w)), std::string::npos)
        << what << ": the message should name '" << w << "': " << m;
}

TEST(GpuAttentionFwd, RejectsWhatItDoesNotImplement) {
  FLAMIA_REQUIRE_GPU();
  const AttentionBatch b = generate_batch({33, 100}, 4, 2, kDim, InputSpec{});
  const PackedLayout layout = b.layout();
  auto options = [](Recipe r, ScalePolicy p) {
    GpuAttentionOptions o;
    o.recipe = r;
    o.policy = p;
    return o;
  };
  for (const auto& [r, p, word] : {std::make_tuple(Recipe::kBf16, kToken, "bf16"),
                                   std::make_tuple(Recipe::kNvfp4Mixed, kToken, "nvfp4"),
                                   std::make_tuple(kMx, ScalePolicy::kVGroup16, "vgroup16"),
                                   std::make_tuple(kQk16, ScalePolicy::kVGroup16, "vgroup16")}) {
    const GpuAttentionOptions o = options(r, p);
    expect_error(std::string("check_gpu_support ") + word, [&] { check_gpu_support(layout, o); },
                 {word});
    expect_error(std::string("GpuAttention ") + word, [&] { GpuAttention a(layout, o); }, {word});
    expect_error(std::string("forward_gpu_to_host ") + word, [&] { forward_gpu_to_host(b, o); },
                 {word});
  }
  for (Recipe r : {kMx, kQk16}) EXPECT_NO_THROW(check_gpu_support(layout, options(r, kBlock)));

  // Head dim 64: rejected with a message naming it, or, if the kernels implement it, correct.
  FwdCase c64 =
      fwd_case("dim64", {5, 0, 1, 31, 33, 200}, 4, 2, true, kMx, kToken, false, kNormal, 41);
  InputSpec spec64;
  spec64.seed = c64.seed;
  const AttentionBatch b64 = generate_batch(c64.docs, 4, 2, 64, spec64);
  bool dim64 = true;
  try {
    check_gpu_support(b64.layout(), gpu_options(c64));
  } catch (const Error& e) {
    dim64 = false;
    std::cout << "[message] head dim 64: " << e.what() << std::endl;
    EXPECT_NE(std::string(e.what()).find("64"), std::string::npos) << e.what();
  }
  if (dim64) expect_matches_emulator(b64, c64, false);
}

TEST(GpuAttentionFwd, RejectsBadArgumentsBeforeEnqueuing) {
  FLAMIA_REQUIRE_GPU();
  const AttentionBatch b = generate_batch({33, 100}, 4, 2, kDim, InputSpec{});
  const PackedLayout layout = b.layout();
  for (Recipe r : {kMx, kQk16}) {
    GpuAttentionOptions o;
    o.recipe = r;
    GpuAttention attention(layout, o);
    const DeviceInputs in = upload(b, 0, 0);
    const DeviceOutputs out(layout, 0, 0);
    const std::string tag = std::string(to_string(r)) + ": ";
    auto bf16_call = [&](const DeviceAttentionInputs& x, const DeviceAttentionOutputs& y) {
      return [&attention, x, y] { attention.forward(x, y, nullptr); };
    };

    DeviceAttentionOutputs y = out.out;
    y.o.data = nullptr;
    expect_error(tag + "null O", bf16_call(in.in, y), {"O", "null"});
    y = out.out;
    y.o.data = out.o.get<uint16_t>() + 1;  // 2-byte aligned
    expect_error(tag + "misaligned O", bf16_call(in.in, y), {"O", "align"});
    y = out.out;
    y.o.stride_token += 1;  // odd stride
    expect_error(tag + "odd O stride", bf16_call(in.in, y), {"O", "stride"});
    y = out.out;
    y.lse = nullptr;
    expect_error(tag + "null LSE", bf16_call(in.in, y), {"LSE", "null"});
    y = out.out;
    y.lse = reinterpret_cast<float*>(out.lse.get<char>() + 2);
    expect_error(tag + "misaligned LSE", bf16_call(in.in, y), {"LSE", "align"});

    DeviceAttentionInputs x = in.in;
    x.cu_seqlens = nullptr;
    expect_error(tag + "null device cu_seqlens", bf16_call(x, out.out), {"cu_seqlens", "null"});
    x = in.in;
    x.q.data = nullptr;
    expect_error(tag + "null Q", bf16_call(x, out.out), {"Q"});
    x = in.in;
    x.v.data = nullptr;  // the quantizer would skip it: the forward must refuse
    expect_error(tag + "null V", bf16_call(x, out.out), {"V", "null"});
    x = in.in;
    x.k.data = in.in.k.data + 1;
    expect_error(tag + "misaligned K", bf16_call(x, out.out), {"K"});

    // A layout other than the constructor's.
    const AttentionBatch other = generate_batch({34, 99}, 4, 2, kDim, InputSpec{});
    const DeviceInputs other_in = upload(other, 0, 0);
    expect_error(tag + "other layout", bf16_call(other_in.in, out.out), {"layout"});

    // The quantized-operand entry: V^T codes are always read.
    QuantizeOptions qo;
    const cuda::QuantizeOutputs quant(layout, qo, false);
    DeviceQuantizedAttention qv = quant.view();
    qv.v.codes_t = nullptr;
    expect_error(tag + "null V codes_t", [&] { attention.forward(in.in, qv, out.out, nullptr); },
                 {"V", "null"});
    qv = quant.view();
    qv.v.codes_t += 1;
    expect_error(tag + "misaligned V codes_t",
                 [&] { attention.forward(in.in, qv, out.out, nullptr); }, {"V", "align"});
    // And the tile codes of the visible tiles: V's always, K's for mxfp8's score product.
    qv = quant.view();
    qv.v.codes_t_tiles = nullptr;
    expect_error(tag + "null V codes_t_tiles",
                 [&] { attention.forward(in.in, qv, out.out, nullptr); },
                 {"codes_t_tiles", "null"});
    if (r == kMx) {
      qv = quant.view();
      qv.k.codes_tiles += 1;
      expect_error(tag + "misaligned K codes_tiles",
                   [&] { attention.forward(in.in, qv, out.out, nullptr); },
                   {"codes_tiles", "align"});
    }
    FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
    // Nothing was enqueued: the outputs still hold their poison.
    const std::vector<uint16_t> o_bits = out.o.download<uint16_t>();
    EXPECT_TRUE(std::all_of(o_bits.begin(), o_bits.end(), [](uint16_t v) { return v == kPoisonO; }))
        << tag << "a rejected call wrote O";
  }
}

// ---------------------------------------------------------------------------------------------
// The causality contract (DESIGN §5) on the GPU: O and LSE (dQ needs the backward, issue 7).

AttentionBatch probe_batch() {
  return generate_batch({300, 77, 650}, 4, 2, kDim, InputSpec{});
}

std::vector<ProbeOutcome> gpu_probe(ScalePolicy policy, Recipe recipe) {
  GpuAttentionOptions o;
  o.recipe = recipe;
  o.policy = policy;
  const std::vector<ProbeControl> controls(std::begin(kAllProbeControls),
                                           std::end(kAllProbeControls));
  return run_probe(probe_batch(), ProbeConfig{}, controls,
                   [&](const AttentionBatch& b) { return forward_gpu_to_host(b, o); });
}

void print(const std::string& what, const std::vector<ProbeOutcome>& outcomes) {
  for (const ProbeOutcome& o : outcomes)
    std::cout << "[measured] probe " << what << " " << to_string(o.control) << ": O " << o.o_change
              << (o.o_exact ? " (exact)" : "") << ", LSE " << o.lse_change
              << (o.lse_exact ? " (exact)" : "") << ", reach " << o.leak_reach << std::endl;
}

TEST(GpuAttentionFwdProbe, TokenPolicyIsBitwiseIsolated) {
  FLAMIA_REQUIRE_GPU();
  for (Recipe r : {kMx, kQk16}) {
    const auto outcomes = gpu_probe(kToken, r);
    print(std::string("token ") + to_string(r), outcomes);
    EXPECT_EQ(outcomes.size(), std::size(kAllProbeControls));
    for (const ProbeOutcome& o : outcomes) {
      EXPECT_TRUE(o.o_exact) << to_string(r) << " " << to_string(o.control) << " changed O by "
                             << o.o_change;
      EXPECT_TRUE(o.lse_exact) << to_string(r) << " " << to_string(o.control) << " changed LSE by "
                               << o.lse_change;
      EXPECT_FALSE(o.dq_probed) << "the GPU forward returns no dQ";
      EXPECT_FALSE(o.dq_exact) << "an unprobed dQ must never read as exact";
    }
  }
}

TEST(GpuAttentionFwdProbe, Block32LeaksOnlyWithinItsResidue) {
  FLAMIA_REQUIRE_GPU();
  const auto outcomes = gpu_probe(kBlock, kMx);
  print("block32", outcomes);
  bool spike_leaks = false;
  for (const ProbeOutcome& o : outcomes) {
    if (o.control == ProbeControl::kSuffixSpike) spike_leaks = o.leaks();
    EXPECT_LE(o.leak_reach, kBlockTokens - 1) << to_string(o.control);
    if (!is_suffix_control(o.control)) EXPECT_FALSE(o.leaks()) << to_string(o.control);
  }
  EXPECT_TRUE(spike_leaks) << "block32's positive control should show its residue leak";
}

}  // namespace
}  // namespace flamia
