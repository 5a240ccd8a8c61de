// The cuDNN peer of a build without the cuDNN frontend headers or cudnn.h: every build reports why.
#include "cudnn_sdpa.h"

namespace flamia::bench {

namespace {
const char* kWhy =
    "flamia was built without the cuDNN frontend headers or cudnn.h (run scripts/fetch-deps.sh, "
    "set FLAMIA_CUDNN_ROOT, and reconfigure)";
}

std::string cudnn_status() {
  return kWhy;
}
std::string cudnn_version() {
  return "unavailable";
}
const char* to_string(CudnnLayout l) {
  return l == CudnnLayout::kRagged ? "ragged" : "padded";
}

int64_t SdpaProblem::tokens() const {
  int64_t t = 0;
  for (int64_t d : docs) t += d;
  return t;
}
int64_t SdpaProblem::max_len() const {
  int64_t m = 0;
  for (int64_t d : docs) m = d > m ? d : m;
  return m;
}
int64_t SdpaProblem::rows(CudnnLayout layout) const {
  return layout == CudnnLayout::kRagged ? tokens() : int64_t(docs.size()) * max_len();
}

struct CudnnSdpa::Impl {};
CudnnSdpa::CudnnSdpa(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudnnSdpa::~CudnnSdpa() = default;
CudnnLayout CudnnSdpa::layout() const {
  return CudnnLayout::kRagged;
}
size_t CudnnSdpa::workspace_bytes() const {
  return 0;
}
void CudnnSdpa::forward(const SdpaBuffers&, void*) const {}
void CudnnSdpa::backward(const SdpaBuffers&, void*) const {}

std::unique_ptr<CudnnSdpa> CudnnSdpa::build(const SdpaProblem&, CudnnPrecision, CudnnLayout,
                                            cudaStream_t, std::string* reason) {
  *reason = kWhy;
  return nullptr;
}

}  // namespace flamia::bench
