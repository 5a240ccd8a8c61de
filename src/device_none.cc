// The device query of a build without nvcc.
#include "flamia/device.h"

namespace flamia {

bool built_with_cuda() {
  return false;
}

DeviceInfo query_device() {
  DeviceInfo info;
  info.reason = "flamia was built without CUDA (nvcc was not found at configure time)";
  return info;
}

}  // namespace flamia
