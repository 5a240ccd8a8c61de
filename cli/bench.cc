#include <cstring>
#include <iostream>
#include <string>

#include "commands.h"
#include "flamia/common.h"
#include "flamia/device.h"

namespace flamia::cli {

namespace {
const char* kBenchUsage =
    "usage: flamia bench [kind] [options]\n"
    "\n"
    "kinds:\n"
    "  attention  (default) the nine packed causal workloads: flamia's stages (quantizer;\n"
    "             per recipe forward, backward and training call) next to cuDNN BF16 and\n"
    "             cuDNN FP8 in the same run\n"
    "  gemm       FP8 GEMM test vehicle of the sm_90a primitives, next to cuBLASLt\n"
    "  quantize   fused GPU quantizer throughput, next to a device-to-device copy\n"
    "\n"
    "`flamia bench <kind> --help` lists a kind's options.\n";
}  // namespace

int cmd_bench(int argc, char** argv, int first) {
  if (first < argc && (!std::strcmp(argv[first], "--help") || !std::strcmp(argv[first], "-h"))) {
    std::cout << kBenchUsage;
    return 0;
  }
  // No kind, or options right away: the attention workloads.
  const bool has_kind = first < argc && std::strncmp(argv[first], "--", 2) != 0;
  const std::string kind = has_kind ? argv[first] : "attention";
  const int rest = has_kind ? first + 1 : first;
  if (kind != "attention" && kind != "gemm" && kind != "quantize") {
    std::cerr << "flamia bench: unknown kind '" << kind << "'\n\n" << kBenchUsage;
    return 2;
  }
#if defined(FLAMIA_HAVE_CUDA)
  if (kind == "attention") return bench_attention(argc, argv, rest);
  if (kind == "gemm") return bench_gemm(argc, argv, rest);
  return bench_quantize(argc, argv, rest);
#else
  (void)rest;
  std::cerr << "flamia bench: " << query_device().reason << "\n";
  return 2;
#endif
}

#if defined(FLAMIA_HAVE_CUDA)
DeviceInfo bench_device() {
  DeviceInfo dev = query_device();
  if (!dev.available) throw Error("bench needs a GPU: " + dev.reason);
  return dev;
}
#endif

}  // namespace flamia::cli
