// TMA (the bulk tensor copy engine): tensor maps encoded on the host, tile loads/stores and plain
// bulk copies on the device through CCCL's ::cuda::ptx.
//
// Host rules checked by make_tensor_map (CUDA driver API, cuTensorMapEncodeTiled): global address
// 16 B aligned, strides multiples of 16 B and < 2^40, dims in [1, 2^32], box dims in [1, 256],
// the box's inner extent a multiple of 16 B and, with a swizzle, at most the swizzle span.
// Coordinates on the device are signed elements and may start anywhere; elements outside the
// tensor read as zero, and the transaction count is always the full box.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <cuda/ptx>

#include <cstdint>
#include <string>

#include "check.h"
#include "flamia/common.h"

namespace flamia::sm90 {

// ---------------------------------------------------------------------------------------------
// Host: tensor maps.

constexpr uint32_t kTmaMaxRank = 5;
constexpr uint32_t kTmaMaxBoxDim = 256;
constexpr uint64_t kTmaAlignBytes = 16;
constexpr uint64_t kTmaMaxDim = uint64_t(1) << 32;
constexpr uint64_t kTmaMaxStrideBytes = uint64_t(1) << 40;
// The driver ABI version whose function signatures we call (cuTensorMapEncodeTiled: CUDA 12.0).
constexpr unsigned kDriverAbiVersion = 12000;

inline uint32_t tensor_map_element_bytes(CUtensorMapDataType type) {
  switch (type) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8:
      return 1;
    case CU_TENSOR_MAP_DATA_TYPE_UINT16:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16:
      return 2;
    case CU_TENSOR_MAP_DATA_TYPE_UINT32:
    case CU_TENSOR_MAP_DATA_TYPE_INT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32:
      return 4;
    case CU_TENSOR_MAP_DATA_TYPE_UINT64:
    case CU_TENSOR_MAP_DATA_TYPE_INT64:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT64:
      return 8;
    default:
      throw Error("tensor map: unsupported data type " + std::to_string(int(type)));
  }
}

// Bytes of one swizzle span (the largest inner box extent the mode allows); 0 for no swizzle.
inline uint32_t tensor_map_swizzle_bytes(CUtensorMapSwizzle swizzle) {
  switch (swizzle) {
    case CU_TENSOR_MAP_SWIZZLE_NONE:
      return 0;
    case CU_TENSOR_MAP_SWIZZLE_32B:
      return 32;
    case CU_TENSOR_MAP_SWIZZLE_64B:
      return 64;
    case CU_TENSOR_MAP_SWIZZLE_128B:
      return 128;
    default:
      throw Error("tensor map: unsupported swizzle mode " + std::to_string(int(swizzle)));
  }
}

// A tiled tensor map's geometry; dimension 0 is the contiguous one.
struct TensorMapSpec {
  CUtensorMapDataType type = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  uint32_t rank = 2;
  uint64_t dims[kTmaMaxRank] = {};           // elements
  uint64_t strides_bytes[kTmaMaxRank] = {};  // [i] = byte stride of dimension i + 1
  uint32_t box[kTmaMaxRank] = {};            // elements per copy
  CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_NONE;
  CUtensorMapL2promotion l2_promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
};

namespace detail {

// Driver functions come through the runtime's entry-point query, so nothing links libcuda.
template <typename Fn>
Fn driver_entry_point(const char* symbol) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult query{};
  FLAMIA_CUDA_CHECK(
      cudaGetDriverEntryPointByVersion(symbol, &p, kDriverAbiVersion, cudaEnableDefault, &query));
  if (query != cudaDriverEntryPointSuccess || p == nullptr)
    throw Error(std::string(symbol) + " not found in the CUDA driver");
  return reinterpret_cast<Fn>(p);
}

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const auto fn =
      driver_entry_point<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled");
  return fn;
}

inline std::string driver_error_string(CUresult r) {
  static const auto fn = driver_entry_point<PFN_cuGetErrorString_v6000>("cuGetErrorString");
  const char* msg = nullptr;
  if (fn(r, &msg) != CUDA_SUCCESS || msg == nullptr) return "CUresult " + std::to_string(int(r));
  return msg;
}

[[noreturn]] inline void tensor_map_fail(const std::string& what) {
  throw Error("tensor map: " + what);
}

}  // namespace detail

// Validates the spec against the TMA rules (naming the offending field) and encodes the map.
inline CUtensorMap make_tensor_map(const void* base, const TensorMapSpec& s) {
  using detail::tensor_map_fail;
  const uint64_t elem = tensor_map_element_bytes(s.type);
  if (s.rank < 1 || s.rank > kTmaMaxRank) tensor_map_fail("rank " + std::to_string(s.rank));
  if (base == nullptr) tensor_map_fail("null global address");
  if (reinterpret_cast<uintptr_t>(base) % kTmaAlignBytes != 0)
    tensor_map_fail("global address not 16-byte aligned");
  for (uint32_t i = 0; i < s.rank; ++i) {
    const std::string d = "dim " + std::to_string(i) + ": ";
    if (s.dims[i] < 1 || s.dims[i] > kTmaMaxDim) tensor_map_fail(d + "size out of [1, 2^32]");
    if (s.box[i] < 1 || s.box[i] > kTmaMaxBoxDim) tensor_map_fail(d + "box out of [1, 256]");
    if (i > 0) {
      const uint64_t stride = s.strides_bytes[i - 1];
      if (stride % kTmaAlignBytes != 0 || stride >= kTmaMaxStrideBytes)
        tensor_map_fail(d + "stride " + std::to_string(stride) + " B not a multiple of 16 < 2^40");
    }
  }
  const uint64_t box_inner_bytes = s.box[0] * elem;
  if (box_inner_bytes % kTmaAlignBytes != 0)
    tensor_map_fail("box inner extent " + std::to_string(box_inner_bytes) +
                    " B not a multiple of 16");
  const uint32_t span = tensor_map_swizzle_bytes(s.swizzle);
  if (span != 0 && box_inner_bytes > span)
    tensor_map_fail("box inner extent " + std::to_string(box_inner_bytes) +
                    " B exceeds the swizzle span " + std::to_string(span) + " B");

  cuuint64_t dims[kTmaMaxRank];
  cuuint64_t strides[kTmaMaxRank];
  cuuint32_t box[kTmaMaxRank];
  cuuint32_t element_strides[kTmaMaxRank];
  for (uint32_t i = 0; i < s.rank; ++i) {
    dims[i] = s.dims[i];
    strides[i] = s.strides_bytes[i];
    box[i] = s.box[i];
    element_strides[i] = 1;
  }
  CUtensorMap map;
  const CUresult r = detail::tensor_map_encoder()(
      &map, s.type, s.rank, const_cast<void*>(base), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, s.swizzle, s.l2_promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    tensor_map_fail("cuTensorMapEncodeTiled: " + detail::driver_error_string(r));
  return map;
}

// A row-major matrix [outer][inner] with rows `row_stride_bytes` apart, copied in boxes of
// box_outer rows by box_inner elements.
inline CUtensorMap make_tensor_map_2d(const void* base, CUtensorMapDataType type, uint64_t inner,
                                      uint64_t outer, uint64_t row_stride_bytes, uint32_t box_inner,
                                      uint32_t box_outer,
                                      CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_NONE) {
  TensorMapSpec s;
  s.type = type;
  s.rank = 2;
  s.dims[0] = inner;
  s.dims[1] = outer;
  s.strides_bytes[0] = row_stride_bytes;
  s.box[0] = box_inner;
  s.box[1] = box_outer;
  s.swizzle = swizzle;
  return make_tensor_map(base, s);
}

// A [d2][d1][d0] array with the given byte strides of dims 1 and 2.
inline CUtensorMap make_tensor_map_3d(const void* base, CUtensorMapDataType type,
                                      const uint64_t (&dims)[3], const uint64_t (&strides)[2],
                                      const uint32_t (&box)[3],
                                      CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_NONE) {
  TensorMapSpec s;
  s.type = type;
  s.rank = 3;
  for (int i = 0; i < 3; ++i) {
    s.dims[i] = dims[i];
    s.box[i] = box[i];
  }
  s.strides_bytes[0] = strides[0];
  s.strides_bytes[1] = strides[1];
  s.swizzle = swizzle;
  return make_tensor_map(base, s);
}

// ---------------------------------------------------------------------------------------------
// Device. `map` points at a __grid_constant__ kernel parameter (or other global/const memory).
// Loads complete on `bar`: the caller has announced the box bytes with mbarrier expect_tx.

__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" : : "l"(map) : "memory");
}

__device__ __forceinline__ void tma_load_2d(void* smem_dst, const CUtensorMap* map, int32_t c0,
                                            int32_t c1, uint64_t* bar) {
  const int32_t coords[2] = {c0, c1};
  ::cuda::ptx::cp_async_bulk_tensor(::cuda::ptx::space_cluster, ::cuda::ptx::space_global, smem_dst,
                                    map, coords, bar);
}

__device__ __forceinline__ void tma_load_3d(void* smem_dst, const CUtensorMap* map, int32_t c0,
                                            int32_t c1, int32_t c2, uint64_t* bar) {
  const int32_t coords[3] = {c0, c1, c2};
  ::cuda::ptx::cp_async_bulk_tensor(::cuda::ptx::space_cluster, ::cuda::ptx::space_global, smem_dst,
                                    map, coords, bar);
}

// Stores join the thread's bulk group: tma_store_commit() then tma_store_wait*() before the shared
// source is reused or the kernel relies on the global result. Writes outside the tensor are
// dropped. The shared source must be published to the async proxy first (fence_async_shared).
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, int32_t c0, int32_t c1,
                                             const void* smem_src) {
  const int32_t coords[2] = {c0, c1};
  ::cuda::ptx::cp_async_bulk_tensor(::cuda::ptx::space_global, ::cuda::ptx::space_shared, map,
                                    coords, smem_src);
}

__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, int32_t c0, int32_t c1,
                                             int32_t c2, const void* smem_src) {
  const int32_t coords[3] = {c0, c1, c2};
  ::cuda::ptx::cp_async_bulk_tensor(::cuda::ptx::space_global, ::cuda::ptx::space_shared, map,
                                    coords, smem_src);
}

// Plain bulk copies: addresses 16 B aligned, `bytes` a multiple of 16.
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* gmem_src, uint32_t bytes,
                                          uint64_t* bar) {
  ::cuda::ptx::cp_async_bulk(::cuda::ptx::space_cluster, ::cuda::ptx::space_global, smem_dst,
                             gmem_src, bytes, bar);
}

__device__ __forceinline__ void bulk_store(void* gmem_dst, const void* smem_src, uint32_t bytes) {
  ::cuda::ptx::cp_async_bulk(::cuda::ptx::space_global, ::cuda::ptx::space_shared, gmem_dst,
                             smem_src, bytes);
}

// Adds `bytes` (a multiple of 16) of FP32 values from shared memory into global memory, element
// by element, in L2; joins the thread's bulk group like the stores.
__device__ __forceinline__ void bulk_reduce_add(float* gmem_dst, const float* smem_src,
                                                uint32_t bytes) {
  ::cuda::ptx::cp_reduce_async_bulk(::cuda::ptx::space_global, ::cuda::ptx::space_shared,
                                    ::cuda::ptx::op_add, gmem_dst, smem_src, bytes);
}

__device__ __forceinline__ void tma_store_commit() {
  ::cuda::ptx::cp_async_bulk_commit_group();
}

// Waits until at most `Pending` committed store groups are still reading their shared source.
template <int Pending = 0>
__device__ __forceinline__ void tma_store_wait_read() {
  ::cuda::ptx::cp_async_bulk_wait_group_read(::cuda::ptx::n32_t<Pending>{});
}

// Waits until at most `Pending` committed store groups are incomplete (writes performed).
template <int Pending = 0>
__device__ __forceinline__ void tma_store_wait() {
  ::cuda::ptx::cp_async_bulk_wait_group(::cuda::ptx::n32_t<Pending>{});
}

}  // namespace flamia::sm90
