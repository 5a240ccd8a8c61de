// Two of a query's backward row terms in one float, the delta word: D 2^-e_dO rounded to
// kStagedDeltaBits significand bits, whose freed low mantissa bits carry Q's row factor 2^e_q (its
// bit pattern shifted down; a power of two has no bits below its exponent field but the subnormal
// 2^-127's one). The gradient takes the word itself for the delta, so it needs no mask: the row
// factor's bits add less than 2^-14 of a normal delta's magnitude, and below 2^-140 where D is 0.
// The backward kernel and the emulator both stage it (host-and-device), and a host test checks
// every row factor against every kind of delta. A thread's sixteen queries take eight 16-byte loads
// a step where three floats a query took twelve, and a shift per query (docs/PERF.md, item 194).
#pragma once

#include <cstdint>

#include "flamia/common.h"
#include "flamia/formats.h"

namespace flamia {

// Significand bits of D 2^-e_dO as the backward stages it.
constexpr int kStagedDeltaBits = 14;
constexpr int kFloatBits = 32;
// The mantissa bits below D's kept significand, free for the row factor.
constexpr int kRowFactorBits = kFloatMantissaBits - (kStagedDeltaBits - 1);
constexpr int kRowFactorShift = kFloatBits - kRowFactorBits;
constexpr uint32_t kRowFactorMask = (1u << kRowFactorBits) - 1;
// Q's row factors are UE8M0 scales: 2^-127 (the subnormal with bit 22 alone) to 2^127, all of
// whose set bits lie at or above kRowFactorShift.
constexpr int kMinRowFactorExponent = ue8m0::kMinExponent;
constexpr int kMaxRowFactorExponent = ue8m0::kMaxExponent;
static_assert(kRowFactorShift == kFloatMantissaBits + kMinRowFactorExponent + kFloatBias - 1,
              "the smallest row factor's one bit is the lowest one kept");

// delta: D 2^-e_dO (any float); row_factor: 2^e_q, e_q in [kMin, kMaxRowFactorExponent].
FLAMIA_HD float delta_word(float delta, float row_factor) {
  return bits_to_float(float_to_bits(round_significand(delta, kStagedDeltaBits)) |
                       float_to_bits(row_factor) >> kRowFactorShift);
}
FLAMIA_HD float row_factor_of(float word) {
  return bits_to_float(float_to_bits(word) << kRowFactorShift);
}

}  // namespace flamia
