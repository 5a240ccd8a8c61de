// setmaxnreg: a producer warpgroup gives registers back and two consumer warpgroups take them,
// under the __launch_bounds__(384, 1) entry cap the instruction needs. The consumers then run a
// register-hungry unrolled computation whose results the host checks, and the kernel must use no
// local memory. And the entry cap of a CTA that is not whole warpgroups (entry_register_cap): what
// ptxas gives it and what the SM launches.
#include <cstdint>
#include <vector>

#include "arch.cuh"
#include "gpu_test.h"
#include "setmaxnreg.cuh"
#include "sm90_test_util.h"

namespace flamia {
namespace {

using test::DeviceBuffer;

constexpr uint32_t kProducerWarpgroups = 1, kConsumerWarpgroups = 2;
constexpr uint32_t kThreads = (kProducerWarpgroups + kConsumerWarpgroups) * sm90::kWarpgroupThreads;
constexpr uint32_t kProducerRegs = 40;
constexpr uint32_t kConsumerRegs =
    sm90::consumer_register_budget(kProducerWarpgroups, kProducerRegs, kConsumerWarpgroups);
static_assert(kConsumerRegs == 232, "(65536 / 128 - 40) / 2, rounded down to a multiple of 8");
static_assert(sm90::register_split_fits(kProducerWarpgroups, kProducerRegs, kConsumerWarpgroups,
                                        kConsumerRegs));
static_assert(!sm90::register_split_fits(kProducerWarpgroups, sm90::kMaxnregMax,
                                         kConsumerWarpgroups, sm90::kMaxnregMax),
              "the budget check must reject an over-full split");
constexpr int kLive = 128;  // values each consumer thread keeps live at once
constexpr int kMixRounds = 4;
constexpr uint32_t kProducerMark = 0xC0FFEEu;

__host__ __device__ inline uint32_t mix(uint32_t x, uint32_t y) {
  return (x ^ (y >> 3)) * 9 + y;
}

// kValues values live at once, mixed kRounds times and hashed: register-hungry on the device,
// and the host's reference for the same seed.
template <int kValues, int kRounds>
__host__ __device__ inline uint32_t mixed_hash(uint32_t seed) {
  uint32_t v[kValues];
#pragma unroll
  for (int i = 0; i < kValues; ++i) v[i] = seed * 2654435761u + uint32_t(i);
#pragma unroll
  for (int r = 0; r < kRounds; ++r)
#pragma unroll
    for (int i = 0; i < kValues; ++i) v[i] = mix(v[i], v[(i + 1 + r) % kValues]);
  uint32_t h = 0;
#pragma unroll
  for (int i = 0; i < kValues; ++i) h = h * 31 + v[i];
  return h;
}

__global__ void __launch_bounds__(kThreads, 1) split_kernel(uint32_t* out) {
  if (sm90::warpgroup_index() < kProducerWarpgroups) {
    sm90::setmaxnreg_dec<kProducerRegs>();
    out[threadIdx.x] = kProducerMark + threadIdx.x;
  } else {
    sm90::setmaxnreg_inc<kConsumerRegs>();
    out[threadIdx.x] = mixed_hash<kLive, kMixRounds>(threadIdx.x);
  }
}

TEST(GpuSetmaxnreg, WarpSpecialisedKernelRunsWithoutLocalMemory) {
  FLAMIA_REQUIRE_GPU();
  cudaFuncAttributes attr{};
  FLAMIA_CUDA_CHECK(cudaFuncGetAttributes(&attr, split_kernel));
  EXPECT_EQ(attr.localSizeBytes, 0u) << "register spills";
  EXPECT_LE(uint32_t(attr.numRegs), sm90::entry_register_cap(kThreads));

  DeviceBuffer<uint32_t> out(kThreads);
  out.poison();
  split_kernel<<<1, kThreads>>>(out.get());
  test::sync_checked();
  const std::vector<uint32_t> got = out.download();
  for (uint32_t t = 0; t < kThreads; ++t) {
    const uint32_t want = t < kProducerWarpgroups * sm90::kWarpgroupThreads
                              ? kProducerMark + t
                              : mixed_hash<kLive, kMixRounds>(t);
    ASSERT_EQ(got[t], want) << "thread " << t;
  }
}

// 288 threads put three warps on sub-partition 0: the same cap as 384 threads. 8 registers a
// thread more still fit the SM's file as a whole but not that sub-partition's quarter.
constexpr uint32_t kNineWarps = 2 * sm90::kWarpgroupThreads + sm90::kWarpThreads;
constexpr uint32_t kNineWarpCap = sm90::entry_register_cap(kNineWarps);
constexpr uint32_t kOverCap = kNineWarpCap + sm90::kMaxnregGranule;
static_assert(kNineWarps * kOverCap <= sm90::kRegistersPerSm, "fits the whole file");
constexpr int kHungryLive = 184;  // more values than either kernel's registers hold
constexpr int kHungryRounds = 2;

__global__ void __launch_bounds__(kNineWarps, 1) nine_warps_bounded(uint32_t* out) {
  out[threadIdx.x] = mixed_hash<kHungryLive, kHungryRounds>(threadIdx.x);
}

__global__ void __maxnreg__(kOverCap) nine_warps_over(uint32_t* out) {
  out[threadIdx.x] = mixed_hash<kHungryLive, kHungryRounds>(threadIdx.x);
}

TEST(GpuSetmaxnreg, EntryCapCountsTheBusiestSubPartition) {
  FLAMIA_REQUIRE_GPU();
  cudaFuncAttributes attr{};
  FLAMIA_CUDA_CHECK(cudaFuncGetAttributes(&attr, nine_warps_bounded));
  EXPECT_EQ(uint32_t(attr.numRegs), kNineWarpCap) << "ptxas's entry cap for 288 threads";
  DeviceBuffer<uint32_t> out(kNineWarps);
  out.poison();
  nine_warps_bounded<<<1, kNineWarps>>>(out.get());
  test::sync_checked();
  const std::vector<uint32_t> got = out.download();
  for (uint32_t t = 0; t < kNineWarps; ++t)
    ASSERT_EQ(got[t], (mixed_hash<kHungryLive, kHungryRounds>(t))) << "thread " << t;

  FLAMIA_CUDA_CHECK(cudaFuncGetAttributes(&attr, nine_warps_over));
  ASSERT_EQ(uint32_t(attr.numRegs), kOverCap) << "the kernel must need its whole budget";
  nine_warps_over<<<1, kNineWarps>>>(out.get());
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchOutOfResources)
      << kNineWarps << " threads of " << kOverCap << " registers launched";
  FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace flamia
