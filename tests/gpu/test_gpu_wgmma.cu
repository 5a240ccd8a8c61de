// wgmma wrapper: e4m3 and bf16 products of 128B-swizzled K-major shared tiles against a CPU
// reference. Small integer inputs make every product and sum exact in f32, so the comparison is
// exact: a wrong descriptor, swizzle, K step or fragment mapping cannot hide under a tolerance.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "flamia/formats.h"
#include "gpu_test.h"
#include "proxy_fence.cuh"
#include "sm90_test_util.h"
#include "wgmma.cuh"

namespace flamia {
namespace {

namespace wg = sm90::wgmma;
using test::DeviceBuffer;

constexpr uint32_t kRowBytes = wg::kSw128RowBytes;  // K extent of the test: one swizzle row
constexpr int kKSteps = int(kRowBytes / wg::kKBytes);
constexpr int kMaxN = 256;
constexpr int kMagnitude = 6;  // |inputs| <= 6: exact in e4m3 and bf16

enum class Type { kE4m3, kBf16 };

// Stages A[64][kRowBytes] and B[N][kRowBytes] (raw bytes, row-major) into swizzled shared tiles
// with ordinary stores, then D = sum over kKSteps of wgmma(A_k, B_k); D starts as NaN so the first
// call must overwrite it.
template <Type T, int N>
__global__ void __launch_bounds__(sm90::kWarpgroupThreads)
    wgmma_kernel(const uint8_t* a, const uint8_t* b, float* d) {
  __shared__ alignas(wg::kSw128AtomBytes) uint8_t sa[wg::kM * kRowBytes];
  __shared__ alignas(wg::kSw128AtomBytes) uint8_t sb[kMaxN * kRowBytes];
  for (uint32_t i = threadIdx.x; i < wg::kM * kRowBytes; i += blockDim.x)
    sa[wg::sw128_offset(i / kRowBytes, i % kRowBytes)] = a[i];
  for (uint32_t i = threadIdx.x; i < N * kRowBytes; i += blockDim.x)
    sb[wg::sw128_offset(i / kRowBytes, i % kRowBytes)] = b[i];
  sm90::fence_async_shared();  // generic stores -> wgmma's async-proxy reads
  __syncthreads();

  float acc[wg::acc_regs(N)];
  for (float& x : acc) x = NAN;
  const uint64_t desc_a = wg::make_desc_sw128(sa);
  const uint64_t desc_b = wg::make_desc_sw128(sb);
  wg::fence_operands(acc);
  wg::fence();
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    const uint64_t da = wg::desc_advance(desc_a, ks * wg::kKBytes);
    const uint64_t db = wg::desc_advance(desc_b, ks * wg::kKBytes);
    if constexpr (T == Type::kE4m3) {
      wg::mma_e4m3<N>(acc, da, db, ks > 0);
    } else {
      wg::mma_bf16<N>(acc, da, db, ks > 0);
    }
  }
  wg::commit();
  wg::wait<0>();
  wg::fence_operands(acc);
  const int t = threadIdx.x;
#pragma unroll
  for (int i = 0; i < wg::acc_regs(N); ++i) d[wg::acc_row(t, i) * N + wg::acc_col(t, i)] = acc[i];
}

// Random integers in [-kMagnitude, kMagnitude] encoded as rows of kRowBytes bytes; `values` gets
// the decoded numbers ([rows][k]).
std::vector<uint8_t> random_operand(Type type, int rows, std::vector<float>& values,
                                    std::mt19937& rng) {
  std::uniform_int_distribution<int> dist(-kMagnitude, kMagnitude);
  const int elem = type == Type::kE4m3 ? 1 : 2;
  const int k = int(kRowBytes) / elem;
  std::vector<uint8_t> bytes(size_t(rows) * kRowBytes);
  values.assign(size_t(rows) * k, 0.0f);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < k; ++c) {
      const float v = float(dist(rng));
      values[size_t(r) * k + c] = v;
      uint8_t* p = &bytes[size_t(r) * kRowBytes + size_t(c) * elem];
      if (type == Type::kE4m3) {
        p[0] = e4m3::encode(v);
      } else {
        const uint16_t h = bf16::encode(v);
        p[0] = uint8_t(h);
        p[1] = uint8_t(h >> 8);
      }
    }
  }
  return bytes;
}

// D[64][n] must equal A[64][k] B[n][k]^T exactly (small integers: every sum is exact in f32).
void expect_exact_product(const std::vector<float>& av, const std::vector<float>& bv,
                          const std::vector<float>& got, int n) {
  const int k = int(av.size()) / wg::kM;
  int mismatches = 0;
  for (int m = 0; m < wg::kM; ++m) {
    for (int c = 0; c < n; ++c) {
      double ref = 0;
      for (int kk = 0; kk < k; ++kk) ref += double(av[size_t(m) * k + kk]) * bv[size_t(c) * k + kk];
      if (got[size_t(m) * n + c] != float(ref) && ++mismatches <= 5)
        ADD_FAILURE() << "D(" << m << ", " << c << ") = " << got[size_t(m) * n + c] << ", want "
                      << ref;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

template <Type T, int N>
void check_wgmma(uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> av, bv;
  const std::vector<uint8_t> a = random_operand(T, wg::kM, av, rng);
  const std::vector<uint8_t> b = random_operand(T, N, bv, rng);
  DeviceBuffer<uint8_t> d_a(a), d_b(b);
  DeviceBuffer<float> d_d(size_t(wg::kM) * N);
  d_d.poison();
  wgmma_kernel<T, N><<<1, sm90::kWarpgroupThreads>>>(d_a.get(), d_b.get(), d_d.get());
  test::sync_checked();
  expect_exact_product(av, bv, d_d.download(), N);
}

// Register-A form: each thread packs its A fragment bytes from global memory through
// a_frag_row / a_frag_k, so a wrong fragment mapping shows as a wrong product. B is K-major with
// K = kRowBytes (128B swizzle) or K = 64 bytes (64B swizzle, the backward's query-tile operands).
template <int N, uint32_t KBytes>
__global__ void __launch_bounds__(sm90::kWarpgroupThreads)
    wgmma_rs_kernel(const uint8_t* a, const uint8_t* b, float* d) {
  static_assert(KBytes == wg::kSw128RowBytes || KBytes == wg::kSw64RowBytes, "swizzle span");
  constexpr bool kSw64 = KBytes == wg::kSw64RowBytes;
  __shared__ alignas(wg::kSw128AtomBytes) uint8_t sb[N * KBytes];
  for (uint32_t i = threadIdx.x; i < N * KBytes; i += blockDim.x)
    sb[kSw64 ? wg::sw64_offset(i / KBytes, i % KBytes) : wg::sw128_offset(i / KBytes, i % KBytes)] =
        b[i];
  sm90::fence_async_shared();
  __syncthreads();
  const int t = threadIdx.x;
  float acc[wg::acc_regs(N)];
  for (float& x : acc) x = NAN;
  const uint64_t desc_b = kSw64 ? wg::make_desc_sw64(sb) : wg::make_desc_sw128(sb);
  wg::fence_operands(acc);
#pragma unroll
  for (int ks = 0; ks < int(KBytes / wg::kKBytes); ++ks) {
    uint32_t frag[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      frag[j] = 0;
      for (int byte = 0; byte < 4; ++byte)
        frag[j] |=
            uint32_t(a[wg::a_frag_row(t, j) * KBytes + ks * wg::kKE4m3 + wg::a_frag_k(t, j, byte)])
            << (8 * byte);
    }
    wg::fence();
    wg::mma_e4m3_rs<N>(acc, frag, wg::desc_advance(desc_b, ks * wg::kKBytes), ks > 0);
    wg::commit();
    wg::wait<0>();
    wg::fence_operands(acc);
  }
#pragma unroll
  for (int i = 0; i < wg::acc_regs(N); ++i) d[wg::acc_row(t, i) * N + wg::acc_col(t, i)] = acc[i];
}

// Like random_operand, for E4M3 rows of `k` bytes.
std::vector<uint8_t> random_e4m3_rows(int rows, int k, std::vector<float>& values,
                                      std::mt19937& rng) {
  std::uniform_int_distribution<int> dist(-kMagnitude, kMagnitude);
  std::vector<uint8_t> bytes(size_t(rows) * k);
  values.resize(bytes.size());
  for (size_t i = 0; i < bytes.size(); ++i) {
    values[i] = float(dist(rng));
    bytes[i] = e4m3::encode(values[i]);
  }
  return bytes;
}

template <int N, uint32_t KBytes>
void check_wgmma_rs(uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> av, bv;
  const std::vector<uint8_t> a = random_e4m3_rows(wg::kM, int(KBytes), av, rng);
  const std::vector<uint8_t> b = random_e4m3_rows(N, int(KBytes), bv, rng);
  DeviceBuffer<uint8_t> d_a(a), d_b(b);
  DeviceBuffer<float> d_d(size_t(wg::kM) * N);
  d_d.poison();
  wgmma_rs_kernel<N, KBytes><<<1, sm90::kWarpgroupThreads>>>(d_a.get(), d_b.get(), d_d.get());
  test::sync_checked();
  expect_exact_product(av, bv, d_d.download(), N);
}

TEST(GpuWgmma, E4m3RegisterAN128MatchesCpu) {
  FLAMIA_REQUIRE_GPU();
  check_wgmma_rs<128, wg::kSw128RowBytes>(31);
}
TEST(GpuWgmma, E4m3RegisterAN64MatchesCpu) {
  FLAMIA_REQUIRE_GPU();
  check_wgmma_rs<64, wg::kSw128RowBytes>(32);
}
TEST(GpuWgmma, E4m3RegisterAN64Swizzle64MatchesCpu) {
  FLAMIA_REQUIRE_GPU();
  check_wgmma_rs<64, wg::kSw64RowBytes>(33);
}

TEST(GpuWgmma, E4m3N64MatchesCpu) {
  FLAMIA_REQUIRE_GPU();
  check_wgmma<Type::kE4m3, 64>(11);
}
TEST(GpuWgmma, E4m3N128MatchesCpu) {
  FLAMIA_REQUIRE_GPU();
  check_wgmma<Type::kE4m3, 128>(12);
}
TEST(GpuWgmma, E4m3N256MatchesCpu) {
  FLAMIA_REQUIRE_GPU();
  check_wgmma<Type::kE4m3, 256>(13);
}
TEST(GpuWgmma, Bf16N64MatchesCpu) {
  FLAMIA_REQUIRE_GPU();
  check_wgmma<Type::kBf16, 64>(21);
}
TEST(GpuWgmma, Bf16N128MatchesCpu) {
  FLAMIA_REQUIRE_GPU();
  check_wgmma<Type::kBf16, 128>(22);
}
TEST(GpuWgmma, Bf16N256MatchesCpu) {
  FLAMIA_REQUIRE_GPU();
  check_wgmma<Type::kBf16, 256>(23);
}

}  // namespace
}  // namespace flamia
