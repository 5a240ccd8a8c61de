// CUDA error checking for host code: every runtime/driver call goes through one of these, and a
// failure becomes a flamia::Error naming the call, the file and line, and CUDA's message.
#pragma once

#include <cublasLt.h>
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "flamia/common.h"

namespace flamia::cuda {

[[noreturn]] inline void fail(const char* expr, const char* file, int line, const char* what) {
  throw Error(std::string("CUDA error in ") + expr + " at " + file + ":" + std::to_string(line) +
              ": " + what);
}

inline void check(cudaError_t e, const char* expr, const char* file, int line) {
  if (e != cudaSuccess) fail(expr, file, line, cudaGetErrorString(e));
}

// Driver results come from entry points fetched through the runtime (cudaGetDriverEntryPoint):
// linking libcuda itself would keep every binary from starting on a machine without a driver.
inline void check(CUresult r, const char* expr, const char* file, int line) {
  if (r != CUDA_SUCCESS) fail(expr, file, line, ("driver error " + std::to_string(int(r))).c_str());
}

// cuBLAS / cuBLASLt status (the benchmark's peer).
inline void check(cublasStatus_t s, const char* expr, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS) fail(expr, file, line, cublasLtGetStatusString(s));
}

// For the host's argument checks on device pointers.
inline bool is_aligned(const void* p, size_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

}  // namespace flamia::cuda

#define FLAMIA_CUDA_CHECK(expr) ::flamia::cuda::check((expr), #expr, __FILE__, __LINE__)
// After a kernel launch: launch-configuration errors now, execution errors at the next sync.
#define FLAMIA_CUDA_CHECK_LAUNCH() FLAMIA_CUDA_CHECK(cudaGetLastError())
