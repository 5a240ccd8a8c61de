// mbarrier primitives: phase parity of try_wait, transaction counts, and the multi-stage
// full/empty pipeline carried through many passes over its ring, filled by bulk copies and by
// ordinary shared stores.
#include <cstdint>
#include <random>
#include <vector>

#include "arch.cuh"
#include "gpu_test.h"
#include "mbarrier.cuh"
#include "sm90_test_util.h"
#include "tma.cuh"

namespace flamia {
namespace {

using test::DeviceBuffer;

constexpr uint32_t kSmemAlign = 128;

// Records try_wait(parity 0), try_wait(parity 1) after each step of a scripted sequence on a
// barrier expecting two arrivals per phase.
enum Step : int { kInitial, kOneArrival, kTwoArrivals, kFourArrivals, kSteps };
constexpr uint32_t kArrivalsPerPhase = 2;

__global__ void parity_kernel(int* observed) {
  __shared__ uint64_t bar;
  sm90::mbarrier_init(&bar, kArrivalsPerPhase);
  sm90::mbarrier_init_fence();
  auto record = [&](int step) {
    observed[2 * step] = sm90::mbarrier_try_wait(&bar, 0);
    observed[2 * step + 1] = sm90::mbarrier_try_wait(&bar, 1);
  };
  record(kInitial);
  sm90::mbarrier_arrive(&bar);
  record(kOneArrival);
  sm90::mbarrier_arrive(&bar);
  record(kTwoArrivals);  // phase 0 complete, phase 1 running
  sm90::mbarrier_arrive(&bar);
  sm90::mbarrier_arrive(&bar);
  record(kFourArrivals);  // phase 1 complete, phase 0 (the third) running
}

TEST(GpuMbarrier, TryWaitFollowsPhaseParity) {
  FLAMIA_REQUIRE_GPU();
  DeviceBuffer<int> observed(2 * kSteps);
  observed.poison();
  parity_kernel<<<1, 1>>>(observed.get());
  test::sync_checked();
  // {parity 0 done, parity 1 done} per step: a fresh barrier counts its "previous" phase (parity
  // 1) as complete.
  const std::vector<int> want = {0, 1, 0, 1, 1, 0, 0, 1};
  EXPECT_EQ(observed.download(), want);
}

// The phase stays open until the announced bytes have landed, even after the only arrival.
__global__ void expect_tx_kernel(const uint8_t* src, uint32_t bytes, int* open_before,
                                 uint8_t* dst) {
  __shared__ alignas(kSmemAlign) uint8_t buf[4096];
  __shared__ uint64_t bar;
  sm90::mbarrier_init(&bar, 1);
  sm90::mbarrier_init_fence();
  sm90::mbarrier_arrive_expect_tx(&bar, bytes);
  *open_before = !sm90::mbarrier_try_wait(&bar, 0);
  sm90::bulk_load(buf, src, bytes, &bar);
  sm90::mbarrier_wait(&bar, 0);
  for (uint32_t i = 0; i < bytes; ++i) dst[i] = buf[i];
}

TEST(GpuMbarrier, ExpectTxHoldsThePhaseUntilTheBytesLand) {
  FLAMIA_REQUIRE_GPU();
  constexpr uint32_t kBytes = 4096;
  std::vector<uint8_t> src(kBytes);
  for (uint32_t i = 0; i < kBytes; ++i) src[i] = uint8_t(i * 31 + 7);
  DeviceBuffer<uint8_t> d_src(src), dst(kBytes);
  DeviceBuffer<int> open(1);
  dst.poison();
  open.poison();
  expect_tx_kernel<<<1, 1>>>(d_src.get(), kBytes, open.get(), dst.get());
  test::sync_checked();
  EXPECT_EQ(open.download()[0], 1);
  EXPECT_EQ(dst.download(), src);
}

// Pipeline round trip: warp 0 (one thread) bulk-loads chunk i into stage i % kStages; each of the
// kConsumerWarps warps copies its share of the stage to the output and releases it. Many more
// chunks than stages, so every barrier goes through many phases.
constexpr int kStages = 3;
constexpr int kConsumerWarps = 2;
constexpr uint32_t kChunkBytes = 1024;
constexpr int kChunks = 50;

struct PipelineSmem {
  alignas(kSmemAlign) uint8_t stage[kStages][kChunkBytes];
  sm90::Pipeline<kStages> pipe;
};

__global__ void pipeline_kernel(const uint8_t* src, uint8_t* dst) {
  __shared__ PipelineSmem s;
  if (threadIdx.x == 0) s.pipe.init(1, kConsumerWarps);
  __syncthreads();
  const uint32_t warp = sm90::warp_index();
  sm90::PipelineState<kStages> st;
  if (warp == 0) {
    if (sm90::lane_index() == 0) {
      for (int i = 0; i < kChunks; ++i) {
        s.pipe.producer_acquire(st);
        s.pipe.producer_commit(st, kChunkBytes);
        sm90::bulk_load(s.stage[st.index], src + size_t(i) * kChunkBytes, kChunkBytes,
                        s.pipe.full_barrier(st));
        st.advance();
      }
    }
  } else {
    const uint32_t consumer = warp - 1;
    constexpr uint32_t kShare = kChunkBytes / kConsumerWarps;
    for (int i = 0; i < kChunks; ++i) {
      s.pipe.consumer_wait(st);
      for (uint32_t b = sm90::lane_index(); b < kShare; b += sm90::kWarpThreads) {
        const uint32_t off = consumer * kShare + b;
        dst[size_t(i) * kChunkBytes + off] = s.stage[st.index][off];
      }
      __syncwarp();
      if (sm90::lane_index() == 0) s.pipe.consumer_release(st);
      st.advance();
    }
  }
}

TEST(GpuMbarrier, PipelineRoundTripAcrossManyPhases) {
  FLAMIA_REQUIRE_GPU();
  std::vector<uint8_t> src(size_t(kChunks) * kChunkBytes);
  std::mt19937 rng(5);
  for (auto& x : src) x = uint8_t(rng());
  DeviceBuffer<uint8_t> d_src(src), dst(src.size());
  dst.poison();
  pipeline_kernel<<<1, (1 + kConsumerWarps) * sm90::kWarpThreads>>>(d_src.get(), dst.get());
  test::sync_checked();
  EXPECT_EQ(dst.download(), src);
}

// The attention kernels' other handoff: the producer warp's 32 lanes store a stage's words with
// ordinary shared stores, each lane then arriving on the full barrier (its arrival releases its
// stores); the consumer warps read after the wait and release the stage through one lane after a
// __syncwarp. Word w of chunk i is a function of (i, w), so a read that overtook the stores (or a
// store that overtook the previous chunk's reads) shows as a wrong word.
constexpr uint32_t kWordsPerStage = 256;
constexpr int kWordChunks = 200;

__device__ __forceinline__ uint32_t chunk_word(int chunk, uint32_t word) {
  return uint32_t(chunk) * 0x9E3779B9u ^ (word * 0x85EBCA6Bu + 1u);
}

struct GenericSmem {
  uint32_t stage[kStages][kWordsPerStage];
  sm90::Pipeline<kStages> pipe;
};

__global__ void generic_handoff_kernel(int* wrong) {
  __shared__ GenericSmem s;
  if (threadIdx.x == 0) s.pipe.init(sm90::kWarpThreads, kConsumerWarps);
  __syncthreads();
  const uint32_t warp = sm90::warp_index(), lane = sm90::lane_index();
  sm90::PipelineState<kStages> st;
  if (warp == 0) {
    for (int i = 0; i < kWordChunks; ++i) {
      s.pipe.producer_acquire(st);
      for (uint32_t w = lane; w < kWordsPerStage; w += sm90::kWarpThreads)
        s.stage[st.index][w] = chunk_word(i, w);
      sm90::mbarrier_arrive(s.pipe.full_barrier(st));
      st.advance();
    }
  } else {
    int bad = 0;
    for (int i = 0; i < kWordChunks; ++i) {
      s.pipe.consumer_wait(st);
      for (uint32_t w = lane; w < kWordsPerStage; w += sm90::kWarpThreads)
        bad += s.stage[st.index][w] != chunk_word(i, w);
      s.pipe.warp_release(st);
      st.advance();
    }
    atomicAdd(wrong, bad);
  }
}

TEST(GpuMbarrier, GenericStoresHandOffThroughThePipeline) {
  FLAMIA_REQUIRE_GPU();
  DeviceBuffer<int> wrong(std::vector<int>{0});
  generic_handoff_kernel<<<1, (1 + kConsumerWarps) * sm90::kWarpThreads>>>(wrong.get());
  test::sync_checked();
  EXPECT_EQ(wrong.download()[0], 0);
}

}  // namespace
}  // namespace flamia
