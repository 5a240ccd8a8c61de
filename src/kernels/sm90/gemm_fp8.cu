// FP8 GEMM test vehicle: C = A · B^T, e4m3 K-major operands, f32 accumulators.
//
// Structure (one persistent CTA per multiprocessor, 384 threads):
//   warpgroup 0  producer: one thread issues the TMA loads of A[128 x 128] and B[256 x 128] per
//                K step into a 4-stage ring guarded by full/empty mbarriers; runs on few registers.
//   warpgroups 1, 2  consumers: each owns 64 rows of the 128 x 256 tile, waits for a stage, issues
//                four m64n256k32 QGMMAs, keeps one group in flight and releases the stage the
//                previous group read; at the end of a tile it stores its accumulators to C.
// While consumers run an epilogue, the producer already fills the ring for their next tile.
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <string>

#include "arch.cuh"
#include "check.h"
#include "gemm_fp8.h"
#include "mbarrier.cuh"
#include "setmaxnreg.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace flamia::sm90 {
namespace {

constexpr int kBlockM = kGemmFp8BlockM;
constexpr int kBlockN = kGemmFp8BlockN;
constexpr int kBlockK = kGemmFp8BlockK;
constexpr int kStages = kGemmFp8Stages;
constexpr int kMinK = 16;  // TMA: the A/B row stride (K bytes) is a multiple of 16

enum class Warpgroup : uint32_t { kProducer = 0, kFirstConsumer = 1 };
constexpr uint32_t kProducerWarpgroups = 1;
constexpr uint32_t kConsumerWarpgroups = 2;
constexpr uint32_t kThreads = (kProducerWarpgroups + kConsumerWarpgroups) * kWarpgroupThreads;
constexpr uint32_t kConsumerWarps = kConsumerWarpgroups * kWarpgroupWarps;

constexpr int kWarpgroupRows = kBlockM / int(kConsumerWarpgroups);
static_assert(kWarpgroupRows == wgmma::kM, "each consumer warpgroup owns one m64 slice");
constexpr int kKSteps = kBlockK / wgmma::kKE4m3;
constexpr int kAccRegs = wgmma::acc_regs(kBlockN);
static_assert(kBlockK == int(wgmma::kSw128RowBytes), "an e4m3 K tile is one 128 B swizzled row");

constexpr uint32_t kTileABytes = kBlockM * kBlockK;
constexpr uint32_t kTileBBytes = kBlockN * kBlockK;
constexpr uint32_t kStageBytes = kTileABytes + kTileBBytes;  // TMA always delivers full boxes
constexpr uint32_t kWarpgroupABytes = kWarpgroupRows * kBlockK;
static_assert(kTileABytes % wgmma::kSw128AtomBytes == 0 &&
                  kTileBBytes % wgmma::kSw128AtomBytes == 0 &&
                  kWarpgroupABytes % wgmma::kSw128AtomBytes == 0,
              "every descriptor base stays 1024 B aligned");

// Register budget: the producer thread needs only loop state; a consumer holds kAccRegs
// accumulators plus descriptors, pipeline state and epilogue addresses.
constexpr uint32_t kProducerRegs = 40;
constexpr uint32_t kConsumerRegs =
    consumer_register_budget(kProducerWarpgroups, kProducerRegs, kConsumerWarpgroups);
constexpr uint32_t kConsumerRegHeadroom = 64;
static_assert(register_split_fits(kProducerWarpgroups, kProducerRegs, kConsumerWarpgroups,
                                  kConsumerRegs),
              "setmaxnreg budgets exceed the register file");
static_assert(kAccRegs + kConsumerRegHeadroom <= kConsumerRegs, "consumer budget too small");

struct alignas(wgmma::kSw128AtomBytes) SharedStorage {
  uint8_t a[kStages][kTileABytes];
  uint8_t b[kStages][kTileBBytes];
  Pipeline<kStages> pipe;
};
// Dynamic shared memory is only guaranteed 16 B alignment: allocate slack and align up.
constexpr size_t kSmemBytes = sizeof(SharedStorage) + wgmma::kSw128AtomBytes;

struct Params {
  CUtensorMap map_a;
  CUtensorMap map_b;
  void* c;
  int m, n;
  int k_tiles;
  int tiles_m, tiles_n;
  int raster_group;
};

struct TileCoord {
  int m0, n0;
};

// Grouped raster: `raster_group` tile rows are walked column by column, so CTAs running at the
// same time share B tiles (and A tiles) in L2.
__device__ __forceinline__ TileCoord tile_coord(int tile, const Params& p) {
  const int group_tiles = p.raster_group * p.tiles_n;
  const int group = tile / group_tiles;
  const int first_m = group * p.raster_group;
  const int rows = min(p.tiles_m - first_m, p.raster_group);
  const int in_group = tile - group * group_tiles;
  return {(first_m + in_group % rows) * kBlockM, (in_group / rows) * kBlockN};
}

template <typename OutT>
__device__ __forceinline__ void store_pair(OutT* c, size_t offset, float v0, float v1);

template <>
__device__ __forceinline__ void store_pair<float>(float* c, size_t offset, float v0, float v1) {
  *reinterpret_cast<float2*>(c + offset) = make_float2(v0, v1);
}
template <>
__device__ __forceinline__ void store_pair<__nv_bfloat16>(__nv_bfloat16* c, size_t offset, float v0,
                                                          float v1) {
  *reinterpret_cast<__nv_bfloat162*>(c + offset) = __floats2bfloat162_rn(v0, v1);
}

template <typename OutT>
__device__ __forceinline__ OutT convert_out(float v);
template <>
__device__ __forceinline__ float convert_out<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 convert_out<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Accumulators of warpgroup thread t -> C, masking rows/columns past the matrix. Pairs of adjacent
// columns go out as one store when the row stride keeps them aligned (N even).
template <typename OutT>
__device__ __forceinline__ void store_tile(const Params& p, const float (&acc)[kAccRegs], int row0,
                                           int col0, int t) {
  OutT* c = static_cast<OutT*>(p.c);
  const bool pairs = (p.n % 2) == 0;
#pragma unroll
  for (int i = 0; i < kAccRegs; i += 2) {
    const int row = row0 + wgmma::acc_row(t, i);
    const int col = col0 + wgmma::acc_col(t, i);
    if (row >= p.m) continue;
    const size_t offset = size_t(row) * size_t(p.n) + size_t(col);
    if (pairs && col + 1 < p.n) {
      store_pair<OutT>(c, offset, acc[i], acc[i + 1]);
    } else {
      if (col < p.n) c[offset] = convert_out<OutT>(acc[i]);
      if (col + 1 < p.n) c[offset + 1] = convert_out<OutT>(acc[i + 1]);
    }
  }
}

template <typename OutT>
__global__ void __launch_bounds__(kThreads, 1) gemm_fp8_kernel(const __grid_constant__ Params p) {
  extern __shared__ uint8_t smem_raw[];
  const uintptr_t aligned = (reinterpret_cast<uintptr_t>(smem_raw) + wgmma::kSw128AtomBytes - 1) &
                            ~uintptr_t(wgmma::kSw128AtomBytes - 1);
  SharedStorage& s = *reinterpret_cast<SharedStorage*>(aligned);

  if (threadIdx.x == 0) {
    // Full: the producer's one arrive_expect_tx; empty: lane 0 of every consumer warp, each after
    // its own wgmma wait, so no warp can still be reading the stage.
    s.pipe.init(1, kConsumerWarps);
  }
  __syncthreads();

  const int tiles = p.tiles_m * p.tiles_n;
  const uint32_t warpgroup = warpgroup_index();

  if (warpgroup == uint32_t(Warpgroup::kProducer)) {
    setmaxnreg_dec<kProducerRegs>();
    if (warp_index() == 0 && lane_index() == 0) {
      tma_prefetch_descriptor(&p.map_a);
      tma_prefetch_descriptor(&p.map_b);
      PipelineState<kStages> st;
      for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const TileCoord tc = tile_coord(tile, p);
        for (int kt = 0; kt < p.k_tiles; ++kt) {
          s.pipe.producer_acquire(st);
          s.pipe.producer_commit(st, kStageBytes);
          tma_load_2d(s.a[st.index], &p.map_a, kt * kBlockK, tc.m0, s.pipe.full_barrier(st));
          tma_load_2d(s.b[st.index], &p.map_b, kt * kBlockK, tc.n0, s.pipe.full_barrier(st));
          st.advance();
        }
      }
    }
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    const uint32_t consumer = warpgroup - uint32_t(Warpgroup::kFirstConsumer);
    const int t = threadIdx.x % kWarpgroupThreads;
    const bool releases = lane_index() == 0;
    float acc[kAccRegs];
    PipelineState<kStages> st;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      const TileCoord tc = tile_coord(tile, p);
      PipelineState<kStages> previous = st;
      for (int kt = 0; kt < p.k_tiles; ++kt) {
        s.pipe.consumer_wait(st);
        const uint64_t desc_a = wgmma::make_desc_sw128(s.a[st.index] + consumer * kWarpgroupABytes);
        const uint64_t desc_b = wgmma::make_desc_sw128(s.b[st.index]);
        wgmma::fence_operands(acc);
        wgmma::fence();
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks) {
          wgmma::mma_e4m3<kBlockN>(acc, wgmma::desc_advance(desc_a, ks * wgmma::kKBytes),
                                   wgmma::desc_advance(desc_b, ks * wgmma::kKBytes),
                                   kt > 0 || ks > 0);
        }
        wgmma::commit();
        wgmma::fence_operands(acc);
        // The group just issued stays in flight; the previous one (stage `previous`) is done.
        wgmma::wait<1>();
        if (kt > 0 && releases) s.pipe.consumer_release(previous);
        previous = st;
        st.advance();
      }
      wgmma::wait<0>();
      wgmma::fence_operands(acc);
      if (releases) s.pipe.consumer_release(previous);
      store_tile<OutT>(p, acc, tc.m0 + int(consumer) * kWarpgroupRows, tc.n0, t);
    }
  }
}

template <typename OutT>
void configure_kernel() {
  FLAMIA_CUDA_CHECK(cudaFuncSetAttribute(
      gemm_fp8_kernel<OutT>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes)));
}

// Random finite non-zero E4M3 codes: sign and 3 mantissa bits free, exponent field in
// [kFillExponentLo, kFillExponentLo + kFillExponents), i.e. magnitudes in [1/8, 2).
constexpr uint32_t kFillExponentLo = 4;
constexpr uint32_t kFillExponents = 4;
constexpr uint32_t kE4m3MantissaBits = 3;
constexpr uint32_t kE4m3SignShift = 7;
constexpr int kFillThreads = 256;
constexpr uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ull;

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += kGoldenGamma;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__global__ void fill_random_e4m3_kernel(uint8_t* dst, size_t count, uint64_t seed) {
  const uint64_t key = splitmix64(seed);
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t h = splitmix64(key ^ (i * kGoldenGamma));
    const uint32_t mantissa = uint32_t(h) & ((1u << kE4m3MantissaBits) - 1);
    const uint32_t exponent = kFillExponentLo + uint32_t(h >> 8) % kFillExponents;
    const uint32_t sign = uint32_t(h >> 16) & 1u;
    dst[i] = uint8_t(sign << kE4m3SignShift | exponent << kE4m3MantissaBits | mantissa);
  }
}

[[noreturn]] void reject(const std::string& what) {
  throw Error("gemm_fp8: " + what);
}

}  // namespace

GemmFp8Plan::GemmFp8Plan(const GemmFp8Problem& problem, const GemmFp8Tuning& tuning)
    : problem_(problem), tuning_(tuning) {
  const auto& pr = problem;
  if (pr.m < 1 || pr.n < 1 || pr.k < 1)
    reject("empty problem m=" + std::to_string(pr.m) + " n=" + std::to_string(pr.n) +
           " k=" + std::to_string(pr.k));
  if (pr.k < kMinK || pr.k % kMinK != 0)
    reject("k=" + std::to_string(pr.k) + " must be a positive multiple of 16");
  if (pr.m > INT_MAX - kBlockM || pr.n > INT_MAX - kBlockN || pr.k > INT_MAX - kBlockK)
    reject("dimensions exceed 32-bit TMA coordinates");
  if (pr.a == nullptr || pr.b == nullptr || pr.c == nullptr) reject("null operand");
  const size_t out_bytes = pr.out == GemmOutType::kF32 ? sizeof(float) : sizeof(__nv_bfloat16);
  if (reinterpret_cast<uintptr_t>(pr.c) % out_bytes != 0) reject("C is not element-aligned");
  if (tuning.raster_group < 1) reject("raster_group must be >= 1");

  tiles_m_ = (pr.m + kBlockM - 1) / kBlockM;
  tiles_n_ = (pr.n + kBlockN - 1) / kBlockN;
  if (tiles_m_ * tiles_n_ > INT_MAX) reject("too many tiles");

  map_a_ = make_tensor_map_2d(pr.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, uint64_t(pr.k), uint64_t(pr.m),
                              uint64_t(pr.k), kBlockK, kBlockM, CU_TENSOR_MAP_SWIZZLE_128B);
  map_b_ = make_tensor_map_2d(pr.b, CU_TENSOR_MAP_DATA_TYPE_UINT8, uint64_t(pr.k), uint64_t(pr.n),
                              uint64_t(pr.k), kBlockK, kBlockN, CU_TENSOR_MAP_SWIZZLE_128B);

  int device = 0, sms = 0, smem_optin = 0;
  FLAMIA_CUDA_CHECK(cudaGetDevice(&device));
  FLAMIA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  FLAMIA_CUDA_CHECK(
      cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (size_t(smem_optin) < kSmemBytes)
    reject("needs " + std::to_string(kSmemBytes) + " B of shared memory, device allows " +
           std::to_string(smem_optin));
  const int max_ctas = tuning.max_ctas > 0 ? tuning.max_ctas : sms;
  ctas_ = int(std::min<int64_t>(tiles_m_ * tiles_n_, max_ctas));
  if (pr.out == GemmOutType::kF32) {
    configure_kernel<float>();
  } else {
    configure_kernel<__nv_bfloat16>();
  }
}

void GemmFp8Plan::launch(cudaStream_t stream) const {
  Params p;
  p.map_a = map_a_;
  p.map_b = map_b_;
  p.c = problem_.c;
  p.m = int(problem_.m);
  p.n = int(problem_.n);
  p.k_tiles = int((problem_.k + kBlockK - 1) / kBlockK);
  p.tiles_m = int(tiles_m_);
  p.tiles_n = int(tiles_n_);
  p.raster_group = tuning_.raster_group;
  if (problem_.out == GemmOutType::kF32) {
    gemm_fp8_kernel<float><<<ctas_, kThreads, kSmemBytes, stream>>>(p);
  } else {
    gemm_fp8_kernel<__nv_bfloat16><<<ctas_, kThreads, kSmemBytes, stream>>>(p);
  }
  FLAMIA_CUDA_CHECK_LAUNCH();
}

void gemm_fp8(const GemmFp8Problem& problem, cudaStream_t stream, const GemmFp8Tuning& tuning) {
  GemmFp8Plan(problem, tuning).launch(stream);
}

void fill_random_e4m3(void* dst, size_t count, uint64_t seed, cudaStream_t stream) {
  if (count == 0) return;
  int device = 0, sms = 0;
  FLAMIA_CUDA_CHECK(cudaGetDevice(&device));
  FLAMIA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  constexpr int kBlocksPerSm = 8;
  const size_t blocks_needed = (count + kFillThreads - 1) / kFillThreads;
  const int blocks = int(std::min<size_t>(blocks_needed, size_t(sms) * kBlocksPerSm));
  fill_random_e4m3_kernel<<<blocks, kFillThreads, 0, stream>>>(static_cast<uint8_t*>(dst), count,
                                                               seed);
  FLAMIA_CUDA_CHECK_LAUNCH();
}

cudaFuncAttributes gemm_fp8_kernel_attributes(GemmOutType out) {
  cudaFuncAttributes attr{};
  if (out == GemmOutType::kF32) {
    FLAMIA_CUDA_CHECK(cudaFuncGetAttributes(&attr, gemm_fp8_kernel<float>));
  } else {
    FLAMIA_CUDA_CHECK(cudaFuncGetAttributes(&attr, gemm_fp8_kernel<__nv_bfloat16>));
  }
  return attr;
}

}  // namespace flamia::sm90
