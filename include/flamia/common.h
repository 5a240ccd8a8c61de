// Shared basics of the public API: the host/device function qualifier and the error type.
#pragma once

#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#define FLAMIA_HD __host__ __device__ __forceinline__
#else
#define FLAMIA_HD inline
#endif

namespace flamia {

// Every misuse of the API (bad shape, layout, option, non-finite input the caller asked to reject)
// is reported as a flamia::Error whose message names the argument and the offending value.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error("flamia: " + what) {}
};

}  // namespace flamia
