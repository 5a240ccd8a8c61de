// Accuracy metrics against the FP64 reference (DESIGN §4's report).
#pragma once

#include <cstdint>
#include <vector>

#include "flamia/attention.h"
#include "flamia/emulator.h"

namespace flamia {

struct Similarity {
  double cosine = 0.0;       // <a, r> / (|a| |r|) over the whole tensor
  double rel_l2 = 0.0;       // |a - r| / |r|
  double max_abs_err = 0.0;  // max |a - r|
};

// Throws Error if the sizes differ; NaN anywhere gives NaN metrics (never a pass).
Similarity compare(const std::vector<float>& got, const std::vector<double>& ref);
Similarity compare(const std::vector<double>& got, const std::vector<double>& ref);

// Linear-interpolated quantile q in [0, 1] of the values; NaN for an empty set.
double quantile(std::vector<double> values, double q);

struct AccuracyReport {
  Similarity o, dq, dk, dv;
  double lse_max_err = 0.0;  // max |LSE - LSE_ref| (natural log) over rows with visible keys
  double ds_zero_fraction_dq = 0.0;  // nonzero dS rounded to zero in dQ's product
  double ds_zero_fraction_dk = 0.0;
  double p_underflow_fraction = 0.0;                                  // forward P~ rounded to zero
  double residual_p50 = 0.0, residual_p99 = 0.0, residual_max = 0.0;  // |sum_j dS| / sum_j |dS|
  std::array<double, kNumOperands> operand_underflow_fraction{};
};

AccuracyReport accuracy_report(const EmulatorResult& got, const AttentionOutputs<double>& ref);

}  // namespace flamia
