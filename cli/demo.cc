// `flamia demo`: the accuracy and probe tables on a small packed batch, with what they show.
#include <chrono>
#include <iostream>

#include "accuracy.h"
#include "commands.h"
#include "flamia/device.h"
#include "probe.h"

namespace flamia::cli {
namespace {

const char* kExplanation = R"(What the tables show
- Accuracy: each recipe runs through the CPU emulator of flamia's algorithm (the computation the
  GPU kernels perform, tile by tile) and is compared with FP64 attention on the same BF16 inputs.
  mxfp8 runs all six attention products on E4M3 with one power-of-two scale per token; the paper's
  MXFP8 reaches cosine 0.9988 (O) / 0.9979 (dQ). mxfp8-qk16 keeps the score product Q K^T in BF16,
  which removes the dominant error; nvfp4-mixed puts Q and K in 4 bits for the scores.
- Diagnostics: how many probabilities (P~) and score gradients (dS) round to zero in E4M3, and the
  row residual |sum_j dS_ij| / sum_j |dS_ij| (0 for exact softmax gradients).
- Probe: the causality contract. A query must not be influenced, through a quantization scale,
  by tokens the causal mask hides from it, by other documents, or by where its document sits in
  the packed buffer. The longest document's suffix is perturbed (also across scale exponents and
  the E4M3 subnormal boundary) and the prefix's O, LSE and dQ are compared bitwise. The default
  `token` policy (one exponent per token) never leaks; `block32` (FLAMIA's 32-token blocks) leaks
  only inside its 31-token residue ("reach"); `tensor`, `floor` and `vgroup16` are the leaky
  baselines.
- With --backend cuda, the [cuda] rows are the GPU training call (forward, then backward: O, LSE,
  dQ, dK, dV), a third table compares it with the emulator run with the kernels' tiles (and counts
  the scores whose backward recomputation differs bitwise from the forward's), and the probe runs
  the training call with the deterministic backward, so dQ is probed too.
)";

}  // namespace

int cmd_demo(int argc, char** argv, int first) {
  // The GPU when one is present (the kernels' head dim, 128), the CPU emulator otherwise.
  std::vector<OptionSpec> specs = problem_options("300,77,650", 2, 128, "auto");
  specs.push_back({"json", "", "print the tables as JSON", true});
  Args args("demo",
            "Accuracy of every recipe against FP64 and the causal-leakage probe of every scale "
            "policy on a small packed batch (documents of 300, 77 and 650 tokens), then what the "
            "tables show. With a Hopper GPU present it runs the GPU training call (the recipes and "
            "policies the kernels implement) next to the emulator; --backend cpu forces the "
            "emulator alone.",
            specs, argc, argv, first);
  if (args.help_requested()) {
    std::cout << args.usage();
    return 0;
  }
  const Problem problem = parse_problem(args);
  const auto t0 = std::chrono::steady_clock::now();
  AccuracyRun acc;  // every recipe the backend runs
  std::vector<Table> tables = accuracy_tables(problem, acc);
  ProbeRun probe;  // every policy the backend runs
  probe.controls.assign(std::begin(kAllProbeControls), std::end(kAllProbeControls));
  tables.push_back(probe_table(problem, probe));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (args.flag("json")) {
    print_json(std::cout, tables);
    return 0;
  }
  std::cout << "flamia demo: " << describe(problem) << "\nbackend: " << problem.backend;
  if (problem.backend == "cpu") std::cout << " (emulator; " << query_device().reason << ")";
  std::cout << "\n\n";
  for (const Table& t : tables) {
    t.print_text(std::cout);
    std::cout << "\n";
  }
  std::cout << kExplanation << "\n(" << fmt(secs, 1) << " s)\n";
  return 0;
}

}  // namespace flamia::cli
