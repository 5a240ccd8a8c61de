// `flamia accuracy` as a function, so `flamia demo` can show the same tables.
#pragma once

#include <vector>

#include "problem.h"
#include "table.h"

namespace flamia::cli {

struct AccuracyRun {
  std::vector<Recipe> recipes;  // empty: every recipe the backend runs
  ScalePolicy policy = ScalePolicy::kToken;
  bool hadamard = false;
};

// The recipes `run` asks for on `problem`'s backend: run.recipes, or when empty every recipe (cpu)
// or every recipe the GPU kernels implement with run.policy (cuda; Error if there is none).
std::vector<Recipe> resolve_recipes(const Problem& problem, const AccuracyRun& run);

// Accuracy against FP64 and the diagnostics (underflow, dS rounding, row residual). With the cuda
// backend, each recipe's GPU forward (O, LSE) sits next to the emulator run with the kernel's
// tiles, and a third table compares the two.
std::vector<Table> accuracy_tables(const Problem& problem, const AccuracyRun& run);

}  // namespace flamia::cli
