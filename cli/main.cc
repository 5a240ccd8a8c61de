// flamia: microscaled FP8 attention for Hopper. One binary, one subcommand per job.
#include <cstring>
#include <iostream>
#include <string>

#include "commands.h"
#include "flamia/common.h"

namespace {

const char* kUsage =
    "usage: flamia <command> [options]\n"
    "\n"
    "commands:\n"
    "  demo       accuracy and causal-leakage probe on a small packed batch, with explanations\n"
    "  accuracy   cosine / relative L2 of O, dQ, dK, dV against an FP64 reference, per recipe\n"
    "  probe      suffix-perturbation probe of causal leakage, per scale policy\n"
    "  bench      GPU benchmarks (needs a CUDA build and an sm_90 GPU)\n"
    "\n"
    "`flamia <command> --help` lists a command's options.\n";

}  // namespace

int main(int argc, char** argv) {
  using namespace flamia::cli;
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") ||
      !std::strcmp(argv[1], "help")) {
    std::cout << kUsage;
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  try {
    if (cmd == "demo") return cmd_demo(argc, argv, 2);
    if (cmd == "accuracy") return cmd_accuracy(argc, argv, 2);
    if (cmd == "probe") return cmd_probe(argc, argv, 2);
    if (cmd == "bench") return cmd_bench(argc, argv, 2);
    std::cerr << "flamia: unknown command '" << cmd << "'\n\n" << kUsage;
    return 2;
  } catch (const flamia::Error& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
}
