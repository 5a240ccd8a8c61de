// An owning device allocation (cudaMalloc / cudaFree), movable, for host code that stages data on
// the GPU: the quantizer's host convenience, GPU tests and benchmarks.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "check.h"

namespace flamia::cuda {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes > 0) FLAMIA_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);  // a destructor cannot throw; errors surface elsewhere
  }

  template <typename T = void>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

  template <typename T>
  static DeviceBuffer upload(const std::vector<T>& host) {
    DeviceBuffer b(host.size() * sizeof(T));
    if (!host.empty())
      FLAMIA_CUDA_CHECK(cudaMemcpy(b.ptr_, host.data(), b.bytes_, cudaMemcpyHostToDevice));
    return b;
  }
  // Ordered in `stream`: a cudaMemcpy from pageable memory returns once the data is staged and
  // lands later, through the legacy default stream, which a non-blocking stream's next kernel
  // does not wait for. The asynchronous copy stages pageable memory before it returns, so `host`
  // may go at once.
  template <typename T>
  static DeviceBuffer upload(const std::vector<T>& host, cudaStream_t stream) {
    DeviceBuffer b(host.size() * sizeof(T));
    if (!host.empty())
      FLAMIA_CUDA_CHECK(
          cudaMemcpyAsync(b.ptr_, host.data(), b.bytes_, cudaMemcpyHostToDevice, stream));
    return b;
  }
  template <typename T>
  std::vector<T> download() const {
    std::vector<T> host(bytes_ / sizeof(T));
    if (!host.empty())
      FLAMIA_CUDA_CHECK(
          cudaMemcpy(host.data(), ptr_, host.size() * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace flamia::cuda
