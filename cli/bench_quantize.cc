#include <iostream>

#include "commands.h"

namespace flamia::cli {

// Placeholder until the quantize benchmark lands (issue 4).
int bench_quantize(int, char**, int) {
  std::cerr << "flamia bench quantize: not built yet\n";
  return 2;
}

}  // namespace flamia::cli
