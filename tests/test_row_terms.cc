// The backward's delta word (flamia/row_terms.h): D 2^-e_dO rounded to kStagedDeltaBits
// significand bits with Q's row factor 2^e_q in its low bits. Every row factor the kernel can stage
// must come back bitwise beside every kind of delta (normal, subnormal, zero, either sign, near the
// largest float); the word's high bits must be the nearest kStagedDeltaBits-bit value, computed
// here in double, and the word read as the delta must lie within 2^-14 of it (relative, where
// normal). round_significand is checked at other widths against the same double definition.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "flamia/formats.h"
#include "flamia/row_terms.h"

namespace flamia {
namespace {

// x to `bits` significand bits, nearest with ties away from zero, with float's exponent range:
// the quantum of x's binade (or the subnormal one) in double, where every step is exact.
float nearest_with_bits(float x, int bits) {
  if (x == 0.0f || !std::isfinite(x)) return x;
  constexpr int kMinNormalExponent = -126;
  int e;
  std::frexp(double(x), &e);  // |x| in [2^(e-1), 2^e)
  const int quantum = std::max(e - 1, kMinNormalExponent) - (bits - 1);
  const double q = std::round(std::ldexp(double(x), -quantum));  // ties away from zero
  const double r = std::ldexp(q, quantum);
  return r > double(std::numeric_limits<float>::max()) ? std::copysign(INFINITY, x) : float(r);
}

// Deltas of every kind: random significands over the whole exponent range, subnormals, zeros,
// ties, values just below a binade's end (which round into the next), the largest floats.
std::vector<float> deltas() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          std::numeric_limits<float>::max(),
                          -std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::min(),
                          std::numeric_limits<float>::denorm_min()};
  constexpr int kRandom = 4000;
  constexpr uint32_t kMaxFiniteBits = 0x7F7FFFFFu;
  constexpr int kSmallestExponent = -149, kExponentStep = 7;
  std::mt19937 rng(194);
  std::uniform_int_distribution<uint32_t> any(0, kMaxFiniteBits);
  for (int i = 0; i < kRandom; ++i) {
    const float x = bits_to_float(any(rng));
    v.push_back(i % 2 ? x : -x);
  }
  const int dropped = kFloatMantissaBits + 1 - kStagedDeltaBits;
  for (int e = kSmallestExponent; e <= kFloatBias; e += kExponentStep) {
    const uint32_t base = float_to_bits(exp2i(e));
    v.push_back(bits_to_float(base | (1u << (dropped - 1))));         // a tie
    v.push_back(bits_to_float(base | ((1u << dropped) - 1)));         // rounds up
    v.push_back(bits_to_float(base | kFloatMantissaMask));            // into the next binade
    v.push_back(-bits_to_float(base | ((1u << (dropped - 1)) - 1)));  // just below a tie
  }
  return v;
}

TEST(RowTerms, EveryRowFactorAndDeltaComeBack) {
  const std::vector<float> v = deltas();
  const double kWordError = std::ldexp(1.0, -14);         // of a normal delta's magnitude
  const double kWordErrorAtZero = std::ldexp(1.0, -140);  // where the delta is 0
  int64_t wrong_factor = 0, wrong_delta = 0, far_word = 0, checked = 0;
  for (int e = kMinRowFactorExponent; e <= kMaxRowFactorExponent; ++e) {
    const float rf = exp2i(e);
    for (const float d : v) {
      const float word = delta_word(d, rf);
      const float want = nearest_with_bits(d, kStagedDeltaBits);
      wrong_factor += float_to_bits(row_factor_of(word)) != float_to_bits(rf);
      wrong_delta += (float_to_bits(word) & ~kRowFactorMask) != float_to_bits(want);
      if (std::isfinite(want) && std::fabs(want) >= std::numeric_limits<float>::min())
        far_word += std::fabs(double(word) - double(want)) > kWordError * std::fabs(double(want));
      else if (want == 0.0f)
        far_word += std::fabs(double(word)) > kWordErrorAtZero;
      ++checked;
    }
  }
  EXPECT_EQ(checked,
            int64_t(kMaxRowFactorExponent - kMinRowFactorExponent + 1) * int64_t(v.size()));
  EXPECT_EQ(wrong_factor, 0) << "row factors not returned bitwise";
  EXPECT_EQ(wrong_delta, 0) << "words whose delta bits are not the nearest " << kStagedDeltaBits
                            << "-bit value";
  EXPECT_EQ(far_word, 0) << "words that, read as the delta, lie too far from it";
}

// The range is as wide as it can be: the next smaller power of two has a bit below the shift.
TEST(RowTerms, RangeEndsWhereBitsWouldBeLost) {
  const float below = exp2i(kMinRowFactorExponent - 1);
  EXPECT_NE(float_to_bits(row_factor_of(delta_word(1.0f, below))), float_to_bits(below));
  EXPECT_EQ(kMinRowFactorExponent, ue8m0::kMinExponent);
  EXPECT_EQ(kMaxRowFactorExponent, ue8m0::kMaxExponent);
}

TEST(RoundSignificand, MatchesTheNearestValueAtEveryWidth) {
  const std::vector<float> v = deltas();
  for (const int bits : {1, 8, 14, 23, 24}) {
    SCOPED_TRACE(bits);
    int64_t wrong = 0;
    for (const float x : v)
      wrong +=
          float_to_bits(round_significand(x, bits)) != float_to_bits(nearest_with_bits(x, bits));
    EXPECT_EQ(wrong, 0);
  }
}

TEST(RoundSignificand, KeepsNonFiniteValues) {
  for (const float x : {INFINITY, -INFINITY})
    EXPECT_EQ(float_to_bits(round_significand(x, 14)), float_to_bits(x));
  EXPECT_TRUE(std::isnan(round_significand(std::numeric_limits<float>::quiet_NaN(), 14)));
  EXPECT_EQ(float_to_bits(round_significand(std::numeric_limits<float>::max(), 14)),
            float_to_bits(INFINITY));
}

}  // namespace
}  // namespace flamia
