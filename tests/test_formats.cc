// Exhaustive tests of the number formats against independent definitions computed in double.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "flamia/formats.h"
#include "reference_formats.h"

namespace flamia {
namespace {

using testref::e2m1_value;
using testref::e4m3_value;
using testref::nearest_code;

TEST(E4M3, DecodeMatchesDefinitionForAllCodes) {
  for (int c = 0; c < 256; ++c) {
    float v = e4m3::decode(uint8_t(c));
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << c;
    } else {
      EXPECT_EQ(double(v), e4m3_value(c)) << c;
      EXPECT_EQ(std::signbit(v), (c & 0x80) != 0) << c;
    }
  }
  EXPECT_EQ(e4m3::decode(0x7E), 448.0f);
  EXPECT_EQ(e4m3::decode(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(e4m3::decode(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(e4m3::decode(0x07), 7 * std::ldexp(1.0f, -9));
}

TEST(E4M3, EncodeDecodeIsIdentityOnFiniteCodes) {
  for (int c = 0; c < 256; ++c) {
    if (e4m3::is_nan(uint8_t(c))) continue;
    float v = e4m3::decode(uint8_t(c));
    EXPECT_EQ(e4m3::encode(v), c) << c;
    EXPECT_EQ(float_to_bits(e4m3::decode(e4m3::encode(v))), float_to_bits(v)) << c;
  }
}

TEST(E4M3, MidpointsTieToEvenAndNeighboursRoundToNearest) {
  for (int sign = 0; sign < 2; ++sign) {
    for (int c = 0; c < 0x7E; ++c) {  // every pair of adjacent finite magnitudes
      float lo = e4m3::decode(uint8_t(c)), hi = e4m3::decode(uint8_t(c + 1));
      float mid = (lo + hi) / 2;  // exact: both have few significant bits
      ASSERT_EQ(double(mid), (double(lo) + double(hi)) / 2);
      int even = (c % 2 == 0) ? c : c + 1;
      uint8_t s = sign ? 0x80 : 0;
      float m = sign ? -mid : mid;
      EXPECT_EQ(e4m3::encode(m), s | even) << "midpoint above code " << c;
      EXPECT_EQ(e4m3::encode(std::nextafter(m, 0.0f)), s | c) << c;
      EXPECT_EQ(e4m3::encode(std::nextafter(m, sign ? -1e9f : 1e9f)), s | (c + 1)) << c;
    }
  }
}

TEST(E4M3, SubnormalsAreExactMultiplesOfTwoToTheMinusNine) {
  for (int m = 0; m < 8; ++m) {
    float v = std::ldexp(float(m), -9);
    EXPECT_EQ(e4m3::encode(v), m);
    EXPECT_EQ(e4m3::decode(uint8_t(m)), v);
  }
  // Below half the smallest subnormal: zero; exactly half: tie to even (zero); above: 2^-9.
  EXPECT_EQ(e4m3::encode(std::ldexp(1.0f, -10)), 0);
  EXPECT_EQ(e4m3::encode(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 1);
  EXPECT_EQ(e4m3::encode(std::ldexp(3.0f, -10)), 2);  // 1.5 * 2^-9 ties to the even code 2
  EXPECT_EQ(e4m3::encode(std::numeric_limits<float>::denorm_min()), 0);
  EXPECT_EQ(e4m3::encode(-std::numeric_limits<float>::denorm_min()), 0x80);
}

TEST(E4M3, SaturatesBeyondMaxAndMapsNaNToCanonicalNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {448.0f, 449.0f, 463.99f, 464.0f, 465.0f, 480.0f, 1e6f, 3e38f, inf}) {
    EXPECT_EQ(e4m3::encode(x), 0x7E) << x;
    EXPECT_EQ(e4m3::encode(-x), 0xFE) << x;
  }
  EXPECT_EQ(e4m3::encode(std::numeric_limits<float>::quiet_NaN()), e4m3::kNaNCode);
  EXPECT_EQ(e4m3::encode(-std::numeric_limits<float>::quiet_NaN()), e4m3::kNaNCode);
}

TEST(E4M3, RandomFloatsMatchBruteForceNearestEven) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mant(-2.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-16, 10);
  for (int i = 0; i < 200000; ++i) {
    float x = std::ldexp(mant(rng), expo(rng));
    if (std::fabs(x) >= 448.0f) continue;
    int want = nearest_code(x, 256, e4m3_value, /*skip=*/[](int c) { return (c & 0x7F) == 0x7F; });
    uint8_t got = e4m3::encode(x);
    // Zero results keep the input's sign; compare values for them.
    if (e4m3_value(want) == 0.0) {
      EXPECT_EQ(e4m3::decode(got), 0.0f) << x;
    } else {
      EXPECT_EQ(got, want) << x;
    }
  }
}

TEST(E4M3Scale, RoundUpGivesSmallestCodeNotBelow) {
  EXPECT_EQ(e4m3::encode_up(0.0f), 0);
  for (int c = 0; c < 0x7E; ++c) {
    float v = e4m3::decode(uint8_t(c));
    EXPECT_EQ(e4m3::encode_up(v), c);
    float above = std::nextafter(v, 1e9f);
    EXPECT_EQ(e4m3::encode_up(above), c + 1) << c;
    float between = (v + e4m3::decode(uint8_t(c + 1))) / 2;
    EXPECT_EQ(e4m3::encode_up(between), c + 1) << c;
  }
  EXPECT_EQ(e4m3::encode_up(448.0f), 0x7E);
}

TEST(E2M1, DecodeAllCodes) {
  const float want[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(e2m1::decode(uint8_t(c)), (c & 8) ? -want[c & 7] : want[c & 7]) << c;
    EXPECT_EQ(double(e2m1::decode(uint8_t(c))), e2m1_value(c));
  }
}

TEST(E2M1, EncodeDecodeAndTiesToEven) {
  for (int c = 0; c < 16; ++c) {
    float v = e2m1::decode(uint8_t(c));
    EXPECT_EQ(e2m1::decode(e2m1::encode(v)), v) << c;  // -0 comes back as +0, equal in value
  }
  for (int sign = 0; sign < 2; ++sign) {
    for (int c = 0; c < 7; ++c) {
      float lo = e2m1::decode(uint8_t(c)), hi = e2m1::decode(uint8_t(c + 1));
      float mid = (lo + hi) / 2;
      int even = (c % 2 == 0) ? c : c + 1;
      float m = sign ? -mid : mid;
      uint8_t s = sign ? 8 : 0;
      auto with_sign = [&](int code) { return code == 0 ? 0 : (s | code); };
      EXPECT_EQ(e2m1::encode(m), with_sign(even)) << c;
      EXPECT_EQ(e2m1::encode(std::nextafter(m, 0.0f)), with_sign(c)) << c;
      EXPECT_EQ(e2m1::encode(std::nextafter(m, sign ? -1e9f : 1e9f)), with_sign(c + 1)) << c;
    }
  }
}

TEST(E2M1, SaturatesAndNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {6.0f, 7.0f, 100.0f, inf}) {
    EXPECT_EQ(e2m1::encode(x), 0x7);
    EXPECT_EQ(e2m1::encode(-x), 0xF);
  }
  EXPECT_EQ(e2m1::encode(std::numeric_limits<float>::quiet_NaN()), 0x7);
}

TEST(E2M1, ScaledEncodeMatchesBruteForceForE4M3TimesPowerOfTwoScales) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> scode(1, 0x7E), pexp(-40, 40);
  std::uniform_real_distribution<double> frac(-7.0, 7.0);
  for (int i = 0; i < 100000; ++i) {
    float scale = e4m3::decode(uint8_t(scode(rng))) * std::ldexp(1.0f, pexp(rng));
    float x = float(frac(rng) * scale);
    if (i % 4 == 0) {  // exact midpoints, the adversarial case for a rounded quotient
      const double mids[] = {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0};
      x = float(mids[i % 7] * scale * ((i & 8) ? -1 : 1));
    }
    int want = nearest_code(double(x) / double(scale), 16, e2m1_value, [](int) { return false; });
    uint8_t got = e2m1::encode_scaled(x, scale);
    EXPECT_EQ(e2m1::decode(got), float(e2m1_value(want))) << x << " / " << scale;
  }
}

TEST(UE8M0, DecodeAndClamp) {
  for (int b = 0; b < 255; ++b)
    EXPECT_EQ(double(ue8m0::decode(uint8_t(b))), std::ldexp(1.0, b - 127));
  EXPECT_TRUE(std::isnan(ue8m0::decode(0xFF)));
  EXPECT_EQ(ue8m0::from_exponent(0), 127);
  EXPECT_EQ(ue8m0::from_exponent(-200), 0);
  EXPECT_EQ(ue8m0::from_exponent(200), 254);
  for (int e = -127; e <= 127; ++e) EXPECT_EQ(ue8m0::exponent(ue8m0::from_exponent(e)), e);
}

TEST(BF16, AllPatternsRoundTripAndMidpointsTieToEven) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    float v = bf16::decode(uint16_t(b));
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(bf16::decode(bf16::encode(v))));
      continue;
    }
    EXPECT_EQ(bf16::encode(v), b);
    if ((b & 0x7F80) == 0x7F80 || (b & 0x7FFF) == 0x7F7F) continue;  // inf/NaN or next is inf
    // Midpoint to the next pattern of larger magnitude ties to the even one.
    float next = bf16::decode(uint16_t(b + 1));
    float mid = bits_to_float(uint32_t((uint64_t(float_to_bits(v)) + float_to_bits(next)) / 2));
    ASSERT_GT(std::fabs(mid), std::fabs(v));
    EXPECT_EQ(bf16::encode(mid), (b % 2 == 0) ? b : b + 1) << b;
  }
}

// The kernels' branch-free form equals the reference rule on every non-negative finite float of a
// dense sweep: every exponent field with the mantissas around the 1.75 boundary and both ends,
// and every 61st bit pattern besides (about 35 million values).
TEST(ScaleExponent, E4m3FastFormEqualsTheRule) {
  constexpr uint32_t kFiniteEnd = 0x7F800000u;
  int64_t checked = 0, mismatched = 0;
  auto check = [&](uint32_t bits) {
    const float a = bits_to_float(bits);
    ++checked;
    const int rule = scale_exponent_up(a, e4m3::kMax);
    if (scale_exponent_up_e4m3(a) != rule && ++mismatched <= 5)
      ADD_FAILURE() << "amax bits " << std::hex << bits;
    if (float_to_bits(inverse_scale_e4m3(a)) != float_to_bits(exp2i(-rule)) && ++mismatched <= 5)
      ADD_FAILURE() << "inverse scale, amax bits " << std::hex << bits;
    if (a > 0.0f) {
      const uint32_t field = e4m3_scale_field(a);
      if (scale_exponent_up_e4m3_of_field(field) != rule && ++mismatched <= 5)
        ADD_FAILURE() << "exponent from the field, amax bits " << std::hex << bits;
      if (float_to_bits(inverse_scale_e4m3_of_field(field)) != float_to_bits(exp2i(-rule)) &&
          ++mismatched <= 5)
        ADD_FAILURE() << "inverse scale from the field, amax bits " << std::hex << bits;
      // The 16-bit key: its field is the field, it fits its half word, and it is monotone.
      const uint32_t key = e4m3_scale_key16(a);
      if ((e4m3_scale_field_of_key16(key) != e4m3_scale_field_unclamped(a) || key > 0xFFFFu ||
           e4m3_scale_key16(bits_to_float(bits + 1)) < key) &&
          ++mismatched <= 5)
        ADD_FAILURE() << "16-bit key, amax bits " << std::hex << bits;
      // Monotone: the next larger float's field is never smaller (unclamped, too).
      if ((e4m3_scale_field(bits_to_float(bits + 1)) < field ||
           e4m3_scale_field_unclamped(bits_to_float(bits + 1)) < e4m3_scale_field_unclamped(a)) &&
          ++mismatched <= 5)
        ADD_FAILURE() << "field decreases after amax bits " << std::hex << bits;
    }
  };
  for (uint32_t exp = 0; exp < 255; ++exp)
    for (uint32_t mant : {0u, 1u, 0x5FFFFFu, 0x600000u, 0x600001u, 0x7FFFFFu})
      check((exp << kFloatMantissaBits) | mant);
  for (uint32_t bits = 0; bits < kFiniteEnd; bits += 61) check(bits);
  EXPECT_EQ(mismatched, 0) << "of " << checked;
  // amax 0 (an all-zero row): a finite multiplier, so its zeros still quantize to zero codes.
  EXPECT_TRUE(std::isfinite(inverse_scale_e4m3_of_field(e4m3_scale_field(0.0f))));
  EXPECT_TRUE(std::isfinite(exp2i(scale_exponent_up_e4m3_of_field(e4m3_scale_field(0.0f)))));
}

TEST(ScaleExponent, RoundUpIsSmallestExponentWithoutClamp) {
  auto check = [](float amax) {
    int e = scale_exponent_up(amax, e4m3::kMax);
    double a = amax;
    EXPECT_LE(a, 448.0 * std::ldexp(1.0, e)) << amax;
    if (e > -127) EXPECT_GT(a, 448.0 * std::ldexp(1.0, e - 1)) << amax;
  };
  for (int k = -140; k <= 120; ++k) {
    float p = std::ldexp(1.0f, k);
    check(p);
    check(std::nextafter(p, 0.0f));
    if (k < 119 && k > -120) {
      float edge = 448.0f * std::ldexp(1.0f, k);
      EXPECT_EQ(scale_exponent_up(edge, e4m3::kMax), k);  // exactly 448 * 2^k fits
      EXPECT_EQ(scale_exponent_up(std::nextafter(edge, std::numeric_limits<float>::infinity()),
                                  e4m3::kMax),
                k + 1);
      check(std::nextafter(edge, 0.0f));
    }
  }
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> m(0.5f, 1.0f);
  std::uniform_int_distribution<int> x(-149, 127);
  for (int i = 0; i < 100000; ++i) check(std::ldexp(m(rng), x(rng)));
  check(std::numeric_limits<float>::denorm_min());
  EXPECT_EQ(scale_exponent_up(0.0f, e4m3::kMax), kZeroGroupExponent);
  EXPECT_EQ(scale_exponent_up(std::numeric_limits<float>::denorm_min(), e4m3::kMax), -127);
  EXPECT_EQ(scale_exponent_up(6.0f * 448.0f, 6.0f * 448.0f), 0);
}

TEST(ScaleExponent, FloorPutsAmaxInTopBinadeAndCanExceed448) {
  for (float amax : {1.0f, 300.0f, 448.0f, 449.0f, 511.0f, 1e-3f, 7e20f}) {
    int e = scale_exponent_floor(amax);
    double r = amax / std::ldexp(1.0, e);
    EXPECT_GE(r, 256.0);
    EXPECT_LT(r, 512.0);
  }
  EXPECT_EQ(scale_exponent_floor(480.0f), 0);  // 480 / 2^0 > 448: clamps
  EXPECT_EQ(scale_exponent_up(480.0f, e4m3::kMax), 1);
}

}  // namespace
}  // namespace flamia
