// Named barriers: a producer/consumer hand-off between two warpgroups through one shared buffer,
// ordered only by bar.arrive / bar.sync on two ids. Any missing order shows up as a wrong sum.
#include <cstdint>
#include <vector>

#include "arch.cuh"
#include "gpu_test.h"
#include "named_barrier.cuh"
#include "sm90_test_util.h"

namespace flamia {
namespace {

using test::DeviceBuffer;

enum class Bar : uint32_t { kFull = sm90::kFirstNamedBarrier, kEmpty };
static_assert(sm90::named_barrier_id_valid(Bar::kFull) &&
              sm90::named_barrier_id_valid(Bar::kEmpty));

constexpr uint32_t kGroupThreads = sm90::kWarpgroupThreads;
constexpr uint32_t kBarrierThreads = 2 * kGroupThreads;  // producer + consumer warpgroups
constexpr int kRounds = 1000;

__host__ __device__ constexpr uint32_t value(int round, uint32_t slot) {
  return uint32_t(round) * 2654435761u + slot * 40503u;
}

// Warpgroup 0 writes round r into buf, arrives on kFull; warpgroup 1 syncs on kFull, reads buf in
// a different thread order (so each value crosses warps), arrives on kEmpty; warpgroup 0 syncs on
// kEmpty before overwriting.
__global__ void handoff_kernel(uint32_t* sums) {
  __shared__ uint32_t buf[kGroupThreads];
  const uint32_t group = sm90::warpgroup_index();
  const uint32_t t = threadIdx.x % kGroupThreads;
  if (group == 0) {
    for (int r = 0; r < kRounds; ++r) {
      if (r > 0) sm90::named_barrier_sync(Bar::kEmpty, kBarrierThreads);
      buf[t] = value(r, t);
      sm90::named_barrier_arrive(Bar::kFull, kBarrierThreads);
    }
  } else {
    uint32_t sum = 0;
    const uint32_t slot = kGroupThreads - 1 - t;
    for (int r = 0; r < kRounds; ++r) {
      sm90::named_barrier_sync(Bar::kFull, kBarrierThreads);
      sum += buf[slot] ^ uint32_t(r);
      if (r + 1 < kRounds) sm90::named_barrier_arrive(Bar::kEmpty, kBarrierThreads);
    }
    sums[slot] = sum;
  }
}

TEST(GpuNamedBarrier, ProducerConsumerHandoffIsOrdered) {
  FLAMIA_REQUIRE_GPU();
  DeviceBuffer<uint32_t> sums(kGroupThreads);
  sums.poison();
  handoff_kernel<<<1, 2 * kGroupThreads>>>(sums.get());
  test::sync_checked();
  std::vector<uint32_t> want(kGroupThreads, 0);
  for (uint32_t s = 0; s < kGroupThreads; ++s)
    for (int r = 0; r < kRounds; ++r) want[s] += value(r, s) ^ uint32_t(r);
  EXPECT_EQ(sums.download(), want);
}

}  // namespace
}  // namespace flamia
