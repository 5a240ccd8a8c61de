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
