// FP8 GEMM test vehicle of the sm_90a primitives (not public API): C[M, N] = A[M, K] · B[N, K]^T
// with A and B E4M3 codes, K-major, FP32 accumulation, FP32 or BF16 output, row-major C with row
// stride N. It exists to prove TMA + mbarrier pipeline + warp specialisation + wgmma at speed
// before the attention kernels use the same pieces.
//
// Supported: M, N >= 1 (partial tiles are zero-filled by TMA and masked on store); K >= 16 and a
// multiple of 16 (TMA row strides are multiples of 16 B); A, B 16-byte aligned; C aligned to its
// element. Anything else throws flamia::Error before launch.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace flamia::sm90 {

enum class GemmOutType { kF32, kBF16 };

struct GemmFp8Problem {
  const void* a = nullptr;  // [m][k] e4m3
  const void* b = nullptr;  // [n][k] e4m3
  void* c = nullptr;        // [m][n] float or __nv_bfloat16
  int64_t m = 0, n = 0, k = 0;
  GemmOutType out = GemmOutType::kBF16;
};

// Knobs for tuning runs; defaults are the measured best.
struct GemmFp8Tuning {
  int raster_group = 8;  // consecutive tile rows walked together (L2 reuse of B tiles)
  int max_ctas = 0;      // persistent CTAs; 0 = one per multiprocessor
};

// Validated problem with encoded tensor maps: build once, launch many times.
class GemmFp8Plan {
 public:
  explicit GemmFp8Plan(const GemmFp8Problem& problem, const GemmFp8Tuning& tuning = {});
  void launch(cudaStream_t stream) const;

  int ctas() const { return ctas_; }
  int64_t tiles() const { return tiles_m_ * tiles_n_; }

 private:
  GemmFp8Problem problem_;
  GemmFp8Tuning tuning_;
  CUtensorMap map_a_{}, map_b_{};
  int64_t tiles_m_ = 0, tiles_n_ = 0;
  int ctas_ = 0;
};

// One-shot convenience: plan + launch.
void gemm_fp8(const GemmFp8Problem& problem, cudaStream_t stream, const GemmFp8Tuning& tuning = {});

// Fills `count` bytes with random E4M3 codes, all finite and non-zero (magnitudes in [1/8, 2)),
// drawn on the GPU from a counter-based hash of (seed, index): benchmark inputs.
void fill_random_e4m3(void* dst, size_t count, uint64_t seed, cudaStream_t stream);

// The kernel's compiled attributes (registers, local memory = spills) for the given output type.
cudaFuncAttributes gemm_fp8_kernel_attributes(GemmOutType out);

// Tile shape and pipeline depth (tests probe partial tiles; the benchmark names the config).
constexpr int kGemmFp8BlockM = 128;
constexpr int kGemmFp8BlockN = 256;
constexpr int kGemmFp8BlockK = 128;
constexpr int kGemmFp8Stages = 4;  // TMA -> QGMMA pipeline depth

}  // namespace flamia::sm90
