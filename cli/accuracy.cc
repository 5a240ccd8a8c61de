#include <iostream>

#include "commands.h"

namespace flamia::cli {

// Placeholders until the emulator lands (issue 3).
int cmd_demo(int, char**, int) {
  std::cerr << "flamia demo: not built yet\n";
  return 2;
}
int cmd_accuracy(int, char**, int) {
  std::cerr << "flamia accuracy: not built yet\n";
  return 2;
}
int cmd_probe(int, char**, int) {
  std::cerr << "flamia probe: not built yet\n";
  return 2;
}

}  // namespace flamia::cli
