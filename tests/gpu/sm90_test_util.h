// Helpers of the sm_90 primitive tests: an owning device buffer with upload/download/poison, and a
// checked launch-then-sync.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "check.h"

namespace flamia::test {

template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t count) : count_(count) {
    FLAMIA_CUDA_CHECK(cudaMalloc(&ptr_, bytes()));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr_); }

  T* get() const { return ptr_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

  void upload(const std::vector<T>& host) {
    FLAMIA_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), bytes(), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    FLAMIA_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, bytes(), cudaMemcpyDeviceToHost));
    return host;
  }
  // Fills every byte, so unwritten outputs stay recognisable (0xFF: NaN for f32 and bf16).
  void poison(uint8_t byte = kPoisonByte) { FLAMIA_CUDA_CHECK(cudaMemset(ptr_, byte, bytes())); }

  static constexpr uint8_t kPoisonByte = 0xFF;

 private:
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

// After a kernel launch in a test: launch errors and execution errors both fail the test.
inline void sync_checked() {
  FLAMIA_CUDA_CHECK(cudaGetLastError());
  FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace flamia::test
