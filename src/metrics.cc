#include "flamia/metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace flamia {
namespace {

template <typename T>
Similarity compare_impl(const std::vector<T>& got, const std::vector<double>& ref) {
  if (got.size() != ref.size())
    throw Error("compare: sizes differ (" + std::to_string(got.size()) + " vs " +
                std::to_string(ref.size()) + ")");
  double dot = 0, na = 0, nr = 0, nd = 0, mx = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double a = got[i], r = ref[i], d = a - r;
    dot += a * r;
    na += a * a;
    nr += r * r;
    nd += d * d;
    // NaN must propagate into the report, and std::max would drop it.
    mx = (std::fabs(d) > mx || std::isnan(d)) ? std::fabs(d) : mx;
  }
  Similarity s;
  s.cosine = dot / std::sqrt(na * nr);
  s.rel_l2 = std::sqrt(nd / nr);
  s.max_abs_err = mx;
  return s;
}

double fraction(int64_t part, int64_t whole) {
  return whole > 0 ? double(part) / double(whole) : 0.0;
}

}  // namespace

Similarity compare(const std::vector<float>& got, const std::vector<double>& ref) {
  return compare_impl(got, ref);
}
Similarity compare(const std::vector<double>& got, const std::vector<double>& ref) {
  return compare_impl(got, ref);
}

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  const double pos = q * double(v.size() - 1);
  const size_t lo = size_t(std::floor(pos)), hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - double(lo)) * (v[hi] - v[lo]);
}

AccuracyReport accuracy_report(const EmulatorResult& got, const AttentionOutputs<double>& ref) {
  AccuracyReport r;
  r.o = compare(got.out.o, ref.o);
  if (!got.out.dq.empty()) {
    r.dq = compare(got.out.dq, ref.dq);
    r.dk = compare(got.out.dk, ref.dk);
    r.dv = compare(got.out.dv, ref.dv);
  }
  for (size_t i = 0; i < ref.lse.size(); ++i)
    if (std::isfinite(ref.lse[i]))
      r.lse_max_err = std::max(r.lse_max_err, double(std::fabs(got.out.lse[i] - ref.lse[i])));
  const EmulatorStats& s = got.stats;
  r.ds_zero_fraction_dq = fraction(s.ds_zero_dq, s.ds_nonzero);
  r.ds_zero_fraction_dk = fraction(s.ds_zero_dk, s.ds_nonzero);
  r.p_underflow_fraction = fraction(s.p_underflow, s.p_entries);
  r.residual_p50 = quantile(s.row_residual, 0.5);
  r.residual_p99 = quantile(s.row_residual, 0.99);
  r.residual_max = quantile(s.row_residual, 1.0);
  for (int op = 0; op < kNumOperands; ++op)
    r.operand_underflow_fraction[op] = fraction(s.operand_underflow[op], s.operand_nonzero[op]);
  return r;
}

}  // namespace flamia
