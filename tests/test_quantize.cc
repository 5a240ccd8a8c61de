// Property tests of the CPU quantizer against an independent reference: group maxima, exponents and
// rounding recomputed here in double from the policy's definition (DESIGN §3).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "flamia/hadamard.h"
#include "flamia/inputs.h"
#include "flamia/quantize.h"
#include "reference_formats.h"

namespace flamia {
namespace {

// Documents of 1, 31, 32, 33 and 129 tokens at unaligned offsets, one empty, one longer.
const std::vector<int64_t> kOddDocs = {1, 31, 0, 32, 33, 129, 77};

uint16_t bf(double x) {
  return bf16::encode(float(x));
}

// codes_t's layout from its definition (quantize.h), independent of the library's helpers:
// document b starts at round_up(cu[b] + 15 b, 16); slot k of each 16-position group holds the
// group's token kSlotToken[k]; the buffer has round_up(T + 15 num_docs, 16) positions.
constexpr int kSlotToken[16] = {0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15};

int64_t ref_round16(int64_t x) {
  int64_t r = x;
  while (r % 16 != 0) ++r;
  return r;
}
int64_t ref_transposed_tokens(const std::vector<int32_t>& cu) {
  const int64_t docs = int64_t(cu.size()) - 1;
  return ref_round16(cu.back() + 15 * docs);
}
int64_t ref_doc_start(const std::vector<int32_t>& cu, int b) {
  return ref_round16(cu[b] + 15 * int64_t(b));
}
// Position of every token (document-relative token 16 g + kSlotToken[k] at 16 g + k).
std::vector<int64_t> ref_token_positions(const std::vector<int32_t>& cu) {
  std::vector<int64_t> pos(size_t(cu.back()), -1);
  for (int b = 0; b + 1 < int(cu.size()); ++b)
    for (int64_t g = 0; 16 * g < cu[b + 1] - cu[b]; ++g)
      for (int k = 0; k < 16; ++k) {
        const int64_t r = 16 * g + kSlotToken[k];
        if (cu[b] + r < cu[b + 1]) pos[size_t(cu[b] + r)] = ref_doc_start(cu, b) + 16 * g + k;
      }
  return pos;
}
// Expected codes_t: [H][D][Tt], the token's code at its position, 0 everywhere else.
std::vector<uint8_t> ref_codes_t(const E4M3Operand& o, const std::vector<int32_t>& cu) {
  const int64_t tt = ref_transposed_tokens(cu);
  const std::vector<int64_t> pos = ref_token_positions(cu);
  std::vector<uint8_t> want(size_t(int64_t(o.layout.heads) * o.layout.dim * tt), 0);
  for (int64_t t = 0; t < int64_t(pos.size()); ++t)
    for (int h = 0; h < o.layout.heads; ++h)
      for (int d = 0; d < o.layout.dim; ++d)
        want[size_t((int64_t(h) * o.layout.dim + d) * tt + pos[t])] =
            o.codes[o.layout.code(t, h, d)];
  return want;
}

// Plants the adversarial cases of DESIGN §3 into a batch: exact powers of two, maxima exactly at
// and just above 448 * 2^e, subnormal-sized values, all-zero rows and a whole all-zero document,
// and mixed signs.
void plant_adversarial(AttentionBatch& b) {
  const int D = b.head_dim;
  auto row = [&](std::vector<uint16_t>& t, int heads, int64_t tok, int h) {
    return &t[(tok * heads + h) * D];
  };
  for (auto* t : {&b.q, &b.k, &b.v, &b.dout}) {
    const int heads = (t == &b.q || t == &b.dout) ? b.heads_q : b.heads_kv;
    for (int d = 0; d < D; ++d) {
      row(*t, heads, 40, 0)[d] = bf(std::ldexp(d % 2 ? -1.0 : 1.0, d % 20 - 10));  // powers of two
      row(*t, heads, 41, 0)[d] = bf(d == 5 ? 448.0 * 8 : 0.01 * d);  // max exactly 448*2^3
      row(*t, heads, 42, 0)[d] = bf(d == 9 ? -450.0 / 64 : 0.3);     // just above 448*2^-6
      row(*t, heads, 43, 0)[d] = bf(std::ldexp(1.0, -133 + d % 7));  // bf16 subnormals
      row(*t, heads, 44, 0)[d] = 0;                                  // all-zero row
      row(*t, heads, 45, 1 % heads)[d] = bf(d % 3 ? 1e-30 : -3e4);   // wide mixed signs
    }
    // Document 1 (31 tokens, starting at token 1) all zero in every head: a zero block32 group.
    for (int64_t tok = 1; tok < 32; ++tok)
      for (int h = 0; h < heads; ++h)
        for (int d = 0; d < D; ++d) row(*t, heads, tok, h)[d] = 0;
  }
}

// Values the quantizer sees: BF16 decoded, optionally rotated (rotation is tested separately).
std::vector<double> operand_values(const AttentionBatch& b, Operand op, bool rotate) {
  const std::vector<uint16_t>& src = op == Operand::kQ   ? b.q
                                     : op == Operand::kK ? b.k
                                     : op == Operand::kV ? b.v
                                                         : b.dout;
  std::vector<double> out(src.size());
  std::vector<float> row(size_t(b.head_dim));
  for (size_t r = 0; r < src.size() / size_t(b.head_dim); ++r) {
    for (int d = 0; d < b.head_dim; ++d)
      row[d] = bf16::decode(src[r * size_t(b.head_dim) + size_t(d)]);
    if (rotate) hadamard_rotate(row.data(), b.head_dim);
    for (int d = 0; d < b.head_dim; ++d) out[r * size_t(b.head_dim) + size_t(d)] = row[d];
  }
  return out;
}

// All-zero groups take the smallest exponent (DESIGN §3 as amended in formats.h).
constexpr int kRefZeroGroupExponent = -127;

int ref_exponent_up(double amax, double max_code) {
  if (amax == 0) return kRefZeroGroupExponent;
  int e = -127;
  while (e < 127 && amax > max_code * std::ldexp(1.0, e)) ++e;
  return e;
}

int ref_exponent_floor(double amax) {
  if (amax == 0) return kRefZeroGroupExponent;
  return std::clamp(int(std::floor(std::log2(amax))) - 8, -127, 127);
}

// Round-half-even of y on the E4M3 grid, saturating at 448 (the hardware's satfinite).
double ref_e4m3_round(double y) {
  double a = std::fabs(y);
  int binade = std::max(a > 0 ? int(std::floor(std::log2(a))) : -6, -6);
  double spacing = std::ldexp(1.0, binade - 3);
  double r = std::nearbyint(a / spacing) * spacing;
  return std::copysign(std::min(r, 448.0), y);
}

// Group index of each (token, head) row under a policy's geometry: rows with the same id share
// one exponent.
std::vector<int64_t> group_ids(ScalePolicy p, const AttentionBatch& b, int heads) {
  std::vector<int64_t> id(size_t(b.tokens * heads));
  for (size_t doc = 0; doc + 1 < b.cu_seqlens.size(); ++doc)
    for (int64_t t = b.cu_seqlens[doc]; t < b.cu_seqlens[doc + 1]; ++t)
      for (int h = 0; h < heads; ++h) {
        int64_t block = (t - b.cu_seqlens[doc]) / kBlockTokens;
        int64_t g = 0;
        switch (p) {
          case ScalePolicy::kToken:
          case ScalePolicy::kVGroup16:
            g = t * heads + h;
            break;
          case ScalePolicy::kTensor:
            g = 0;
            break;
          case ScalePolicy::kBlock32:
          case ScalePolicy::kFloor:
            g = (int64_t(doc) * 100000 + block) * heads + h;
            break;
        }
        id[t * heads + h] = g;
      }
  return id;
}

class QuantizePolicy : public ::testing::TestWithParam<std::tuple<ScalePolicy, bool, int>> {};

TEST_P(QuantizePolicy, ExponentsCodesAndErrorsMatchTheDefinition) {
  const auto [policy, rotate, dim] = GetParam();
  InputSpec spec;
  spec.kind = InputKind::kHeavyTail;
  spec.sigma = 2.0;
  spec.seed = 17;
  AttentionBatch b = generate_batch(kOddDocs, 4, 2, dim, spec);
  plant_adversarial(b);
  QuantizeOptions opt;
  opt.policy = policy;
  opt.hadamard = rotate;
  QuantizedAttention qa = quantize_cpu(b.inputs(), opt);
  ASSERT_FALSE(qa.non_finite.any()) << qa.non_finite.message();

  for (Operand op : {Operand::kQ, Operand::kK, Operand::kV, Operand::kDO}) {
    SCOPED_TRACE(to_string(op));
    const ScalePolicy p = effective_policy(policy, op);
    const E4M3Operand& o = qa.operand(op);
    const int heads = o.layout.heads;
    const bool rot = rotate && (op == Operand::kQ || op == Operand::kK);
    const std::vector<double> x = operand_values(b, op, rot);
    const auto at = [&](int64_t t, int h, int d) { return x[(t * heads + h) * dim + d]; };

    // Reference exponents from group maxima.
    std::vector<double> amax_row(size_t(b.tokens * heads), 0.0);
    for (int64_t t = 0; t < b.tokens; ++t)
      for (int h = 0; h < heads; ++h)
        for (int d = 0; d < dim; ++d)
          amax_row[t * heads + h] = std::max(amax_row[t * heads + h], std::fabs(at(t, h, d)));
    const std::vector<int64_t> gid = group_ids(p, b, heads);
    std::vector<std::pair<int64_t, double>> group_max;
    auto group_amax = [&](int64_t g) {
      double m = 0;
      for (size_t r = 0; r < gid.size(); ++r)
        if (gid[r] == g) m = std::max(m, amax_row[r]);
      return m;
    };

    int clamps = 0;
    for (int64_t t = 0; t < b.tokens; ++t) {
      for (int h = 0; h < heads; ++h) {
        const int64_t r = t * heads + h;
        int e_ref = 0;
        if (p != ScalePolicy::kVGroup16) {
          const double m = p == ScalePolicy::kToken ? amax_row[r] : group_amax(gid[r]);
          e_ref = p == ScalePolicy::kFloor ? ref_exponent_floor(m) : ref_exponent_up(m, 448.0);
          ASSERT_EQ(ue8m0::exponent(o.exponents[o.layout.exponent(h, t)]), e_ref)
              << "token " << t << " head " << h;
        }
        for (int d = 0; d < dim; ++d) {
          const int e = o.exponent(t, h, d);
          const double scaled = at(t, h, d) / std::ldexp(1.0, e);
          const double got = e4m3::decode(o.codes[o.layout.code(t, h, d)]);
          if (p == ScalePolicy::kVGroup16) {  // 4-bit V: the nearest E2M1 value, no clamp
            ASSERT_LE(std::fabs(scaled), 6.0);
            const int c =
                testref::nearest_code(scaled, 16, testref::e2m1_value, [](int) { return false; });
            ASSERT_EQ(got, testref::e2m1_value(c)) << "token " << t << " dim " << d;
            ASSERT_LE(std::fabs(got - scaled), testref::e2m1_half_step(scaled));
            continue;
          }
          if (p != ScalePolicy::kFloor) ASSERT_LE(std::fabs(scaled), 448.0) << "clamp at " << t;
          const double want = ref_e4m3_round(scaled);
          ASSERT_EQ(got, want) << "token " << t << " head " << h << " dim " << d << " x "
                               << at(t, h, d);
          if (std::fabs(scaled) > 448.0) {
            ++clamps;
          } else {
            ASSERT_LE(std::fabs(got - scaled), testref::e4m3_half_step(scaled));
          }
        }
      }
    }
    if (p != ScalePolicy::kFloor) EXPECT_EQ(clamps, 0);

    // vgroup16: exponents per document-local 16-key group and channel, for the E2M1 range.
    if (p == ScalePolicy::kVGroup16) {
      for (size_t doc = 0; doc + 1 < b.cu_seqlens.size(); ++doc)
        for (int64_t s = b.cu_seqlens[doc]; s < b.cu_seqlens[doc + 1]; s += 16) {
          const int64_t end = std::min<int64_t>(s + 16, b.cu_seqlens[doc + 1]);
          for (int h = 0; h < heads; ++h)
            for (int d = 0; d < dim; ++d) {
              double m = 0;
              for (int64_t t = s; t < end; ++t) m = std::max(m, std::fabs(at(t, h, d)));
              for (int64_t t = s; t < end; ++t)
                ASSERT_EQ(o.exponent(t, h, d), ref_exponent_up(m, 6.0));
            }
        }
    }

    // Transposed copy: the same codes at codes_t's positions, zeros elsewhere; exponent padding
    // fixed.
    ASSERT_EQ(o.layout.tokens_t, ref_transposed_tokens(b.cu_seqlens));
    ASSERT_EQ(int64_t(o.codes_t.size()), o.layout.num_codes_t());
    ASSERT_TRUE(o.codes_t == ref_codes_t(o, b.cu_seqlens));
    for (int h = 0; h < heads; ++h)
      for (int64_t t = b.tokens; t < o.layout.tokens_padded; ++t)
        ASSERT_EQ(o.exponents[o.layout.exponent(h, t)], kPaddingExponentCode);
  }
}

INSTANTIATE_TEST_SUITE_P(AllPolicies, QuantizePolicy,
                         ::testing::Combine(::testing::ValuesIn(kAllScalePolicies),
                                            ::testing::Bool(), ::testing::Values(64, 128)),
                         [](const auto& info) {
                           return std::string(to_string(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_rotated" : "") + "_d" +
                                  std::to_string(std::get<2>(info.param));
                         });

TEST(QuantizeTransposed, HelpersMatchTheDefinition) {
  for (int r = 0; r < 200; ++r)
    EXPECT_EQ(
        transposed_slot(r), r / 16 * 16 +
                                [&] {
                                  for (int k = 0; k < 16; ++k)
                                    if (kSlotToken[k] == r % 16) return k;
                                  return -1;
                                }())
        << r;
  for (int64_t begin : {0, 1, 15, 16, 17, 100, 1000003})
    for (int doc : {0, 1, 2, 15, 16, 17, 999})
      EXPECT_EQ(transposed_doc_begin(begin, doc), ref_round16(begin + 15 * int64_t(doc)));
  EXPECT_EQ(transposed_tokens(0, 0), 0);
  EXPECT_EQ(transposed_tokens(0, 2), 32);
  EXPECT_EQ(transposed_tokens(1, 1), 16);
  EXPECT_EQ(transposed_tokens(17, 1), 32);
  EXPECT_EQ(transposed_tokens(17, 2), 48);
  static_assert(transposed_slot(8) == 2 && transposed_slot(19) == 21, "constexpr");
  const QuantLayout l = QuantLayout::make(35, 3, 64, 4);
  EXPECT_EQ(l.tokens_padded, 48);
  EXPECT_EQ(l.tokens_t, ref_round16(35 + 60));
  EXPECT_EQ(l.num_codes_t(), 3 * 64 * l.tokens_t);
  EXPECT_EQ(l.code_t(2, 5, 7), (2 * 64 + 5) * l.tokens_t + 7);
}

// Every token's position is inside the buffer and distinct (a bijection onto the token positions),
// it is where the library's helpers put it, and quantize_cpu writes every code there and zeros at
// every other position (all codes are non-zero here, so a stray code or missing zero shows).
TEST(QuantizeTransposed, TokenPositionsAreABijectionAndEveryOtherPositionIsZero) {
  const std::vector<int64_t> lengths = {0, 1, 15, 16, 17, 31, 33, 129};
  std::vector<std::vector<int64_t>> layouts;
  for (int64_t n : lengths) layouts.push_back({n});        // one document
  for (int64_t n : lengths) layouts.push_back({5, n, 3});  // at an unaligned offset
  layouts.push_back({3, 0, 1, 15, 16, 17, 31, 33, 129, 0});
  layouts.push_back({129, 33, 31, 17, 16, 15, 1, 0, 7});
  layouts.push_back({0, 0, 0, 1, 0, 0, 17, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0});
  layouts.push_back(std::vector<int64_t>(40, 1));  // many one-token documents
  layouts.push_back({0, 0});
  for (const std::vector<int64_t>& docs : layouts) {
    std::string name;
    for (int64_t n : docs) name += std::to_string(n) + ",";
    SCOPED_TRACE("documents " + name);
    AttentionBatch b = generate_batch(docs, 2, 1, 64, InputSpec{});
    const int64_t tt = ref_transposed_tokens(b.cu_seqlens);
    const int num_docs = int(docs.size());
    EXPECT_EQ(transposed_tokens(b.tokens, num_docs), tt);
    EXPECT_EQ(transposed_doc_begin(b.tokens, num_docs), tt);
    const std::vector<int64_t> pos = ref_token_positions(b.cu_seqlens);
    std::vector<int> hits(size_t(tt), 0);
    for (int doc = 0; doc < num_docs; ++doc) {
      EXPECT_EQ(transposed_doc_begin(b.cu_seqlens[doc], doc), ref_doc_start(b.cu_seqlens, doc));
      EXPECT_EQ(ref_doc_start(b.cu_seqlens, doc) % 16, 0);
      for (int64_t t = b.cu_seqlens[doc]; t < b.cu_seqlens[doc + 1]; ++t) {
        ASSERT_GE(pos[t], 0);
        ASSERT_LT(pos[t], tt);
        ++hits[size_t(pos[t])];
        ASSERT_EQ(transposed_doc_begin(b.cu_seqlens[doc], doc) +
                      transposed_slot(int(t - b.cu_seqlens[doc])),
                  pos[t])
            << "token " << t;
      }
    }
    EXPECT_EQ(std::count(hits.begin(), hits.end(), 1), b.tokens);
    EXPECT_EQ(std::count(hits.begin(), hits.end(), 0), tt - b.tokens);

    for (auto* x : {&b.q, &b.k, &b.v, &b.dout}) std::fill(x->begin(), x->end(), bf(-1.5));
    QuantizeOptions opt;
    opt.policy = ScalePolicy::kBlock32;
    const QuantizedAttention qa = quantize_cpu(b.inputs(), opt);
    for (Operand op : {Operand::kQ, Operand::kK, Operand::kV, Operand::kDO}) {
      if (op == Operand::kDO && b.tokens == 0) continue;  // an empty batch's dO is null: skipped
      const E4M3Operand& o = qa.operand(op);
      ASSERT_EQ(o.layout.tokens_t, tt);
      ASSERT_EQ(int64_t(o.codes_t.size()), int64_t(o.layout.heads) * 64 * tt);
      ASSERT_EQ(std::count(o.codes.begin(), o.codes.end(), uint8_t(0)), 0);
      for (int h = 0; h < o.layout.heads; ++h)
        for (int d = 0; d < 64; ++d)
          for (int64_t p = 0; p < tt; ++p) {
            const uint8_t got = o.codes_t[size_t((int64_t(h) * 64 + d) * tt + p)];
            if (hits[size_t(p)] == 0) ASSERT_EQ(got, 0) << "position " << p;
          }
      ASSERT_TRUE(o.codes_t == ref_codes_t(o, b.cu_seqlens)) << to_string(op);
    }
  }
}

// The E4M3 code of x: the nearest magnitude among codes 0..126 (0x7F is NaN, ties to the even
// code), then the sign bit, which E4M3 keeps on zero too.
int ref_e4m3_code(double x) {
  return testref::nearest_code(std::fabs(x), 127, testref::e4m3_value, [](int) { return false; }) |
         (std::signbit(x) ? 0x80 : 0);
}

// Token t's exponent in head h (UE8M0, bias 127), and the largest over tokens [n0, n1).
int ref_exponent(const E4M3Operand& o, int h, int64_t t) {
  return int(o.exponents[size_t(h * o.layout.tokens_padded + t)]) - 127;
}
int ref_tile_max(const E4M3Operand& o, int h, int64_t n0, int64_t n1) {
  int top = -1000;
  for (int64_t j = n0; j < n1; ++j) top = std::max(top, ref_exponent(o, h, j));
  return top;
}

// Calls f(t, h, shift) for every token t and head h of the documents cu_seqlens describes, shift =
// the token's exponent minus the largest of its document-relative 128-key tile (<= 0); returns how
// many (token, head) pairs have shift < 0 (up to the first fatal failure).
template <typename F>
int64_t for_each_tile_shift(const std::vector<int32_t>& cu_seqlens, const E4M3Operand& o, int heads,
                            F&& f) {
  int64_t shifted = 0;
  for (size_t doc = 0; doc + 1 < cu_seqlens.size(); ++doc) {
    const int64_t begin = cu_seqlens[doc], end = cu_seqlens[doc + 1];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = begin + (t - begin) / 128 * 128, n1 = std::min(n0 + 128, end);
      for (int h = 0; h < heads; ++h) {
        const int shift = ref_exponent(o, h, t) - ref_tile_max(o, h, n0, n1);
        shifted += shift < 0;
        f(t, h, shift);
        if (::testing::Test::HasFatalFailure()) return shifted;  // an ASSERT in f stops the walk
      }
    }
  }
  return shifted;
}

// The tile-code tests' batch: odd documents across the key tiles, heavy-tailed inputs whose
// exponents spread over several binades within a tile.
AttentionBatch tile_code_batch() {
  InputSpec spec;
  spec.kind = InputKind::kHeavyTail;
  spec.sigma = 2.0;
  return generate_batch({1, 31, 0, 129, 33, 300, 128, 5, 260}, 2, 2, 64, spec);
}

// V's tile codes (quantize.h): every document-relative tile of kKeyTileTokens keys is requantized
// to its largest exponent, checked against the reference E4M3 grid (nearest code, ties even) in
// double; positions without a token stay 0; a tile's codes depend on its own keys alone; only V
// has them, and only beside codes_t under a per-token exponent.
TEST(QuantizeTransposed, ValueTileCodesCarryEachKeysShiftToItsTilesLargestExponent) {
  AttentionBatch b = tile_code_batch();
  const int64_t tt = ref_transposed_tokens(b.cu_seqlens);
  const std::vector<int64_t> pos = ref_token_positions(b.cu_seqlens);
  for (ScalePolicy policy : {ScalePolicy::kToken, ScalePolicy::kBlock32}) {
    SCOPED_TRACE(to_string(policy));
    QuantizeOptions opt;
    opt.policy = policy;
    const QuantizedAttention qa = quantize_cpu(b.inputs(), opt);
    const E4M3Operand& v = qa.v;
    ASSERT_EQ(v.codes_t_tiles.size(), v.codes_t.size());
    for (const E4M3Operand* o : {&qa.q, &qa.k, &qa.dout}) EXPECT_TRUE(o->codes_t_tiles.empty());
    std::vector<bool> token_at(size_t(tt), false);
    int64_t subnormal = 0;
    const int64_t shifted =
        for_each_tile_shift(b.cu_seqlens, v, 2, [&](int64_t t, int h, int shift) {
          token_at[size_t(pos[t])] = true;
          for (int d = 0; d < 64; ++d) {
            const size_t at = size_t((int64_t(h) * 64 + d) * tt + pos[t]);
            const double want = std::ldexp(testref::e4m3_value(v.codes_t[at]), shift);
            ASSERT_EQ(int(v.codes_t_tiles[at]), ref_e4m3_code(want))
                << "token " << t << " head " << h << " dim " << d;
            subnormal += std::fabs(want) < std::ldexp(1.0, -6) && want != 0.0;
          }
        });
    EXPECT_GT(shifted, 0);    // the inputs exercise the shift
    EXPECT_GT(subnormal, 0);  // and its rounding below the normal range
    for (int64_t p = 0; p < tt; ++p)
      if (!token_at[size_t(p)])
        for (int64_t row = 0; row < 2 * 64; ++row)
          ASSERT_EQ(v.codes_t_tiles[size_t(row * tt + p)], 0);

    // A tile's codes do not see the other tiles: one token of the 300-token document's last tile
    // (tokens 256..299) scaled up 2^10 raises that tile's exponent and leaves the first two
    // tiles' codes as they were.
    AttentionBatch big = b;
    const int64_t d5 = b.cu_seqlens[5];
    for (int64_t t = d5 + 260; t < d5 + 261; ++t)
      for (int h = 0; h < 2; ++h)
        for (int d = 0; d < 64; ++d) {
          uint16_t& x = big.v[size_t((t * 2 + h) * 64 + d)];
          x = bf16::encode(bf16::decode(x) * 1024.0f);
        }
    const QuantizedAttention qb = quantize_cpu(big.inputs(), opt);
    int64_t changed_last = 0;
    for (int64_t t = d5; t < d5 + 300; ++t)
      for (int64_t row = 0; row < 2 * 64; ++row) {
        const size_t at = size_t(row * tt + pos[t]);
        if (t < d5 + 256) {
          ASSERT_EQ(qb.v.codes_t_tiles[at], v.codes_t_tiles[at]) << "token " << t;
        } else {
          changed_last += qb.v.codes_t_tiles[at] != v.codes_t_tiles[at];
        }
      }
    EXPECT_GT(changed_last, 0);
  }
  QuantizeOptions vgroup;
  vgroup.policy = ScalePolicy::kVGroup16;
  EXPECT_TRUE(quantize_cpu(b.inputs(), vgroup).v.codes_t_tiles.empty());
  QuantizeOptions lean;
  lean.transposed = false;
  EXPECT_TRUE(quantize_cpu(b.inputs(), lean).v.codes_t_tiles.empty());
}

// K's tile codes: the same requantization of its codes ([T][H][D]), which both kernels' score
// products read in the tiles the forward's items see whole; only with score codes.
TEST(QuantizeTransposed, KeyTileCodesCarryEachKeysShiftToItsTilesLargestExponent) {
  const AttentionBatch b = tile_code_batch();
  for (ScalePolicy policy : {ScalePolicy::kToken, ScalePolicy::kBlock32, ScalePolicy::kVGroup16}) {
    SCOPED_TRACE(to_string(policy));
    QuantizeOptions opt;
    opt.policy = policy;
    const QuantizedAttention qa = quantize_cpu(b.inputs(), opt);
    const E4M3Operand& k = qa.k;
    ASSERT_EQ(k.codes_tiles.size(), k.codes.size());
    for (const E4M3Operand* o : {&qa.q, &qa.v, &qa.dout}) EXPECT_TRUE(o->codes_tiles.empty());
    const int64_t shifted =
        for_each_tile_shift(b.cu_seqlens, k, 2, [&](int64_t t, int h, int shift) {
          for (int d = 0; d < 64; ++d) {
            const size_t at = size_t((t * 2 + h) * 64 + d);
            const double want = std::ldexp(testref::e4m3_value(k.codes[at]), shift);
            ASSERT_EQ(int(k.codes_tiles[at]), ref_e4m3_code(want))
                << "token " << t << " head " << h << " dim " << d;
          }
        });
    EXPECT_GT(shifted, 0);
  }
  QuantizeOptions qk16;
  qk16.score_codes = false;
  EXPECT_TRUE(quantize_cpu(b.inputs(), qk16).k.codes_tiles.empty());
}

// An all-zero token takes the smallest exponent, so it never sets a tile's maximum: in a tile of
// small keys that share one exponent, zeroing one key leaves every other key's tile codes equal
// to its token codes (with the zero token at exponent 0 they lost 17 binades, most of them to
// zero).
TEST(QuantizeTransposed, ZeroTokensDoNotSetTheTileExponent) {
  AttentionBatch b = generate_batch({128}, 1, 1, 64, InputSpec{});
  for (auto* x : {&b.k, &b.v})
    for (size_t i = 0; i < x->size(); ++i)  // one exponent for every token: |x| in [1, 1.75) 2^-9
      (*x)[i] = bf(std::ldexp((i % 2 ? -1.0 : 1.0) * (1.0 + double(i % 7) / 10.0), -9));
  for (int d = 0; d < 64; ++d) b.k[size_t(40 * 64 + d)] = b.v[size_t(40 * 64 + d)] = bf(0.0);
  const QuantizedAttention qa = quantize_cpu(b.inputs(), QuantizeOptions{});
  EXPECT_EQ(qa.k.exponent(40, 0, 0), kZeroGroupExponent);
  EXPECT_EQ(kZeroGroupExponent, ue8m0::kMinExponent);
  EXPECT_LT(qa.k.exponent(0, 0, 0), 0);
  EXPECT_TRUE(qa.k.codes_tiles == qa.k.codes);
  EXPECT_TRUE(qa.v.codes_t_tiles == qa.v.codes_t);
  EXPECT_GT(std::count(qa.k.codes.begin(), qa.k.codes.end(), uint8_t(0)), 0);
}

TEST(Quantize, Block32CountsBlocksFromEachDocumentStart) {
  // Two documents; the second starts at token 5. A large value at document-local position 31 of
  // the second document (token 36) must set the exponent of tokens 5..36 and no others.
  AttentionBatch b = generate_batch({5, 70}, 1, 1, 64, InputSpec{});
  b.k[36 * 64 + 3] = bf(1000.0);
  QuantizeOptions opt;
  opt.policy = ScalePolicy::kBlock32;
  QuantizedAttention qa = quantize_cpu(b.inputs(), opt);
  const int big = ref_exponent_up(1000.0, 448.0);
  for (int64_t t = 0; t < b.tokens; ++t) {
    const int e = ue8m0::exponent(qa.k.exponents[qa.k.layout.exponent(0, t)]);
    if (t >= 5 && t <= 36) {
      EXPECT_EQ(e, big) << t;
    } else {
      EXPECT_LT(e, big) << t;
    }
  }
}

TEST(Quantize, FloorPolicyClampsWhereRoundUpDoesNot) {
  // A token whose maximum is 480: the floor exponent keeps 2^0 and 480 saturates to 448 (an error
  // of 32, far above half a code step); the round-up rule picks 2^1 and represents 480 exactly.
  AttentionBatch b = generate_batch({40}, 1, 1, 64, InputSpec{});
  b.v[10 * 64 + 7] = bf(480.0);
  QuantizeOptions opt;
  opt.policy = ScalePolicy::kFloor;
  QuantizedAttention floor_q = quantize_cpu(b.inputs(), opt);
  EXPECT_EQ(floor_q.v.exponent(10, 0, 7), 0);
  EXPECT_EQ(floor_q.v.codes[floor_q.v.layout.code(10, 0, 7)], e4m3::kMaxCode);
  EXPECT_EQ(floor_q.v.value(10, 0, 7), 448.0f);
  opt.policy = ScalePolicy::kBlock32;
  QuantizedAttention up_q = quantize_cpu(b.inputs(), opt);
  EXPECT_EQ(up_q.v.exponent(10, 0, 7), 1);
  EXPECT_EQ(up_q.v.value(10, 0, 7), 480.0f);
}

TEST(Quantize, StridedViewsGiveTheSameResultAsDenseOnes) {
  AttentionBatch b = generate_batch(kOddDocs, 4, 2, 64, InputSpec{});
  // Head-major copies [H][T][D] of every tensor.
  auto head_major = [&](const std::vector<uint16_t>& src, int heads) {
    std::vector<uint16_t> dst(src.size());
    for (int64_t t = 0; t < b.tokens; ++t)
      for (int h = 0; h < heads; ++h)
        for (int d = 0; d < 64; ++d)
          dst[(h * b.tokens + t) * 64 + d] = src[(t * heads + h) * 64 + d];
    return dst;
  };
  auto q = head_major(b.q, 4), k = head_major(b.k, 2), v = head_major(b.v, 2),
       g = head_major(b.dout, 4);
  AttentionInputs in = b.inputs();
  in.q = {q.data(), 64, b.tokens * 64};
  in.k = {k.data(), 64, b.tokens * 64};
  in.v = {v.data(), 64, b.tokens * 64};
  in.dout = {g.data(), 64, b.tokens * 64};
  QuantizeOptions opt;
  opt.policy = ScalePolicy::kBlock32;
  QuantizedAttention dense = quantize_cpu(b.inputs(), opt), strided = quantize_cpu(in, opt);
  for (Operand op : {Operand::kQ, Operand::kK, Operand::kV, Operand::kDO}) {
    EXPECT_EQ(dense.operand(op).codes, strided.operand(op).codes);
    EXPECT_EQ(dense.operand(op).exponents, strided.operand(op).exponents);
  }
}

TEST(Quantize, NonFiniteInputsAreReportedAndIsolated) {
  AttentionBatch b = generate_batch(kOddDocs, 4, 2, 64, InputSpec{});
  AttentionBatch clean = b;
  const int64_t tok = 40;
  b.k[(tok * 2 + 1) * 64 + 7] = 0x7FC0;     // NaN at token 40, head 1, dim 7
  b.k[(tok * 2 + 1) * 64 + 9] = 0x7F80;     // +inf later in the same row
  b.dout[(100 * 4 + 3) * 64 + 0] = 0xFF80;  // -inf in dO
  clean.k[(tok * 2 + 1) * 64 + 7] = 0;
  clean.k[(tok * 2 + 1) * 64 + 9] = 0;
  clean.dout[(100 * 4 + 3) * 64 + 0] = 0;
  for (ScalePolicy p : kAllScalePolicies) {
    QuantizeOptions opt;
    opt.policy = p;
    opt.nvfp4_qk = true;
    QuantizedAttention bad = quantize_cpu(b.inputs(), opt), ok = quantize_cpu(clean.inputs(), opt);
    ASSERT_TRUE(bad.non_finite.any());
    EXPECT_EQ(bad.non_finite.first_index[int(Operand::kQ)], -1);
    EXPECT_EQ(bad.non_finite.first_index[int(Operand::kK)], (tok * 2 + 1) * 64 + 7);
    EXPECT_EQ(bad.non_finite.first_index[int(Operand::kDO)], (100 * 4 + 3) * 64 + 0);
    EXPECT_EQ(bad.non_finite.message(), "non-finite input in K at token 40, head 1, dim 7");
    EXPECT_THROW(bad.non_finite.throw_if_any(), Error);
    // Non-finite elements act as zeros: every other output is what the cleaned input gives.
    for (Operand op : {Operand::kQ, Operand::kK, Operand::kV, Operand::kDO}) {
      EXPECT_EQ(bad.operand(op).codes, ok.operand(op).codes);
      EXPECT_EQ(bad.operand(op).exponents, ok.operand(op).exponents);
      EXPECT_EQ(bad.operand(op).channel_exponents, ok.operand(op).channel_exponents);
    }
    EXPECT_EQ(bad.k4.packed, ok.k4.packed);
    EXPECT_EQ(bad.k4.local_scales, ok.k4.local_scales);
  }
  EXPECT_FALSE(quantize_cpu(clean.inputs(), QuantizeOptions{}).non_finite.any());
  EXPECT_EQ(quantize_cpu(clean.inputs(), QuantizeOptions{}).non_finite.message(), "");
}

TEST(Quantize, RejectsBadLayoutsAndViews) {
  AttentionBatch b = generate_batch({10, 20}, 4, 2, 64, InputSpec{});
  AttentionInputs in = b.inputs();
  std::vector<int32_t> bad_cu = {0, 20, 10};
  in.layout.cu_seqlens = bad_cu.data();
  EXPECT_THROW(quantize_cpu(in, {}), Error);
  in = b.inputs();
  in.v.stride_head = 1;  // rows overlap
  try {
    quantize_cpu(in, {});
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("V has overlapping rows"), std::string::npos) << e.what();
  }
  in = b.inputs();
  in.dout.data = nullptr;  // forward only: fine, dO left empty
  QuantizedAttention fwd = quantize_cpu(in, {});
  EXPECT_TRUE(fwd.dout.codes.empty());
  in.q.data = in.k.data = in.v.data = nullptr;  // nothing to quantize
  try {
    quantize_cpu(in, {});
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no operand to quantize"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_scale_policy("blocks"), Error);
  EXPECT_EQ(parse_scale_policy("vgroup16"), ScalePolicy::kVGroup16);
}

// The training call's backward quantizes dO alone (Q, K, V come from its forward): a null input
// skips its operand, and a present operand's arrays are the full quantization's, whatever the
// policy (tensor maxima included), rotation and NVFP4.
TEST(Quantize, NullInputsSkipTheirOperands) {
  AttentionBatch b = generate_batch(kOddDocs, 4, 2, 64, InputSpec{});
  b.q[(7 * 4 + 2) * 64 + 5] = 0x7FC0;      // NaN in Q: reported only when Q is quantized
  b.dout[(50 * 4 + 1) * 64 + 3] = 0x7F80;  // +inf in dO
  const AttentionInputs all = b.inputs();
  for (ScalePolicy p : kAllScalePolicies) {
    QuantizeOptions opt;
    opt.policy = p;
    opt.hadamard = true;
    opt.nvfp4_qk = true;
    const QuantizedAttention full = quantize_cpu(all, opt);
    ASSERT_GE(full.non_finite.first_index[int(Operand::kQ)], 0);
    for (Operand only : {Operand::kDO, Operand::kK}) {
      SCOPED_TRACE(std::string(to_string(p)) + ", " + to_string(only) + " only");
      AttentionInputs in;
      in.layout = all.layout;
      (only == Operand::kK ? in.k : in.dout) = operand_input(all, only);
      const QuantizedAttention one = quantize_cpu(in, opt);
      for (Operand op : {Operand::kQ, Operand::kK, Operand::kV, Operand::kDO}) {
        const E4M3Operand& got = one.operand(op);
        const int64_t reported = one.non_finite.first_index[int(op)];
        if (op != only) {
          EXPECT_TRUE(got.codes.empty() && got.codes_t.empty() && got.exponents.empty() &&
                      got.channel_exponents.empty())
              << to_string(op);
          EXPECT_EQ(reported, -1) << to_string(op);
          continue;
        }
        const E4M3Operand& want = full.operand(op);
        ASSERT_FALSE(got.codes.empty());
        EXPECT_EQ(got.layout.tokens_t, want.layout.tokens_t);
        EXPECT_EQ(got.codes, want.codes);
        EXPECT_EQ(got.codes_t, want.codes_t);
        EXPECT_EQ(got.exponents, want.exponents);
        EXPECT_EQ(got.channel_exponents, want.channel_exponents);
        EXPECT_EQ(reported, full.non_finite.first_index[int(op)]);
      }
      EXPECT_TRUE(one.q4.packed.empty() && one.q4.exponents.empty());
      if (only == Operand::kK) {
        EXPECT_EQ(one.k4.packed, full.k4.packed);
        EXPECT_EQ(one.k4.local_scales, full.k4.local_scales);
        EXPECT_EQ(one.k4.exponents, full.k4.exponents);
        EXPECT_FALSE(one.non_finite.any());
      } else {
        EXPECT_TRUE(one.k4.packed.empty() && one.k4.exponents.empty());
        EXPECT_EQ(one.non_finite.message(), "non-finite input in dO at token 50, head 1, dim 3");
      }
    }
  }
}

TEST(Quantize, ForwardOnlyCanSkipTransposedCopies) {
  AttentionBatch b = generate_batch({10, 20}, 2, 2, 64, InputSpec{});
  QuantizeOptions opt;
  opt.transposed = false;
  EXPECT_TRUE(quantize_cpu(b.inputs(), opt).q.codes_t.empty());
}

// mxfp8-qk16's quantization: Q and K without their score-product codes, everything else as usual.
TEST(Quantize, WithoutScoreCodesQAndKKeepTheirTransposedCopiesAndExponents) {
  AttentionBatch b = generate_batch({1, 31, 33, 100}, 4, 2, 64, InputSpec{});
  const QuantizedAttention all = quantize_cpu(b.inputs(), QuantizeOptions{});
  QuantizeOptions opt;
  opt.score_codes = false;
  const QuantizedAttention some = quantize_cpu(b.inputs(), opt);
  for (const auto& [got, want] :
       {std::make_pair(&some.q, &all.q), std::make_pair(&some.k, &all.k)}) {
    EXPECT_TRUE(got->codes.empty());
    EXPECT_FALSE(want->codes.empty());
    EXPECT_EQ(got->codes_t, want->codes_t);
    EXPECT_EQ(got->exponents, want->exponents);
  }
  for (const auto& [got, want] :
       {std::make_pair(&some.v, &all.v), std::make_pair(&some.dout, &all.dout)}) {
    EXPECT_EQ(got->codes, want->codes);
    EXPECT_EQ(got->codes_t, want->codes_t);
    EXPECT_EQ(got->exponents, want->exponents);
  }
}

class QuantizeNvfp4 : public ::testing::TestWithParam<std::tuple<bool, int>> {};

TEST_P(QuantizeNvfp4, ScalesAreMinimalAndCodesNearest) {
  const auto [rotate, dim] = GetParam();
  InputSpec spec;
  spec.kind = InputKind::kHeavyTail;
  spec.sigma = 2.0;
  AttentionBatch b = generate_batch(kOddDocs, 2, 1, dim, spec);
  plant_adversarial(b);
  QuantizeOptions opt;
  opt.nvfp4_qk = true;
  opt.hadamard = rotate;
  QuantizedAttention qa = quantize_cpu(b.inputs(), opt);
  for (Operand op : {Operand::kQ, Operand::kK}) {
    SCOPED_TRACE(to_string(op));
    const Nvfp4Operand& o = op == Operand::kQ ? qa.q4 : qa.k4;
    const int heads = o.layout.heads;
    const std::vector<double> x = operand_values(b, op, rotate);
    for (int64_t t = 0; t < b.tokens; ++t)
      for (int h = 0; h < heads; ++h) {
        const double* row = &x[(t * heads + h) * dim];
        double amax = 0;
        for (int d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(row[d]));
        const int e = ref_exponent_up(amax, 6.0 * 448.0);
        ASSERT_EQ(o.exponent(t, h), e);
        for (int g = 0; g < dim; g += 16) {
          double gmax = 0;
          for (int d = g; d < g + 16; ++d) gmax = std::max(gmax, std::fabs(row[d]));
          const uint8_t s = o.local_scales[o.layout.nvfp4_scale(t, h, g)];
          const double unit = std::ldexp(1.0, e);
          if (gmax == 0) {
            ASSERT_EQ(s, 0);
          } else {  // the smallest E4M3 scale that covers the group: no E2M1 code clamps
            ASSERT_LE(gmax, 6.0 * testref::e4m3_value(s) * unit);
            ASSERT_GT(gmax, 6.0 * testref::e4m3_value(s - 1) * unit);
          }
          const double scale = testref::e4m3_value(s) * unit;
          for (int d = g; d < g + 16; ++d) {
            const double got = o.value(t, h, d);
            double want = 0;
            if (s != 0) {
              const int c = testref::nearest_code(row[d] / scale, 16, testref::e2m1_value,
                                                  [](int) { return false; });
              want = testref::e2m1_value(c) * scale;
              ASSERT_LE(std::fabs(got - row[d]), testref::e2m1_half_step(row[d] / scale) * scale);
            }
            ASSERT_EQ(got, want) << "token " << t << " head " << h << " dim " << d;
          }
        }
      }
  }
}

INSTANTIATE_TEST_SUITE_P(Nvfp4, QuantizeNvfp4,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(64, 128)));

}  // namespace
}  // namespace flamia
