// `flamia probe` as a function, so `flamia demo` can show the same table.
#pragma once

#include <vector>

#include "flamia/probe.h"
#include "problem.h"
#include "table.h"

namespace flamia::cli {

struct ProbeRun {
  std::vector<ScalePolicy> policies;  // empty: every policy the backend runs
  std::vector<ProbeControl> controls;
  Recipe recipe = Recipe::kMxfp8;
  bool hadamard = false;
  int target_doc = -1, prefix_end = -1;
};

// The policies `run` asks for on `problem`'s backend: run.policies, or when empty every policy
// (cpu) or every policy the GPU kernels implement with run.recipe (cuda; Error if there is none).
std::vector<ScalePolicy> resolve_policies(const Problem& problem, const ProbeRun& run);

// One row per policy and control. The cuda backend probes the GPU training call with the
// deterministic backward: O, LSE and dQ.
Table probe_table(const Problem& problem, const ProbeRun& run);

}  // namespace flamia::cli
