#include <iostream>

#include "commands.h"

namespace flamia::cli {

// Placeholder until the gemm benchmark lands (issue 4).
int bench_gemm(int, char**, int) {
  std::cerr << "flamia bench gemm: not built yet\n";
  return 2;
}

}  // namespace flamia::cli
