#include "check.h"
#include "random_fill.h"

namespace flamia::cuda {
namespace {

constexpr int kFillThreads = 256;
constexpr int kFillBlocksPerSm = 8;

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// BF16 fields: sign bit, 8 exponent bits (bias 127), 7 mantissa bits.
constexpr int kSignShift = 15;
constexpr int kExponentShift = 7;
constexpr uint32_t kMantissaMask = 0x7F;
constexpr int kBias = 127;
constexpr int kBinades = 8;  // magnitudes in [2^-4, 2^4)
constexpr int kLowestBinade = -4;

__global__ void fill_kernel(uint16_t* dst, int64_t count, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t h = splitmix64(seed ^ splitmix64(uint64_t(i)));
    const uint32_t sign = uint32_t(h & 1u);
    const uint32_t mantissa = uint32_t(h >> 1) & kMantissaMask;
    const uint32_t exponent = uint32_t(kBias + kLowestBinade + int((h >> 8) % kBinades));
    dst[i] = uint16_t(sign << kSignShift | exponent << kExponentShift | mantissa);
  }
}

}  // namespace

void fill_random_bf16(uint16_t* dst, int64_t count, uint64_t seed, cudaStream_t stream) {
  if (count <= 0) return;
  int device = 0, sms = 0;
  FLAMIA_CUDA_CHECK(cudaGetDevice(&device));
  FLAMIA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t needed = (count + kFillThreads - 1) / kFillThreads;
  const int blocks =
      int(needed < int64_t(sms) * kFillBlocksPerSm ? needed : sms * kFillBlocksPerSm);
  fill_kernel<<<blocks, kFillThreads, 0, stream>>>(dst, count, seed);
  FLAMIA_CUDA_CHECK_LAUNCH();
}

}  // namespace flamia::cuda
