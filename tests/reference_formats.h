// Independent definitions of the formats for tests: values from the format's fields in double, and
// brute-force nearest-code search. Nothing here calls the code under test.
#pragma once

#include <cmath>
#include <functional>
#include <limits>

namespace flamia::testref {

inline double e4m3_value(int c) {
  int s = (c >> 7) & 1, e = (c >> 3) & 15, m = c & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -v : v;
}

inline double e2m1_value(int c) {
  int s = (c >> 3) & 1, e = (c >> 1) & 3, m = c & 1;
  double v = e == 0 ? m * 0.5 : std::ldexp(1.0 + m / 2.0, e - 1);
  return s ? -v : v;
}

// Code of `n` codes whose value is nearest to x; ties go to the even code.
inline int nearest_code(double x, int n, const std::function<double(int)>& value,
                        const std::function<bool(int)>& skip) {
  int best = -1;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c < n; ++c) {
    if (skip(c)) continue;
    double err = std::fabs(value(c) - x);
    if (err < best_err || (err == best_err && (c & 1) == 0 && (best & 1) == 1)) {
      best = c;
      best_err = err;
    }
  }
  return best;
}

// Distance from |y| (in code units of E4M3) to its neighbours: half of the code spacing there.
inline double e4m3_half_step(double y) {
  y = std::fabs(y);
  if (y < std::ldexp(1.0, -6)) return std::ldexp(1.0, -10);
  return std::ldexp(1.0, int(std::floor(std::log2(y))) - 4);
}

inline double e2m1_half_step(double y) {
  y = std::fabs(y);
  return y < 2.0 ? 0.25 : (y < 4.0 ? 0.5 : 1.0);
}

}  // namespace flamia::testref
