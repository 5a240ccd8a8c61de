// SdpaProblem's geometry, shared by the cuDNN peer and its stand-in of builds without cuDNN.
#include <algorithm>

#include "cudnn_sdpa.h"

namespace flamia::bench {

const char* to_string(CudnnLayout l) {
  return l == CudnnLayout::kRagged ? "ragged" : "padded";
}

int64_t SdpaProblem::tokens() const {
  int64_t t = 0;
  for (int64_t d : docs) t += d;
  return t;
}

int64_t SdpaProblem::max_len() const {
  return docs.empty() ? 0 : *std::max_element(docs.begin(), docs.end());
}

int64_t SdpaProblem::rows(CudnnLayout layout) const {
  return layout == CudnnLayout::kRagged ? tokens() : int64_t(docs.size()) * max_len();
}

}  // namespace flamia::bench
