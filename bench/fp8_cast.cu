#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "check.h"
#include "fp8_cast.h"

namespace flamia::bench {
namespace {

constexpr int kThreads = 256;
constexpr int kVector = 8;  // BF16 values per 16-byte load
constexpr int kWaves = 4;   // blocks per SM for the grid-stride loops
constexpr float kE4M3Max = 448.0f;

int grid_for(int64_t work) {
  static const int sms = [] {
    int dev = 0, n = 0;
    FLAMIA_CUDA_CHECK(cudaGetDevice(&dev));
    FLAMIA_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }();
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return int(blocks < int64_t(sms) * kWaves ? (blocks > 0 ? blocks : 1) : int64_t(sms) * kWaves);
}

__global__ void amax_kernel(const uint4* src, int64_t vectors, float* amax) {
  float m = 0.0f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < vectors;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 v = src[i];
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
    for (int k = 0; k < kVector / 2; ++k) {
      const float2 f = __bfloat1622float2(h[k]);
      m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
  for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  // Non-negative floats order like their bit patterns.
  if ((threadIdx.x & 31) == 0) atomicMax(reinterpret_cast<int*>(amax), __float_as_int(m));
}

__global__ void cast_kernel(const uint4* src, int64_t rows, int64_t row_vectors,
                            const int64_t* dst_row, uint2* dst, const float* amax, float* descale) {
  const float a = *amax;
  const float scale = a > 0.0f ? kE4M3Max / a : 1.0f;
  if (blockIdx.x == 0 && threadIdx.x == 0) *descale = 1.0f / scale;
  const int64_t total = rows * row_vectors;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / row_vectors, c = i % row_vectors;
    const uint4 v = src[i];
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
    uint32_t out[2];
    for (int k = 0; k < 2; ++k) {
      const float2 lo = __bfloat1622float2(h[2 * k]), hi = __bfloat1622float2(h[2 * k + 1]);
      const __nv_fp8x2_storage_t a2 = __nv_cvt_float2_to_fp8x2(
          make_float2(lo.x * scale, lo.y * scale), __NV_SATFINITE, __NV_E4M3);
      const __nv_fp8x2_storage_t b2 = __nv_cvt_float2_to_fp8x2(
          make_float2(hi.x * scale, hi.y * scale), __NV_SATFINITE, __NV_E4M3);
      out[k] = uint32_t(a2) | (uint32_t(b2) << 16);
    }
    const int64_t dr = dst_row ? dst_row[r] : r;
    dst[dr * row_vectors + c] = make_uint2(out[0], out[1]);
  }
}

}  // namespace

void amax_bf16(const uint16_t* src, int64_t n, float* amax, cudaStream_t stream) {
  FLAMIA_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  const int64_t vectors = n / kVector;
  amax_kernel<<<grid_for(vectors), kThreads, 0, stream>>>(reinterpret_cast<const uint4*>(src),
                                                          vectors, amax);
  FLAMIA_CUDA_CHECK_LAUNCH();
}

void cast_bf16_to_e4m3(const uint16_t* src, int64_t rows, int64_t row_elems, const int64_t* dst_row,
                       uint8_t* dst, const float* amax, float* descale, cudaStream_t stream) {
  if (row_elems % kVector != 0)
    throw Error("cast_bf16_to_e4m3: rows must be multiples of 8 values");
  const int64_t row_vectors = row_elems / kVector;
  cast_kernel<<<grid_for(rows * row_vectors), kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(src), rows, row_vectors, dst_row,
      reinterpret_cast<uint2*>(dst), amax, descale);
  FLAMIA_CUDA_CHECK_LAUNCH();
}

}  // namespace flamia::bench
