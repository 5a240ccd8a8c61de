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
  // nvidia-smi's form of the device's UUID: which of several machines of one kind ran a benchmark
  // (they differ by a few percent). Empty without a device.
  std::string uuid;
  std::string reason;  // why not available
};

// A CUDA device UUID's 16 bytes as nvidia-smi prints them: "GPU-", then 32 hex digits grouped
// 8-4-4-4-12.
inline std::string gpu_uuid_string(const unsigned char (&bytes)[16]) {
  static const char kHex[] = "0123456789abcdef";
  std::string s = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
    s += kHex[bytes[i] >> 4];
    s += kHex[bytes[i] & 0xF];
  }
  return s;
}

bool built_with_cuda();
DeviceInfo query_device();

}  // namespace flamia
