// The GPU backward and the training call (flamia/attention_gpu.h) against the CPU emulator run
// with the kernels' tiles (forward kGpuForwardTiles, backward kGpuBackwardTiles) and against FP64:
// packed documents of 0..1000 tokens at unaligned offsets, GQA, causal and not, both recipes,
// normal, heavy-tail and outlier-channel inputs, all-zero Q and K tokens, Hadamard-rotated Q and K
// (mxfp8); then strided gradients with poisoned gaps, the deterministic mode's reproducibility and
// prefix isolation, repeated calls on one object (the dQ accumulator's clear), and argument checks.
//
// Tolerance (derived; every test prints what it measured as "[measured]" lines):
//   rel L2(G_gpu - G_emu) <= 0.5 rel L2(G_emu - G_fp64)   for G in dQ, dK, dV
// The GPU computes the emulator's algorithm and differs from it only by ex2.approx (2 ulp), FP32
// summation orders, the tensor cores' ~14-bit accumulation of each k32 instruction, and through
// those the E4M3 roundings of P~, dS~ and the operand scales that land on the other side of a
// rounding midpoint. The emulator's own error against FP64 contains one full E4M3 rounding of
// every operand (Q, K, V, dO, P~, dS~): an error that perturbs only the few operands near a
// midpoint (a fraction f of them moves by one step, rms sqrt(12 f) of a full rounding's) stays
// well below half of it while f <= ~2%, as in the forward's test (test_gpu_attention_fwd.cu).
// Structural faults — a dropped or doubled tile, a wrong mask, head, fold or scale — give ratios
// of order 1 or more. Every gradient element must also be finite.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "bwd_params.h"
#include "check.h"
#include "device_buffer.h"
#include "flamia/attention_gpu.h"
#include "flamia/emulator.h"
#include "flamia/hadamard.h"
#include "flamia/inputs.h"
#include "flamia/metrics.h"
#include "flamia/reference.h"
#include "gpu_test.h"

namespace flamia {
namespace {

using cuda::DeviceBuffer;

constexpr int kDim = 128;
constexpr double kRatioBound = 0.5;  // rel L2 vs the emulator, as a fraction of its own error

// Documents of 0, 1, 31, 33, 127, 129 tokens at unaligned offsets.
const std::vector<int64_t> kOddDocs = {5, 0, 1, 31, 33, 127, 129, 300};

struct BwdCase {
  std::string name;
  std::vector<int64_t> docs;
  int heads_q = 4, heads_kv = 4;
  bool causal = true;
  Recipe recipe = Recipe::kMxfp8;
  ScalePolicy policy = ScalePolicy::kToken;
  InputKind inputs = InputKind::kNormal;
  uint64_t seed = 1;
  bool deterministic = false;  // the split backward
  bool hadamard = false;       // rotated Q and K: dQ and dK rotated back (mxfp8)
  // Every token t with t % zero_every == 3 gets an all-zero Q row, t % zero_every == 5 an
  // all-zero K row (all heads): the quantizer gives them the smallest exponent (2^-127).
  int zero_every = 0;
  // Every token t with t % tiny_every == 2 % tiny_every gets its Q row scaled by 2^tiny_log2 (all
  // heads), and every dO element is scaled by 2^dout_scale_log2.
  int tiny_every = 0;
  int tiny_log2 = 0;
  int dout_scale_log2 = 0;
};

BwdCase deterministic_case(BwdCase c) {
  c.name += "Deterministic";
  c.deterministic = true;
  return c;
}

std::ostream& operator<<(std::ostream& os, const BwdCase& c) {
  return os << c.name;
}

// Deterministic: the split backward; otherwise the fused kernel, whatever kAuto would take for the
// cases' short documents (BackwardRunsSplit tests that choice).
void set_deterministic(GpuAttentionOptions& o, bool deterministic) {
  o.deterministic = deterministic;
  o.backward_form = deterministic ? BackwardForm::kAuto : BackwardForm::kFused;
}

GpuAttentionOptions gpu_options(const BwdCase& c) {
  GpuAttentionOptions o;
  o.recipe = c.recipe;
  o.policy = c.policy;
  o.attention.causal = c.causal;
  set_deterministic(o, c.deterministic);
  o.hadamard = c.hadamard;
  return o;
}

// dQ, dK and dV of two runs equal bit for bit (`what`: whose they are, for the message).
void expect_gradients_bitwise_equal(const AttentionOutputs<float>& x,
                                    const AttentionOutputs<float>& y, const std::string& what) {
  struct Pair {
    const char* name;
    const std::vector<float>& a;
    const std::vector<float>& b;
  };
  for (const Pair& g : {Pair{"dQ", x.dq, y.dq}, Pair{"dK", x.dk, y.dk}, Pair{"dV", x.dv, y.dv}}) {
    ASSERT_EQ(g.a.size(), g.b.size()) << g.name;
    int64_t differ = 0;
    for (size_t i = 0; i < g.a.size(); ++i)
      differ += std::memcmp(&g.a[i], &g.b[i], sizeof(float)) != 0;
    EXPECT_EQ(differ, 0) << g.name << ": elements differing " << what;
  }
}

// The emulator with the kernels' tiles, on the case's numerics.
EmulatorConfig emulator_config(const BwdCase& c) {
  EmulatorConfig ec;
  ec.recipe = c.recipe;
  ec.policy = c.policy;
  ec.hadamard = c.hadamard;
  ec.attention.causal = c.causal;
  ec.forward = kGpuForwardTiles;
  ec.backward = kGpuBackwardTiles;
  return ec;
}

AttentionBatch make_batch(const BwdCase& c) {
  InputSpec spec;
  spec.kind = c.inputs;
  spec.seed = c.seed;
  AttentionBatch b = generate_batch(c.docs, c.heads_q, c.heads_kv, kDim, spec);
  if (c.zero_every > 0) {
    for (int64_t t = 0; t < b.tokens; ++t) {
      if (t % c.zero_every == 3)
        std::fill_n(b.q.begin() + t * b.heads_q * kDim, b.heads_q * kDim, uint16_t(0));
      if (t % c.zero_every == 5)
        std::fill_n(b.k.begin() + t * b.heads_kv * kDim, b.heads_kv * kDim, uint16_t(0));
    }
  }
  auto scale = [](uint16_t* x, int64_t n, int log2) {
    for (int64_t i = 0; i < n; ++i) x[i] = bf16::encode(std::ldexp(bf16::decode(x[i]), log2));
  };
  if (c.tiny_every > 0)
    for (int64_t t = 2 % c.tiny_every; t < b.tokens; t += c.tiny_every)
      scale(b.q.data() + t * b.heads_q * kDim, b.heads_q * kDim, c.tiny_log2);
  if (c.dout_scale_log2 != 0) scale(b.dout.data(), int64_t(b.dout.size()), c.dout_scale_log2);
  return b;
}

bool all_finite(const std::vector<float>& v) {
  for (float x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

class GpuAttentionBwd : public ::testing::TestWithParam<BwdCase> {};

TEST_P(GpuAttentionBwd, MatchesEmulatorWithinItsOwnError) {
  FLAMIA_REQUIRE_GPU();
  const BwdCase& c = GetParam();
  const AttentionBatch b = make_batch(c);
  const AttentionOutputs<float> gpu = training_gpu_to_host(b, gpu_options(c));
  const AttentionOutputs<float> emu = emulate(b, emulator_config(c)).out;
  const AttentionOutputs<double> ref = reference_attention(b, AttentionConfig{c.causal});
  struct Grad {
    const char* name;
    const std::vector<float>& gpu;
    const std::vector<float>& emu;
    const std::vector<double>& ref;
  };
  for (const Grad& g : {Grad{"dQ", gpu.dq, emu.dq, ref.dq}, Grad{"dK", gpu.dk, emu.dk, ref.dk},
                        Grad{"dV", gpu.dv, emu.dv, ref.dv}}) {
    ASSERT_EQ(g.gpu.size(), g.emu.size()) << g.name;
    EXPECT_TRUE(all_finite(g.gpu)) << g.name << " has non-finite elements";
    const Similarity own = compare(g.emu, g.ref);
    const Similarity diff = compare(g.gpu, std::vector<double>(g.emu.begin(), g.emu.end()));
    const Similarity gpu_ref = compare(g.gpu, g.ref);
    const double ratio = diff.rel_l2 / own.rel_l2;
    std::cout << "[measured] " << c.name << " " << g.name << ": rel L2 gpu-emu " << diff.rel_l2
              << ", emu-fp64 " << own.rel_l2 << " (ratio " << ratio << "), cosine gpu-fp64 "
              << gpu_ref.cosine << ", emu-fp64 " << own.cosine << "\n";
    EXPECT_LE(ratio, kRatioBound) << g.name;
  }
}

// Query rows near the quantizer's smallest exponent beside large gradients (each query tile's dO
// reference exponent C about 23): 2^-e_q 2^(C - 8) is past float's range, so the kernels must
// apply the two factors of a row's units one at a time.
BwdCase tiny_queries_case() {
  constexpr int kTinyQueryLog2 = -112;  // scale exponent about -119
  constexpr int kLargeGradientLog2 = 30;
  BwdCase c{"TinyQueriesLargeGradients", kOddDocs};
  c.tiny_every = 5;
  c.tiny_log2 = kTinyQueryLog2;
  c.dout_scale_log2 = kLargeGradientLog2;
  return c;
}

std::vector<BwdCase> cases() {
  std::vector<BwdCase> v;
  v.push_back({"OddDocsCausal", kOddDocs});
  v.push_back({"OddDocsNonCausal", kOddDocs, 4, 4, false});
  v.push_back({"GqaCausal", kOddDocs, 4, 2});
  v.push_back({"LongDocBlock32", {1000, 77}, 2, 2, true, Recipe::kMxfp8, ScalePolicy::kBlock32});
  v.push_back({"HeavyTail",
               {600, 129},
               2,
               2,
               true,
               Recipe::kMxfp8,
               ScalePolicy::kToken,
               InputKind::kHeavyTail});
  v.push_back({"Qk16OddDocsCausal", kOddDocs, 4, 4, true, Recipe::kMxfp8Qk16});
  v.push_back({"Qk16GqaNonCausal", kOddDocs, 4, 1, false, Recipe::kMxfp8Qk16});
  // Rotated Q and K, where the rotation matters (outlier channels in K): a wrong butterfly in
  // dQ's or dK's rotation back mixes channels, an error of order 1.
  v.push_back({"HadamardOutliersGqa", kOddDocs, 4, 2, true, Recipe::kMxfp8, ScalePolicy::kToken,
               InputKind::kOutlierChannels, 3, false, true});
  v.push_back({"HadamardBlock32NonCausal",
               {1000, 77},
               2,
               2,
               false,
               Recipe::kMxfp8,
               ScalePolicy::kBlock32,
               InputKind::kNormal,
               4,
               false,
               true});
  // Every deterministic path (mxfp8 causal also in the tests below): the split backward (its dK/dV
  // pass and dQ pass) of both recipes, rotated or not.
  for (int i : {1, 5, 6, 7, 8}) v.push_back(deterministic_case(v[size_t(i)]));
  // All-zero query and key tokens: a query's gradient and its share of dV must not vanish with
  // its scale (its P and dS do not depend on it).
  BwdCase zeros{"ZeroTokensCausal", kOddDocs};
  zeros.zero_every = 7;
  v.push_back(zeros);
  zeros.name = "Qk16ZeroTokensCausal";
  zeros.recipe = Recipe::kMxfp8Qk16;
  v.push_back(zeros);
  v.push_back(tiny_queries_case());
  // Every query at the smallest scale exponent with nonzero codes (clamped there, unlike an
  // all-zero row's): its dK share must keep its own scale, as every row of a tile is that small.
  constexpr int kClampedQueryLog2 = -122;  // every row's scale exponent clamped at -127
  BwdCase smallest{"SmallestExponentQueries", kOddDocs};
  smallest.tiny_every = 1;
  smallest.tiny_log2 = kClampedQueryLog2;
  v.push_back(smallest);
  smallest.name = "Qk16SmallestExponentQueries";
  smallest.recipe = Recipe::kMxfp8Qk16;
  v.push_back(smallest);
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuAttentionBwd, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// Device-buffer runs of the training call on one layout.
struct TrainingRun {
  PackedLayout layout;
  DeviceBuffer cu, q, k, v, g, o, lse, dq, dk, dv;
  int64_t dq_stride = 0, kv_stride = 0;  // token strides of the gradients (elements)
};

// Gradients with token strides wider than dense, so every token row has a gap of `gap` elements:
// a multiple of 4 lets the postprocess store dQ four BF16 at a time and one of 8 the main kernel
// dK and dV 16 bytes at a time (bf16_rows.cuh); 2 leaves both to pairs.
TrainingRun strided_run(const AttentionBatch& b, int64_t gap = kDim) {
  TrainingRun r;
  r.layout = b.layout();
  const PackedLayout& pl = r.layout;
  r.cu = DeviceBuffer::upload(b.cu_seqlens);
  r.q = DeviceBuffer::upload(b.q);
  r.k = DeviceBuffer::upload(b.k);
  r.v = DeviceBuffer::upload(b.v);
  r.g = DeviceBuffer::upload(b.dout);
  r.o = DeviceBuffer(size_t(pl.tokens) * pl.heads_q * kDim * sizeof(uint16_t));
  r.lse = DeviceBuffer(size_t(pl.tokens) * pl.heads_q * sizeof(float));
  r.dq_stride = int64_t(pl.heads_q) * kDim + gap;
  r.kv_stride = int64_t(pl.heads_kv) * kDim + gap;
  r.dq = DeviceBuffer(size_t(pl.tokens) * r.dq_stride * sizeof(uint16_t));
  r.dk = DeviceBuffer(size_t(pl.tokens) * r.kv_stride * sizeof(uint16_t));
  r.dv = DeviceBuffer(size_t(pl.tokens) * r.kv_stride * sizeof(uint16_t));
  return r;
}

DeviceAttentionInputs run_inputs(const TrainingRun& r) {
  return dense_device_inputs(r.layout, r.cu.get<int32_t>(), r.q.get<uint16_t>(),
                             r.k.get<uint16_t>(), r.v.get<uint16_t>(), r.g.get<uint16_t>());
}

// The training call's backward alone (after a BF16 forward on `attention`).
void run_backward(GpuAttention& attention, TrainingRun& r) {
  const PackedLayout& pl = r.layout;
  const DeviceAttentionInputs in = run_inputs(r);
  DeviceAttentionGradients grads;
  grads.dq = {r.dq.get<uint16_t>(), r.dq_stride, kDim};
  grads.dk = {r.dk.get<uint16_t>(), r.kv_stride, kDim};
  grads.dv = {r.dv.get<uint16_t>(), r.kv_stride, kDim};
  attention.backward(in, dense_view<const uint16_t>(r.o.get<uint16_t>(), pl.heads_q, kDim),
                     r.lse.get<float>(), grads, nullptr);
  FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
}

void run_training(GpuAttention& attention, TrainingRun& r) {
  DeviceAttentionOutputs out;
  out.o = dense_view<uint16_t>(r.o.get<uint16_t>(), r.layout.heads_q, kDim);
  out.lse = r.lse.get<float>();
  attention.forward(run_inputs(r), out, nullptr);
  run_backward(attention, r);
}

constexpr uint8_t kPoison = 0xA5;

// The strided gradients equal the dense ones of training_gpu_to_host in deterministic mode, and
// the gap after every token row keeps the poison; with either store width of dQ (postprocess) and
// of dK and dV (main kernel, or with Hadamard rotation the pass that rotates dK back).
TEST(GpuAttentionBwdBuffers, StridedGradientsLeaveGapsUntouched) {
  FLAMIA_REQUIRE_GPU();
  BwdCase c{"strided", kOddDocs, 4, 2};
  const AttentionBatch b = make_batch(c);
  constexpr int64_t kWideGap = kDim, kPairGap = 2;
  for (const bool rotated : {false, true})
    for (const int64_t gap : {kWideGap, kPairGap}) {
      SCOPED_TRACE(std::string(rotated ? "rotated, " : "") + "gap " + std::to_string(gap));
      GpuAttentionOptions options = gpu_options(c);
      set_deterministic(options, true);
      options.hadamard = rotated;
      const AttentionOutputs<float> dense = training_gpu_to_host(b, options);
      TrainingRun r = strided_run(b, gap);
      for (DeviceBuffer* buf : {&r.dq, &r.dk, &r.dv})
        FLAMIA_CUDA_CHECK(cudaMemset(buf->get(), kPoison, buf->bytes()));
      GpuAttention attention(r.layout, options);
      run_training(attention, r);
      struct Out {
        const char* name;
        const DeviceBuffer& buf;
        int heads;
        int64_t stride;
        const std::vector<float>& dense;
      };
      const PackedLayout& pl = r.layout;
      for (const Out& o : {Out{"dQ", r.dq, pl.heads_q, r.dq_stride, dense.dq},
                           Out{"dK", r.dk, pl.heads_kv, r.kv_stride, dense.dk},
                           Out{"dV", r.dv, pl.heads_kv, r.kv_stride, dense.dv}}) {
        const std::vector<uint16_t> bits = o.buf.download<uint16_t>();
        int64_t gap_changed = 0, mismatched = 0;
        for (int64_t t = 0; t < pl.tokens; ++t)
          for (int64_t e = 0; e < o.stride; ++e) {
            const uint16_t x = bits[size_t(t * o.stride + e)];
            if (e >= int64_t(o.heads) * kDim) {
              gap_changed += x != uint16_t(kPoison | kPoison << 8);
            } else {
              const float want = o.dense[size_t(t * o.heads * kDim + e)];
              mismatched += !(bf16::decode(x) == want);
            }
          }
        EXPECT_EQ(gap_changed, 0) << o.name << ": the gaps between token rows were written";
        EXPECT_EQ(mismatched, 0) << o.name << ": strided gradients differ from the dense ones";
      }
    }
}

std::vector<uint16_t> download_dq(const TrainingRun& r) {
  return r.dq.download<uint16_t>();
}

// Deterministic mode: dQ is bitwise equal run to run, and a prefix's dQ (with its O and LSE) is
// bitwise unchanged when the document's later K, V and dO rows and the other document change,
// with Q and K Hadamard-rotated too (dQ's rotation back stays inside each row). Atomic mode: the
// run-to-run spread is reported.
TEST(GpuAttentionBwdBuffers, DeterministicDqIsReproducibleAndPrefixIsolated) {
  FLAMIA_REQUIRE_GPU();
  BwdCase c{"probe", {700, 300}, 2, 2};
  const AttentionBatch b = make_batch(c);
  constexpr int64_t kPrefix = 333;  // rows 0..kPrefix-1 of document 0 keep their dQ
  AttentionBatch changed = b;
  std::mt19937 rng(5);
  for (std::vector<uint16_t>* t : {&changed.k, &changed.v, &changed.dout}) {
    const int heads = t == &changed.dout ? b.heads_q : b.heads_kv;
    for (int64_t tok = kPrefix; tok < b.tokens; ++tok)
      for (int e = 0; e < heads * kDim; ++e)
        (*t)[size_t(tok * heads * kDim + e)] =
            bf16::encode(float(std::normal_distribution<double>(0.0, 3.0)(rng)));
  }
  struct Mode {
    bool deterministic, hadamard;
  };
  for (const Mode mode : {Mode{true, false}, Mode{true, true}, Mode{false, false}}) {
    const bool deterministic = mode.deterministic;
    GpuAttentionOptions options = gpu_options(c);
    set_deterministic(options, deterministic);
    options.hadamard = mode.hadamard;
    TrainingRun r = strided_run(b), r2 = strided_run(b), rc = strided_run(changed);
    GpuAttention a1(r.layout, options), a2(r.layout, options), ac(r.layout, options);
    run_training(a1, r);
    run_training(a2, r2);
    run_training(ac, rc);
    const std::vector<uint16_t> d1 = download_dq(r), d2 = download_dq(r2), dc = download_dq(rc);
    int64_t run_diff = 0, prefix_diff = 0;
    for (size_t i = 0; i < d1.size(); ++i) run_diff += d1[i] != d2[i];
    const size_t prefix_elems = size_t(kPrefix * r.dq_stride);
    for (size_t i = 0; i < prefix_elems; ++i) prefix_diff += d1[i] != dc[i];
    std::cout << "[measured] " << (deterministic ? "deterministic" : "atomic")
              << (mode.hadamard ? ", rotated" : "") << " dQ: elements differing run to run "
              << run_diff << " of " << d1.size() << "; prefix elements changed by the suffix "
              << prefix_diff << "\n";
    if (deterministic) {
      EXPECT_EQ(run_diff, 0);
      EXPECT_EQ(prefix_diff, 0);
    }
  }
}

// The statistics build (GpuAttentionOptions::diagnostics: `flamia accuracy`'s counters) is its own
// instantiation of the main kernel, and the fast kernels carry none of its code: in deterministic
// mode both give the same dQ, dK and dV bit for bit, so the statistics describe the gradients the
// fast path returns. The fast path is the split backward, whose dQ pass must reproduce the fused
// kernel's ordered dQ exactly (and, rotated, the postprocess's rotation back). Odd documents at
// unaligned offsets, GQA, both recipes, causal or not, rotated or not.
TEST(GpuAttentionBwdBuffers, FastKernelsMatchTheStatisticsBuildBitwise) {
  FLAMIA_REQUIRE_GPU();
  std::vector<BwdCase> cases = {
      BwdCase{"mxfp8", kOddDocs, 4, 2},
      BwdCase{"mxfp8-noncausal", kOddDocs, 4, 4, false},
      BwdCase{"qk16", kOddDocs, 4, 2, true, Recipe::kMxfp8Qk16},
      BwdCase{"qk16-noncausal", kOddDocs, 4, 4, false, Recipe::kMxfp8Qk16},
  };
  for (int i : {0, 1}) {
    cases.push_back(cases[size_t(i)]);
    cases.back().name += "-rotated";
    cases.back().hadamard = true;
  }
  for (BwdCase& c : cases) {
    SCOPED_TRACE(c.name);
    c.deterministic = true;
    const AttentionBatch b = make_batch(c);
    GpuAttentionOptions fast = gpu_options(c), statistics = gpu_options(c);
    statistics.diagnostics = true;
    const AttentionOutputs<float> x = training_gpu_to_host(b, fast);
    const AttentionOutputs<float> y = training_gpu_to_host(b, statistics);
    expect_gradients_bitwise_equal(x, y, "between the builds");
  }
}

// The statistics build's row residuals |sum_j dS_ij| / sum_j |dS_ij| (flamia accuracy's quantiles)
// lie in [0, 1] by the triangle inequality: also for query rows near the smallest exponent beside
// large gradients, whose dS the kernel holds scaled by 2^e_q 2^(8 - C) and scales back for the
// sums. One per row with a nonzero dS, as the emulator's, but for each document's first row: it
// sees one key, where dP - D is zero or a rounding residue, in either of them.
TEST(GpuAttentionBwdBuffers, StatisticsRowResidualsAreFiniteFractions) {
  FLAMIA_REQUIRE_GPU();
  for (const BwdCase& c : {BwdCase{"normal", kOddDocs}, tiny_queries_case()}) {
    SCOPED_TRACE(c.name);
    const AttentionBatch b = make_batch(c);
    const EmulatorStats emu = emulate(b, emulator_config(c)).stats;
    EmulatorStats gpu;
    training_gpu_to_host(b, gpu_options(c), &gpu);
    int64_t first_rows = 0;
    for (int64_t n : c.docs) first_rows += n > 0 ? b.heads_q : 0;
    const int64_t gpu_rows = int64_t(gpu.row_residual.size());
    const int64_t emu_rows = int64_t(emu.row_residual.size());
    EXPECT_LE(std::abs(gpu_rows - emu_rows), first_rows);
    int64_t outside = 0;
    for (double r : gpu.row_residual) outside += !(r >= 0.0 && r <= 1.0);
    EXPECT_EQ(outside, 0) << "residuals that are not finite fractions";
  }
}

// The rotation back of dK's FP32 rows (launch_rotate_dk; the dQ postprocess rotates its rows with
// the same code) gives hadamard_rotate's bits, then BF16's: rows of a wide dynamic range, outputs
// with gaps (poisoned) for both store widths. The attention tests above bound the rotated
// gradients only within the emulator's error, which a different stage or multiply order would
// pass.
TEST(GpuAttentionBwdBuffers, DkRotationIsHadamardRotateBitwise) {
  FLAMIA_REQUIRE_GPU();
  constexpr int64_t kTokens = 37;
  constexpr int kHeads = 3;
  constexpr int kExponentRange = 20;
  std::mt19937 rng(11);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_int_distribution<int> exponent(-kExponentRange, kExponentRange);
  std::vector<float> rows(size_t(kTokens * kHeads * kDim));
  for (float& x : rows) x = float(std::ldexp(normal(rng), exponent(rng)));
  const DeviceBuffer in = DeviceBuffer::upload(rows);
  constexpr int64_t kWideGap = kDim, kPairGap = 2;
  for (const int64_t gap : {kWideGap, kPairGap}) {
    SCOPED_TRACE("gap " + std::to_string(gap));
    const int64_t stride = kHeads * kDim + gap;
    DeviceBuffer out(size_t(kTokens * stride) * sizeof(uint16_t));
    FLAMIA_CUDA_CHECK(cudaMemset(out.get(), kPoison, out.bytes()));
    sm90::bwd::RotateDkParams p;
    p.dk_rotated = in.get<float>();
    p.dk = {out.get<uint16_t>(), stride, kDim, /*quad_stores=*/gap % 4 == 0};
    p.tokens = kTokens;
    p.heads_kv = kHeads;
    sm90::bwd::launch_rotate_dk(p, nullptr);
    FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> bits = out.download<uint16_t>();
    int64_t differing = 0, gap_changed = 0;
    for (int64_t t = 0; t < kTokens; ++t) {
      for (int h = 0; h < kHeads; ++h) {
        std::vector<float> want(rows.begin() + (t * kHeads + h) * kDim,
                                rows.begin() + (t * kHeads + h + 1) * kDim);
        hadamard_rotate(want.data(), kDim);
        for (int d = 0; d < kDim; ++d)
          differing += bits[size_t(t * stride + h * kDim + d)] != bf16::encode(want[size_t(d)]);
      }
      for (int64_t e = kHeads * kDim; e < stride; ++e)
        gap_changed += bits[size_t(t * stride + e)] != uint16_t(kPoison | kPoison << 8);
    }
    EXPECT_EQ(differing, 0) << "rotated elements whose BF16 bits differ from hadamard_rotate's";
    EXPECT_EQ(gap_changed, 0);
  }
}

// BackwardForm: kAuto splits where the layout's backward steps average at most the recipe's
// crossover per query tile (causal equal documents of L tokens: (L / 128 + 1) / 2; mxfp8 5.5,
// mxfp8-qk16 3.5), deterministic dQ and kSplit always split, kFused and the statistics build never;
// deterministic dQ with kFused is refused. Host only.
TEST(BackwardRunsSplit, ByStepsPerQueryTileAndForm) {
  auto layout_of = [](std::vector<int32_t>& cu, int64_t length, int docs) {
    cu.assign(size_t(docs) + 1, 0);
    for (int d = 1; d <= docs; ++d) cu[size_t(d)] = int32_t(d * length);
    return PackedLayout{cu.data(), docs, int64_t(docs) * length, 4, 2, kDim};
  };
  std::vector<int32_t> cu;
  GpuAttentionOptions mx, qk;
  qk.recipe = Recipe::kMxfp8Qk16;
  for (int64_t length : {128, 256, 512, 1024, 2048, 4096, 65536}) {
    SCOPED_TRACE("documents of " + std::to_string(length) + " tokens");
    const PackedLayout layout = layout_of(cu, length, int(65536 / length));
    EXPECT_EQ(backward_runs_split(layout, mx), length <= 1024);
    EXPECT_EQ(backward_runs_split(layout, qk), length <= 512);
    GpuAttentionOptions o = mx;
    o.backward_form = BackwardForm::kFused;
    EXPECT_FALSE(backward_runs_split(layout, o));
    o.backward_form = BackwardForm::kSplit;
    EXPECT_TRUE(backward_runs_split(layout, o));
    o.backward_form = BackwardForm::kAuto;
    o.deterministic = true;
    EXPECT_TRUE(backward_runs_split(layout, o));
    o.diagnostics = true;
    EXPECT_FALSE(backward_runs_split(layout, o));
  }
  // Not causal: every query tile sees all of its document's key blocks.
  GpuAttentionOptions full = mx;
  full.attention.causal = false;
  EXPECT_TRUE(backward_runs_split(layout_of(cu, 640, 10), full));   // 5 blocks a tile
  EXPECT_FALSE(backward_runs_split(layout_of(cu, 768, 10), full));  // 6
  EXPECT_FALSE(backward_runs_split(layout_of(cu, 0, 2), mx));       // no query tiles
  GpuAttentionOptions refused = mx;
  refused.deterministic = true;
  refused.backward_form = BackwardForm::kFused;
  const PackedLayout layout = layout_of(cu, 256, 4);
  test::expect_error([&] { check_gpu_support(layout, refused); }, "deterministic dQ needs");
  refused.diagnostics = true;  // the statistics build orders dQ itself
  check_gpu_support(layout, refused);
}

// On short documents kAuto runs the split backward, whose gradients are the deterministic mode's
// bit for bit; the fused kernel's dQ (atomics) is not asked to match.
TEST(GpuAttentionBwdForms, AutoRunsTheSplitOnShortDocuments) {
  FLAMIA_REQUIRE_GPU();
  for (Recipe recipe : {Recipe::kMxfp8, Recipe::kMxfp8Qk16}) {
    BwdCase c{"auto", kOddDocs, 4, 2};
    c.recipe = recipe;
    SCOPED_TRACE(to_string(recipe));
    const AttentionBatch b = make_batch(c);
    GpuAttentionOptions automatic = gpu_options(c);
    automatic.backward_form = BackwardForm::kAuto;
    ASSERT_TRUE(backward_runs_split(b.layout(), automatic));
    const AttentionOutputs<float> x = training_gpu_to_host(b, automatic);
    const AttentionOutputs<float> y = training_gpu_to_host(b, gpu_options(deterministic_case(c)));
    expect_gradients_bitwise_equal(x, y, "from the deterministic mode's");
  }
}

// From the second training call on one object, the forward kernel zeroes the backward's dQ
// accumulator and the preprocess skips its clear (dq_clear.cuh). Deterministic mode: every later
// call, and a backward run again without a forward (the preprocess clears again), gives the first
// call's dQ bitwise. Atomic mode: within the run-to-run spread (an uncleared accumulator doubles
// dQ).
TEST(GpuAttentionBwdBuffers, RepeatedCallsStartFromAClearedDq) {
  FLAMIA_REQUIRE_GPU();
  BwdCase c{"repeat", kOddDocs, 4, 2};
  const AttentionBatch b = make_batch(c);
  for (bool deterministic : {true, false}) {
    SCOPED_TRACE(deterministic ? "deterministic" : "atomic");
    GpuAttentionOptions options = gpu_options(c);
    set_deterministic(options, deterministic);
    TrainingRun r = strided_run(b);
    GpuAttention attention(r.layout, options);
    FLAMIA_CUDA_CHECK(cudaMemset(r.dq.get(), kPoison, r.dq.bytes()));  // the gaps match below
    run_training(attention, r);
    const std::vector<uint16_t> first = download_dq(r);
    float largest = 0.0f;
    for (uint16_t x : first) largest = std::max(largest, std::fabs(bf16::decode(x)));
    ASSERT_GT(largest, 0.0f);
    const float tolerance = deterministic ? 0.0f : largest / 64;
    for (int call = 0; call < 3; ++call) {
      SCOPED_TRACE(call < 2 ? "training call " + std::to_string(call + 2) : "backward alone");
      FLAMIA_CUDA_CHECK(cudaMemset(r.dq.get(), kPoison, r.dq.bytes()));
      if (call < 2) {
        run_training(attention, r);
      } else {
        run_backward(attention, r);
      }
      const std::vector<uint16_t> dq = download_dq(r);
      int64_t beyond = 0;
      for (size_t i = 0; i < dq.size(); ++i)
        beyond += !(std::fabs(bf16::decode(dq[i]) - bf16::decode(first[i])) <= tolerance);
      EXPECT_EQ(beyond, 0) << "dQ elements off the first call's by more than " << tolerance;
    }
  }
}

TEST(GpuAttentionBwdBuffers, RejectsBadArguments) {
  FLAMIA_REQUIRE_GPU();
  BwdCase c{"args", {40, 9}, 2, 2};
  const AttentionBatch b = make_batch(c);
  TrainingRun r = strided_run(b);
  GpuAttention attention(r.layout, gpu_options(c));
  const PackedLayout& pl = r.layout;
  const DeviceAttentionInputs in =
      dense_device_inputs(pl, r.cu.get<int32_t>(), r.q.get<uint16_t>(), r.k.get<uint16_t>(),
                          r.v.get<uint16_t>(), r.g.get<uint16_t>());
  const TokenTensor<const uint16_t> o =
      dense_view<const uint16_t>(r.o.get<uint16_t>(), pl.heads_q, kDim);
  DeviceAttentionGradients grads;
  grads.dq = {r.dq.get<uint16_t>(), r.dq_stride, kDim};
  grads.dk = {r.dk.get<uint16_t>(), r.kv_stride, kDim};
  grads.dv = {r.dv.get<uint16_t>(), r.kv_stride, kDim};
  test::expect_error([&] { attention.backward(in, o, r.lse.get<float>(), grads, nullptr); },
                     "BF16 forward");
  DeviceAttentionOutputs out;
  out.o = dense_view<uint16_t>(r.o.get<uint16_t>(), pl.heads_q, kDim);
  out.lse = r.lse.get<float>();
  attention.forward(in, out, nullptr);
  DeviceAttentionGradients bad = grads;
  bad.dk.data = nullptr;
  test::expect_error([&] { attention.backward(in, o, r.lse.get<float>(), bad, nullptr); }, "dK");
  bad = grads;
  bad.dq.stride_token += 1;
  test::expect_error([&] { attention.backward(in, o, r.lse.get<float>(), bad, nullptr); }, "dQ");
  DeviceAttentionInputs no_dout = in;
  no_dout.dout = {};
  test::expect_error([&] { attention.backward(no_dout, o, r.lse.get<float>(), grads, nullptr); },
                     "dO");
  test::expect_error([&] { attention.backward(in, o, nullptr, grads, nullptr); }, "LSE");
  // mxfp8-qk16's score product reads the unrotated BF16 inputs: no rotation there.
  GpuAttentionOptions rotated = gpu_options(c);
  rotated.recipe = Recipe::kMxfp8Qk16;
  rotated.hadamard = true;
  test::expect_error([&] { GpuAttention with_rotation(r.layout, rotated); }, "Hadamard");
  FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace flamia
