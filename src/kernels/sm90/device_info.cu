#include "check.h"
#include "flamia/device.h"

namespace flamia {

bool built_with_cuda() {
  return true;
}

DeviceInfo query_device() {
  DeviceInfo info;
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    info.reason = e != cudaSuccess ? std::string("no usable CUDA device: ") + cudaGetErrorString(e)
                                   : std::string("no CUDA device present");
    cudaGetLastError();  // clear the sticky-free error state of the failed query
    return info;
  }
  int dev = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
    info.reason = "cudaGetDeviceProperties failed";
    cudaGetLastError();
    return info;
  }
  info.name = prop.name;
  info.sm_major = prop.major;
  info.sm_minor = prop.minor;
  info.multiprocessors = prop.multiProcessorCount;
  static_assert(sizeof(prop.uuid.bytes) == 16, "a CUDA UUID is 16 bytes");
  info.uuid = gpu_uuid_string(reinterpret_cast<const unsigned char(&)[16]>(prop.uuid.bytes));
  if (prop.major != 9 || prop.minor != 0) {
    info.reason = std::string(prop.name) + " is sm_" + std::to_string(prop.major) +
                  std::to_string(prop.minor) + "; flamia's kernels are built for sm_90a (Hopper)";
    return info;
  }
  info.available = true;
  return info;
}

}  // namespace flamia
