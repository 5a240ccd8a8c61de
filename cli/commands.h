// The `flamia` subcommands. Each takes the full argv and the index of its first own argument and
// returns the process exit status.
#pragma once

#include "flamia/device.h"

namespace flamia::cli {

int cmd_demo(int argc, char** argv, int first);
int cmd_accuracy(int argc, char** argv, int first);
int cmd_probe(int argc, char** argv, int first);
int cmd_bench(int argc, char** argv, int first);

#if defined(FLAMIA_HAVE_CUDA)
// GPU benchmarks, `flamia bench <kind>`; built only with CUDA.
int bench_attention(int argc, char** argv, int first);  // cli/bench_attention.cc
int bench_gemm(int argc, char** argv, int first);       // cli/bench_gemm.cc
int bench_quantize(int argc, char** argv, int first);   // cli/bench_quantize.cc
// The device a benchmark times on, or flamia::Error with why there is none (cli/bench.cc). Each
// kind asks once its options are checked, so that a bad option is reported on any machine.
DeviceInfo bench_device();
#endif

}  // namespace flamia::cli
