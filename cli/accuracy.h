// `flamia accuracy` as a function, so `flamia demo` can show the same tables.
#pragma once

#include <vector>

#include "problem.h"
#include "table.h"

namespace flamia::cli {

struct AccuracyRun {
  std::vector<Recipe> recipes;
  ScalePolicy policy = ScalePolicy::kToken;
  bool hadamard = false;
};

// Two tables: accuracy against FP64 and the diagnostics (underflow, dS rounding, row residual).
std::vector<Table> accuracy_tables(const Problem& problem, const AccuracyRun& run);

}  // namespace flamia::cli
