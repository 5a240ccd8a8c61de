// Which GPU backend is usable here. Never throws: without a CUDA build or a Hopper GPU, `available`
// is false and `reason` says why, so front ends can print it and tests can skip.
#pragma once

#include <string>

namespace flamia {

struct DeviceInfo {
  bool available = false;  // built with CUDA and an sm_90 device is present
  std::string name;
  int sm_major = 0, sm_minor = 0;
  int multiprocessors = 0;
  std::string reason;  // why not available
};

bool built_with_cuda();
DeviceInfo query_device();

}  // namespace flamia
