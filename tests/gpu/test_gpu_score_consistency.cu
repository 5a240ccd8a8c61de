// The score-consistency probe (score_consistency.h): the fraction of visible S entries whose
// backward recomputation differs bitwise from the forward's (DESIGN §4, §6), on the real operands
// of both recipes, causal and not, GQA, packed documents at unaligned offsets.
//
// The fraction itself is what is measured (printed as "[measured]", not asserted); what is asserted
// keeps the measurement honest: the probe compares exactly the visible entries (their count,
// computed on the host, so a skipped pair or head cannot pass), and it sees a difference when there
// is one (a single operand byte perturbed for the backward orientation alone must surface, and
// only in the perturbed query's row).
#include <cuda_runtime.h>

#include <cstdint>
#include <iostream>
#include <vector>

#include "check.h"
#include "device_buffer.h"
#include "flamia/formats.h"
#include "flamia/inputs.h"
#include "flamia/quantize_gpu.h"
#include "gpu_test.h"
#include "quantize_outputs.h"
#include "score_consistency.h"

namespace flamia {
namespace {

using cuda::DeviceBuffer;
using sm90::BackwardQueryOverride;
using sm90::score_consistency_gpu;
using sm90::ScoreConsistency;

constexpr int kDim = 128;
constexpr int kHeadsQ = 4, kHeadsKv = 2;
// Documents of 0, 1, 31, 33, 127, 129 tokens at unaligned offsets: partial query tiles and key
// blocks, and a 300-token document with several of each.
const std::vector<int64_t> kOddDocs = {5, 0, 1, 31, 33, 127, 129, 300};

// The batch on the device with the quantizer's codes (token scales) of Q and K.
struct DeviceBatch {
  AttentionBatch host;
  PackedLayout layout;
  DeviceBuffer cu, q, k;
  DeviceAttentionInputs in;
  cuda::QuantizeOutputs quant;

  static QuantizeOptions quantize_options() {
    QuantizeOptions o;
    o.transposed = false;  // the score product reads codes only
    return o;
  }

  explicit DeviceBatch(const std::vector<int64_t>& docs)
      : host(generate_batch(docs, kHeadsQ, kHeadsKv, kDim, InputSpec{})),
        layout(host.layout()),
        cu(DeviceBuffer::upload(host.cu_seqlens)),
        q(DeviceBuffer::upload(host.q)),
        k(DeviceBuffer::upload(host.k)),
        in(dense_device_inputs(layout, cu.get<int32_t>(), q.get<uint16_t>(), k.get<uint16_t>(),
                               nullptr)),
        quant(layout, quantize_options(), /*backward=*/false) {
    quantize_gpu(in, quantize_options(), quant.view(), nullptr);
    FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_FALSE(quant.non_finite().any());
  }

  ScoreConsistency probe(Recipe recipe, bool causal,
                         const BackwardQueryOverride* backward_q = nullptr) const {
    return score_consistency_gpu(layout, cu.get<int32_t>(), recipe, causal, in, quant.view(),
                                 nullptr, backward_q);
  }
};

// Visible (query, key) pairs of one head: inside a document, key <= query when causal.
int64_t visible_pairs(const PackedLayout& layout, bool causal) {
  int64_t n = 0;
  for (int doc = 0; doc < layout.num_docs; ++doc) {
    const int64_t length = layout.doc_length(doc);
    n += causal ? length * (length + 1) / 2 : length * length;
  }
  return n;
}

void expect_counts_every_visible_entry(Recipe recipe, bool causal) {
  const DeviceBatch b(kOddDocs);
  const ScoreConsistency r = b.probe(recipe, causal);
  EXPECT_EQ(r.entries, visible_pairs(b.layout, causal) * b.layout.heads_q);
  EXPECT_GE(r.differing, 0);
  EXPECT_LE(r.differing, r.entries);
  std::cout << "[measured] " << to_string(recipe) << (causal ? " causal" : " non-causal")
            << ": S entries differing bitwise between the forward and the backward recomputation: "
            << r.differing << " of " << r.entries << " (fraction "
            << double(r.differing) / double(r.entries) << ")" << std::endl;
}

TEST(GpuScoreConsistency, Mxfp8CausalComparesEveryVisibleEntry) {
  FLAMIA_REQUIRE_GPU();
  expect_counts_every_visible_entry(Recipe::kMxfp8, true);
}
TEST(GpuScoreConsistency, Mxfp8NonCausalComparesEveryVisibleEntry) {
  FLAMIA_REQUIRE_GPU();
  expect_counts_every_visible_entry(Recipe::kMxfp8, false);
}
TEST(GpuScoreConsistency, Qk16CausalComparesEveryVisibleEntry) {
  FLAMIA_REQUIRE_GPU();
  expect_counts_every_visible_entry(Recipe::kMxfp8Qk16, true);
}
TEST(GpuScoreConsistency, Qk16NonCausalComparesEveryVisibleEntry) {
  FLAMIA_REQUIRE_GPU();
  expect_counts_every_visible_entry(Recipe::kMxfp8Qk16, false);
}

// The perturbed element: the last query of the last (300-token) document, which sees every key of
// it, causal or not; query head 0, one channel.
const int kPerturbedDoc = int(kOddDocs.size()) - 1;
constexpr int kPerturbedHead = 0;
constexpr int kPerturbedChannel = 3;

// A copy of Q (E4M3 codes or BF16 inputs, [T][Hq][D]) with the perturbed element replaced by
// another value (1 or 2, whichever differs), uploaded for the backward orientation alone.
template <typename Element>
DeviceBuffer perturbed_copy(std::vector<Element> q, const PackedLayout& layout, Element one,
                            Element two) {
  const int64_t token = layout.doc_begin(kPerturbedDoc) + layout.doc_length(kPerturbedDoc) - 1;
  Element& e = q[size_t((token * layout.heads_q + kPerturbedHead) * kDim + kPerturbedChannel)];
  e = e == one ? two : one;
  return DeviceBuffer::upload(q);
}

// Only the perturbed query's row of one head can change: differing grows, by at most the keys that
// row sees, and the entries compared stay the same.
void expect_perturbation_seen(Recipe recipe, bool causal) {
  const DeviceBatch b(kOddDocs);
  DeviceBuffer q;
  BackwardQueryOverride backward_q;
  if (recipe == Recipe::kMxfp8) {
    q = perturbed_copy(b.quant.download().q.codes, b.layout, e4m3::encode(1.0f),
                       e4m3::encode(2.0f));
    backward_q.codes = q.get<uint8_t>();
  } else {
    q = perturbed_copy(b.host.q, b.layout, bf16::encode(1.0f), bf16::encode(2.0f));
    backward_q.bf16 = dense_view(q.get<const uint16_t>(), b.layout.heads_q, kDim);
  }
  const ScoreConsistency clean = b.probe(recipe, causal);
  const ScoreConsistency faulty = b.probe(recipe, causal, &backward_q);
  const int64_t row_keys = b.layout.doc_length(kPerturbedDoc);
  EXPECT_EQ(faulty.entries, clean.entries);
  EXPECT_GT(faulty.differing, clean.differing) << "the perturbed operand went unnoticed";
  EXPECT_LE(faulty.differing, clean.differing + row_keys)
      << "differences outside the perturbed row";
  std::cout << "[measured] " << to_string(recipe) << (causal ? " causal" : " non-causal")
            << ", one Q element perturbed for the backward orientation: " << faulty.differing
            << " differing entries (unperturbed " << clean.differing << ", the row sees "
            << row_keys << " keys)" << std::endl;
}

TEST(GpuScoreConsistency, Mxfp8SeesAPerturbedBackwardOperand) {
  FLAMIA_REQUIRE_GPU();
  expect_perturbation_seen(Recipe::kMxfp8, true);
}
TEST(GpuScoreConsistency, Qk16SeesAPerturbedBackwardOperand) {
  FLAMIA_REQUIRE_GPU();
  expect_perturbation_seen(Recipe::kMxfp8Qk16, false);
}

TEST(GpuScoreConsistency, RejectsUnsupportedArguments) {
  FLAMIA_REQUIRE_GPU();
  const DeviceBatch b(kOddDocs);
  const int32_t* cu = b.cu.get<int32_t>();
  test::expect_error(
      [&] {
        score_consistency_gpu(b.layout, cu, Recipe::kBf16, true, b.in, b.quant.view(), nullptr);
      },
      "recipe");
  test::expect_error(
      [&] {
        score_consistency_gpu(b.layout, nullptr, Recipe::kMxfp8, true, b.in, b.quant.view(),
                              nullptr);
      },
      "cu_seqlens");
  DeviceQuantizedAttention no_codes = b.quant.view();
  no_codes.k.codes = nullptr;
  test::expect_error(
      [&] { score_consistency_gpu(b.layout, cu, Recipe::kMxfp8, true, b.in, no_codes, nullptr); },
      "K codes is null");
  DeviceAttentionInputs no_q = b.in;
  no_q.q.data = nullptr;
  test::expect_error(
      [&] {
        score_consistency_gpu(b.layout, cu, Recipe::kMxfp8Qk16, true, no_q, b.quant.view(),
                              nullptr);
      },
      "Q (BF16) is null");
  const BackwardQueryOverride empty_override;
  test::expect_error(
      [&] {
        score_consistency_gpu(b.layout, cu, Recipe::kMxfp8, true, b.in, b.quant.view(), nullptr,
                              &empty_override);
      },
      "backward Q codes is null");
  PackedLayout narrow = b.layout;
  narrow.head_dim = 64;
  test::expect_error(
      [&] {
        score_consistency_gpu(narrow, cu, Recipe::kMxfp8, true, b.in, b.quant.view(), nullptr);
      },
      "head dim");
}

}  // namespace
}  // namespace flamia
