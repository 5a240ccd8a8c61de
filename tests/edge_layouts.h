// Document layouts at the quantizer's edges, shared by the GPU quantizer's tests and the host
// simulation of its index arithmetic (test_quantize_geometry.cc), so both cover the same cases:
// empty and one-token documents, lengths around 16 and 128 (the codes_t group and the tile),
// documents ending at and across tile edges, and runs of equal short documents.
#pragma once

#include <cstdint>
#include <vector>

namespace flamia::testlayouts {

inline std::vector<std::vector<int64_t>> unaligned_and_empty_documents() {
  return {
      {0, 1, 15, 16, 17, 31, 33, 129},
      {5, 0, 1, 15, 16, 17, 31, 33, 129, 0},
      {129, 33, 31, 17, 16, 15, 1, 0, 7},
      {1},
      {17},
      {128},
      {256},
      {0, 0, 0, 300},
      {300, 0, 0, 0},
      {120, 130, 6, 250, 0, 1, 0, 255, 2},  // documents ending at and across tile edges
      {127, 1, 126, 2, 125, 3, 124, 4, 257},
      {0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0},
      std::vector<int64_t>(300, 1),
      std::vector<int64_t>(37, 17),
  };
}

}  // namespace flamia::testlayouts
