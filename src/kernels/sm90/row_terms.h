// Two of a query's backward row terms in one float: D 2^-e_dO rounded to kStagedDeltaBits
// significand bits, whose freed low mantissa bits carry Q's row factor 2^e_q (its bit pattern
// shifted down; a power of two has no bits below its exponent field but the subnormal 2^-127's
// one). Host-and-device, so a host test can check every row factor against every kind of delta.
// The gradient step reads a query's row terms as two floats where three took twelve 16-byte loads
// for a thread's sixteen queries; the unpacking costs a shift and a mask (docs/PERF.md, item 194).
#pragma once

#include <cstdint>

#include "flamia/common.h"
#include "flamia/emulator.h"
#include "flamia/formats.h"

namespace flamia::sm90::bwd {

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
FLAMIA_HD float pack_delta_row_factor(float delta, float row_factor) {
  return bits_to_float(float_to_bits(round_significand(delta, kStagedDeltaBits)) |
                       float_to_bits(row_factor) >> kRowFactorShift);
}
FLAMIA_HD float unpack_row_factor(float packed) {
  return bits_to_float(float_to_bits(packed) << kRowFactorShift);
}
FLAMIA_HD float unpack_delta(float packed) {
  return bits_to_float(float_to_bits(packed) & ~kRowFactorMask);
}

}  // namespace flamia::sm90::bwd
