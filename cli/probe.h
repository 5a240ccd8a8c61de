// `flamia probe` as a function, so `flamia demo` can show the same table.
#pragma once

#include <vector>

#include "flamia/probe.h"
#include "problem.h"
#include "table.h"

namespace flamia::cli {

struct ProbeRun {
  std::vector<ScalePolicy> policies;
  std::vector<ProbeControl> controls;
  Recipe recipe = Recipe::kMxfp8;
  bool hadamard = false;
  int target_doc = -1, prefix_end = -1;
};

Table probe_table(const Problem& problem, const ProbeRun& run);

}  // namespace flamia::cli
