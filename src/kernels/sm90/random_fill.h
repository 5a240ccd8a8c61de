// Random device inputs for benchmarks, generated on the GPU (no host round trip for gigabytes).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace flamia::cuda {

// `count` BF16 values, finite and non-zero, of random sign with magnitudes over several binades,
// from a hash of (seed, index): the same seed gives the same values.
void fill_random_bf16(uint16_t* dst, int64_t count, uint64_t seed, cudaStream_t stream);

}  // namespace flamia::cuda
