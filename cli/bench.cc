#include <cstring>
#include <iostream>
#include <string>

#include "commands.h"
#include "flamia/common.h"
#include "flamia/device.h"

namespace flamia::cli {

namespace {
const char* kBenchUsage =
    "usage: flamia bench <kind> [options]\n"
    "\n"
    "kinds:\n"
    "  gemm       FP8 GEMM test vehicle of the sm_90a primitives, next to cuBLASLt\n"
    "  quantize   fused GPU quantizer throughput, next to a device-to-device copy\n"
    "\n"
    "`flamia bench <kind> --help` lists a kind's options.\n";
}  // namespace

int cmd_bench(int argc, char** argv, int first) {
  if (first >= argc || !std::strcmp(argv[first], "--help") || !std::strcmp(argv[first], "-h")) {
    std::cout << kBenchUsage;
    return first >= argc ? 2 : 0;
  }
  const std::string kind = argv[first];
#if defined(FLAMIA_HAVE_CUDA)
  if (kind == "gemm") return bench_gemm(argc, argv, first + 1);
  if (kind == "quantize") return bench_quantize(argc, argv, first + 1);
  std::cerr << "flamia bench: unknown kind '" << kind << "'\n\n" << kBenchUsage;
  return 2;
#else
  (void)kind;
  std::cerr << "flamia bench: " << query_device().reason << "\n";
  return 2;
#endif
}

}  // namespace flamia::cli
