// Orthonormal Walsh-Hadamard rotation along the head dimension (n = 64 or 128).
//
// H_n (Sylvester order) is symmetric and H_n H_n = n I, so R = H_n / sqrt(n) is orthonormal and
// its own inverse: (Q R)(K R)^T = Q K^T, and dQ = dQ_rot R. The butterflies run in stages of
// increasing span, then one multiply by 1/sqrt(n); any implementation with the same stages (the
// GPU quantizer's included) gives the same bits, since each stage is a fixed set of a+b, a-b.
#pragma once

#include "flamia/common.h"

namespace flamia {

template <typename T>
FLAMIA_HD T hadamard_scale(int n) {
  // 1/sqrt(64) is exact; 1/sqrt(128) = 2^-3.5 is written with enough digits to round correctly
  // to float and to double.
  return n == 64 ? T(0.125) : T(0.08838834764831844055010554526310612991);
}

template <typename T>
FLAMIA_HD void hadamard_rotate(T* x, int n) {
  for (int span = 1; span < n; span *= 2) {
    for (int base = 0; base < n; base += 2 * span) {
      for (int j = base; j < base + span; ++j) {
        T a = x[j], b = x[j + span];
        x[j] = a + b;
        x[j + span] = a - b;
      }
    }
  }
  T s = hadamard_scale<T>(n);
  for (int j = 0; j < n; ++j) x[j] = x[j] * s;
}

}  // namespace flamia
