// The `flamia` subcommands. Each takes the full argv and the index of its first own argument and
// returns the process exit status.
#pragma once

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
#endif

}  // namespace flamia::cli
