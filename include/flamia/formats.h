// Bit-exact number formats shared by the CPU quantizer, the CPU emulator and the GPU kernels.
//
// Every function here is plain integer and IEEE-float arithmetic with no fused multiply-add and no
// dependence on the rounding mode, so host and device give the same bits.
//
//   E4M3  OCP E4M3FN: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; NaN =
//   S.1111.111;
//         max 448, min normal 2^-6, min subnormal 2^-9.
//   E2M1  FP4: 1 sign, 2 exponent (bias 1), 1 mantissa bit: magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}.
//   UE8M0 unsigned exponent byte: value 2^(b - 127); 0xFF is NaN.
//   BF16  1 sign, 8 exponent, 7 mantissa bits.
#pragma once

#include <cstdint>
#include <cstring>

#include "flamia/common.h"

namespace flamia {

FLAMIA_HD uint32_t float_to_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

FLAMIA_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

constexpr uint32_t kFloatAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kFloatInfBits = 0x7F800000u;
constexpr uint32_t kFloatQuietNaN = 0x7FC00000u;
constexpr int kFloatMantissaBits = 23;
constexpr uint32_t kFloatMantissaMask = (1u << kFloatMantissaBits) - 1;
constexpr int kFloatBias = 127;

FLAMIA_HD bool is_finite_float(float x) {
  return (float_to_bits(x) & kFloatAbsMask) < kFloatInfBits;
}

// Exact 2^e for e in [-149, 127] (float subnormals included), built from bits.
FLAMIA_HD float exp2i(int e) {
  if (e >= 1 - kFloatBias) return bits_to_float(uint32_t(e + kFloatBias) << kFloatMantissaBits);
  return bits_to_float(1u << (e + 149));
}

// floor(log2 |x|) for finite nonzero x, subnormals included.
FLAMIA_HD int floor_log2(float x) {
  uint32_t a = float_to_bits(x) & kFloatAbsMask;
  int biased = int(a >> kFloatMantissaBits);
  if (biased != 0) return biased - kFloatBias;
  int lead = 31;  // position of the highest set mantissa bit
  while (!((a >> lead) & 1u)) --lead;
  return lead - 149;
}

// Rounds a non-negative float known to be below 2^23 to the nearest integer, ties to even.
FLAMIA_HD uint32_t round_half_even(float q) {
  uint32_t whole = uint32_t(q);
  float frac = q - float(whole);  // exact: q and whole share the binade or whole is 0
  if (frac > 0.5f || (frac == 0.5f && (whole & 1u))) ++whole;
  return whole;
}

// x rounded to `bits` significand bits (1 to 24), nearest with ties away from zero, in float's
// exponent range: the bit pattern rounded at mantissa bit 24 - bits, which steps subnormals by
// the same quantum as that format's and carries into the exponent (up to infinity) as it should.
// NaN and infinities stay as they are.
FLAMIA_HD float round_significand(float x, int bits) {
  const uint32_t u = float_to_bits(x);
  if ((u & kFloatAbsMask) >= kFloatInfBits) return x;
  const int dropped = kFloatMantissaBits + 1 - bits;
  if (dropped <= 0) return x;
  const uint32_t low = (1u << dropped) - 1;
  return bits_to_float((u + (1u << (dropped - 1))) & ~low);
}

namespace bf16 {
struct Bits {
  uint16_t bits;
};
FLAMIA_HD float decode(uint16_t b) {
  return bits_to_float(uint32_t(b) << 16);
}
// Round to nearest even; NaN stays a quiet NaN with the input's sign.
FLAMIA_HD uint16_t encode(float x) {
  uint32_t u = float_to_bits(x);
  if ((u & kFloatAbsMask) > kFloatInfBits) return uint16_t((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
FLAMIA_HD float round(float x) {
  return decode(encode(x));
}
}  // namespace bf16

namespace e4m3 {
constexpr float kMax = 448.0f;
constexpr int kMaxExponent = 8;  // 448 = 1.75 * 2^8
constexpr int kMinNormalExponent = -6;
constexpr int kMinSubnormalExponent = -9;
constexpr uint8_t kMaxCode = 0x7E;  // +448
constexpr uint8_t kNaNCode = 0x7F;  // canonical NaN written for NaN inputs
constexpr uint8_t kSignBit = 0x80;
constexpr int kMantissaBits = 3;
constexpr int kBias = 7;

FLAMIA_HD bool is_nan(uint8_t c) {
  return (c & 0x7F) == 0x7F;
}

FLAMIA_HD float decode(uint8_t c) {
  uint32_t sign = uint32_t(c & kSignBit) << 24;
  uint32_t exponent = (c >> kMantissaBits) & 0xF;
  uint32_t mantissa = c & 0x7;
  if (is_nan(c)) return bits_to_float(kFloatQuietNaN | sign);
  float magnitude;
  if (exponent == 0) {
    magnitude = float(mantissa) * exp2i(kMinSubnormalExponent);
  } else {
    magnitude = bits_to_float((exponent + kFloatBias - kBias) << kFloatMantissaBits |
                              mantissa << (kFloatMantissaBits - kMantissaBits));
  }
  return bits_to_float(float_to_bits(magnitude) | sign);
}

// Round to nearest even with saturation to finite values, as PTX cvt.rn.satfinite.e4m3x2.f32:
// |x| > 448 (infinities included) gives +-448, NaN gives kNaNCode.
FLAMIA_HD uint8_t encode(float x) {
  uint32_t u = float_to_bits(x);
  uint8_t sign = uint8_t((u >> 24) & kSignBit);
  uint32_t a = u & kFloatAbsMask;
  constexpr uint32_t kMaxBits = 0x43E00000u;        // 448.0f
  constexpr uint32_t kMinNormalBits = 0x3C800000u;  // 2^-6
  if (a > kFloatInfBits) return kNaNCode;
  if (a >= kMaxBits) return sign | kMaxCode;
  if (a < kMinNormalBits) {
    // Subnormal range: codes are multiples of 2^-9; a result of 8 is the smallest normal code.
    return sign | uint8_t(round_half_even(bits_to_float(a) * exp2i(-kMinSubnormalExponent)));
  }
  constexpr int kDrop = kFloatMantissaBits - kMantissaBits;
  uint32_t rounded = (a + ((1u << (kDrop - 1)) - 1) + ((a >> kDrop) & 1u)) >> kDrop;
  uint32_t code = rounded - (uint32_t(kFloatBias - kBias) << kMantissaBits);
  return sign | uint8_t(code > kMaxCode ? kMaxCode : code);
}

// Smallest positive code whose value is >= a, for 0 <= a <= 448 (a scale rounded up, so the
// values it divides never exceed their format's maximum).
FLAMIA_HD uint8_t encode_up(float a) {
  uint8_t c = encode(a);
  if (decode(c) < a) ++c;
  return c;
}
}  // namespace e4m3

namespace e2m1 {
constexpr float kMax = 6.0f;
constexpr uint8_t kMaxCode = 0x7;
constexpr uint8_t kSignBit = 0x8;

FLAMIA_HD float decode(uint8_t c) {
  uint32_t magnitude_code = c & 0x7;
  uint32_t exponent = magnitude_code >> 1;
  uint32_t mantissa = magnitude_code & 1;
  float magnitude = exponent == 0 ? 0.5f * float(mantissa)
                                  : (1.0f + 0.5f * float(mantissa)) * exp2i(int(exponent) - 1);
  return (c & kSignBit) ? -magnitude : magnitude;
}

// Round to nearest, ties to the even code, of x / scale, with saturation to +-6; compares |x|
// against the exact midpoints m * scale, so no rounded quotient is formed. scale must be positive
// and such that 5 * scale is exact (true for E4M3 times a power of two). NaN gives +6.
FLAMIA_HD uint8_t encode_scaled(float x, float scale) {
  float a = bits_to_float(float_to_bits(x) & kFloatAbsMask);
  uint8_t sign = (float_to_bits(x) >> 31) ? kSignBit : 0;
  if (!(a == a)) return kMaxCode;
  // Midpoints between neighbouring magnitudes; a tie goes to the even code, i.e. rounds down when
  // the lower neighbour's code is even (codes 0, 2, 4, 6) and up otherwise.
  constexpr float kMid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  uint8_t code = 0;
  for (int i = 0; i < 7; ++i) {
    float m = kMid[i] * scale;
    bool lower_even = (i & 1) == 0;
    if (a > m || (a == m && !lower_even)) code = uint8_t(i + 1);
  }
  return code == 0 ? 0 : uint8_t(sign | code);
}
FLAMIA_HD uint8_t encode(float x) {
  return encode_scaled(x, 1.0f);
}
}  // namespace e2m1

namespace ue8m0 {
constexpr int kBias = 127;
constexpr int kMinExponent = -127;
constexpr int kMaxExponent = 127;
constexpr uint8_t kNaNCode = 0xFF;

FLAMIA_HD float decode(uint8_t b) {
  return b == kNaNCode ? bits_to_float(kFloatQuietNaN) : exp2i(int(b) - kBias);
}
FLAMIA_HD int exponent(uint8_t b) {
  return int(b) - kBias;
}
// Exponents outside [-127, 127] are clamped (a scale rounded up stays safe when clamped down only
// for groups so small that every code is zero or subnormal anyway).
FLAMIA_HD uint8_t from_exponent(int e) {
  e = e < kMinExponent ? kMinExponent : (e > kMaxExponent ? kMaxExponent : e);
  return uint8_t(e + kBias);
}
}  // namespace ue8m0

// Scale-exponent rules (DESIGN §3). amax must be finite and non-negative.
// All-zero groups: zero codes at the smallest finite scale, so that a zero token never sets a
// maximum over exponents that other tokens' codes or folds are taken against (a key tile's tile
// codes, the forward's V reference exponent, dV's dO unit).
constexpr int kZeroGroupExponent = ue8m0::kMinExponent;

// Smallest e in [-127, 127] with amax / 2^e <= max_code: no code ever clamps.
FLAMIA_HD int scale_exponent_up(float amax, float max_code) {
  if (!(amax > 0.0f)) return kZeroGroupExponent;
  int e = floor_log2(amax) - floor_log2(max_code);  // max_code * 2^e is in amax's binade
  if (e < ue8m0::kMinExponent) return ue8m0::kMinExponent;
  if (e > ue8m0::kMaxExponent) return ue8m0::kMaxExponent;
  if (amax > max_code * exp2i(e) && e < ue8m0::kMaxExponent) ++e;
  return e;
}

// scale_exponent_up(amax, e4m3::kMax) without branches, for kernels' inner loops: amax = 1.m 2^E
// exceeds 448 2^(E - 8) = 1.75 2^E exactly when m > 0.75, and the clamp at -127 is the only one
// reachable. tests/test_formats.cc checks it against scale_exponent_up over every binade.
FLAMIA_HD int scale_exponent_up_e4m3(float amax) {
  constexpr uint32_t kSevenEighthsMantissa = 0x600000;  // mantissa field of 1.75
  const uint32_t bits = float_to_bits(amax);
  const int biased = int(bits >> kFloatMantissaBits);
  const int e = biased - kFloatBias - e4m3::kMaxExponent +
                int((bits & kFloatMantissaMask) > kSevenEighthsMantissa);
  const int clamped = e < ue8m0::kMinExponent ? ue8m0::kMinExponent : e;
  return bits == 0 ? kZeroGroupExponent : clamped;
}

// The same in integer operations on amax's bits: adding kCarry carries into the exponent field
// exactly when the mantissa exceeds 0.75, so the field is that of 2^(e + 135); 2^-e's field is then
// 262 minus it, and the clamp e >= -127 is a floor of 8 on the field (2^127 stays a normal float).
namespace e4m3_scale {
constexpr uint32_t kCarry = 0x1FFFFF;  // 0x600000 + kCarry = 0x7FFFFF: 1.75 itself stays
constexpr uint32_t kShift = uint32_t(kFloatBias + e4m3::kMaxExponent);       // e + 135 = field
constexpr uint32_t kMinField = uint32_t(ue8m0::kMinExponent + int(kShift));  // e = -127
constexpr uint32_t kInverseBias = uint32_t(kFloatBias) + kShift;             // 262
}  // namespace e4m3_scale

// The exponent field of 2^(e + 135), e = scale_exponent_up_e4m3(amax), for amax >= 0, floored at
// the field of e's clamp (-127): e4m3_scale::kMinField. It never decreases as amax grows, so the
// field of a maximum is the maximum of the fields: a kernel can reduce fields (integers, from
// kMinField up) and derive the scale once, from the field.
FLAMIA_HD uint32_t e4m3_scale_field_unclamped(float amax) {
  return (float_to_bits(amax) + e4m3_scale::kCarry) >> kFloatMantissaBits;
}
FLAMIA_HD uint32_t e4m3_scale_field(float amax) {
  const uint32_t field = e4m3_scale_field_unclamped(amax);
  return field < e4m3_scale::kMinField ? e4m3_scale::kMinField : field;
}

// A 16-bit key of a finite amax >= 0 whose maximum gives the maximum's unclamped field: the same
// sum shifted by 16 instead of 23 (at most 0x7F9F), monotone in amax, so a kernel can reduce two
// keys per 32-bit word with a per-halfword maximum and shift the result by 7 more.
constexpr uint32_t kE4m3ScaleKeyBits = 16;
FLAMIA_HD uint32_t e4m3_scale_key16(float amax) {
  return (float_to_bits(amax) + e4m3_scale::kCarry) >> kE4m3ScaleKeyBits;
}
FLAMIA_HD uint32_t e4m3_scale_field_of_key16(uint32_t key) {
  return key >> (kFloatMantissaBits - kE4m3ScaleKeyBits);
}

// scale_exponent_up_e4m3 and 2^-scale_exponent_up_e4m3 of an amax > 0 from its field (>=
// kMinField: no clamp left to apply). For amax == 0 they give the clamp's -127 and 2^127 instead of
// kZeroGroupExponent and 1: any finite scale quantizes zeros to zero codes.
FLAMIA_HD int scale_exponent_up_e4m3_of_field(uint32_t field) {
  return int(field) - int(e4m3_scale::kShift);
}
FLAMIA_HD float inverse_scale_e4m3_of_field(uint32_t field) {
  return bits_to_float((e4m3_scale::kInverseBias - field) << kFloatMantissaBits);
}

// 2^-scale_exponent_up_e4m3(amax), the multiplier that quantizes by that scale.
FLAMIA_HD float inverse_scale_e4m3(float amax) {
  return amax == 0.0f ? exp2i(-kZeroGroupExponent)
                      : inverse_scale_e4m3_of_field(e4m3_scale_field(amax));
}

// Baseline "floor" rule: the exponent that puts amax's leading bit at E4M3's largest binade, so
// amax / 2^e lies in [256, 512) and values above 448 clamp.
FLAMIA_HD int scale_exponent_floor(float amax) {
  if (!(amax > 0.0f)) return kZeroGroupExponent;
  int e = floor_log2(amax) - e4m3::kMaxExponent;
  return e < ue8m0::kMinExponent ? ue8m0::kMinExponent
                                 : (e > ue8m0::kMaxExponent ? ue8m0::kMaxExponent : e);
}

// x / 2^e rounded to E4M3, e in [-127, 127]. Multiplying by 2^-e is exact unless the quotient
// falls below float's normal range, far under E4M3's smallest subnormal, where it encodes to zero
// either way.
FLAMIA_HD uint8_t e4m3_quantize(float x, int e) {
  return e4m3::encode(x * exp2i(-e));
}

}  // namespace flamia
