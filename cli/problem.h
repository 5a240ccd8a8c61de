// Options shared by the CPU-side commands (accuracy, probe, demo): the packed batch, the inputs,
// the attention variant and the backend.
#pragma once

#include <string>
#include <vector>

#include "args.h"
#include "flamia/emulator.h"
#include "flamia/inputs.h"

namespace flamia::cli {

struct Problem {
  std::vector<int64_t> docs;
  int heads = 0, kv_heads = 0, dim = 0;
  InputSpec inputs;
  AttentionConfig attention;
  TileShape forward, backward;
  std::string backend;
};

// The option table; `docs` is the default document list.
std::vector<OptionSpec> problem_options(const std::string& docs, int heads, int dim);
Problem parse_problem(const Args& args);
// Throws Error unless the backend is usable ("cpu" always; "cuda" once the GPU kernels land).
void require_backend(const Problem& p);
AttentionBatch make_batch(const Problem& p);
std::string describe(const Problem& p);  // one line: documents, heads, dim, inputs, mask

}  // namespace flamia::cli
