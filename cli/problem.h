// Options shared by the accuracy commands (accuracy, probe, demo): the packed batch, the inputs,
// the attention variant and the backend (the CPU emulator, or the sm_90a kernels).
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
  bool tiles_given = false;  // --fwd-tile or --bwd-tile on the command line
  std::string backend;
};

// The option table; `docs` is the default document list, `backend` the default backend.
std::vector<OptionSpec> problem_options(const std::string& docs, int heads, int dim,
                                        const std::string& backend = "cpu");
Problem parse_problem(const Args& args);
// What the GPU forward runs besides the problem itself.
struct GpuVariant {
  Recipe recipe = Recipe::kMxfp8;
  ScalePolicy policy = ScalePolicy::kToken;
  bool hadamard = false;
  bool deterministic = false;  // the backward's dQ summed in key-block order (bitwise reproducible)
};

// Throws Error unless the backend can run `variants`: "cpu" always; "cuda" when flamia was built
// with CUDA, the kernels implement every variant (require_gpu_support) and a Hopper GPU is present,
// checked in that order so the message names the first obstacle.
void require_backend(const Problem& p, const std::vector<GpuVariant>& variants);
// Whether the GPU kernels implement the variant on this problem (recipe, policy, head dim); when
// not, `reason` gets why. Needs no GPU. False with the reason in a build without CUDA.
bool gpu_supports(const Problem& p, const GpuVariant& v, std::string* reason);
// Throws Error naming the variant and the reason unless gpu_supports.
void require_gpu_support(const Problem& p, const GpuVariant& v);
// The training call on the GPU (forward, then backward; flamia/attention_gpu.h): O, LSE, dQ, dK,
// dV, and the backward's statistics in `diagnostics` (its backward fields). With Hadamard
// rotation (no GPU backward) only the forward runs: dQ, dK, dV stay empty. Synchronises.
AttentionOutputs<float> gpu_training(const AttentionBatch& batch, const Problem& p,
                                     const GpuVariant& v, EmulatorStats* diagnostics);
// The fraction of visible S entries whose backward recomputation differs bitwise from the
// forward's (score_consistency_to_host); synchronises.
double gpu_score_mismatch(const AttentionBatch& batch, const Problem& p, const GpuVariant& v);
// The tiles with which the emulator reproduces the GPU kernels (kGpuForwardTiles,
// kGpuBackwardTiles).
TileShape gpu_forward_tiles();
TileShape gpu_backward_tiles();

AttentionBatch make_batch(const Problem& p);
std::string describe(const Problem& p);  // one line: documents, heads, dim, inputs, mask

}  // namespace flamia::cli
