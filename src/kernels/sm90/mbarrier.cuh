// mbarrier wrappers (through CCCL's ::cuda::ptx) and a multi-stage full/empty pipeline built on
// them.
//
// An mbarrier phase completes when its pending arrivals and its transaction count both reach zero;
// TMA copies decrement the transaction count as bytes land. Waiters name the phase by its parity:
// try_wait(parity p) succeeds once the phase of parity p has completed, so on a fresh barrier
// (phase 0 running) parity 1 succeeds at once. The pipeline uses that to let the producer fill
// every stage before the first release.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "arch.cuh"

namespace flamia::sm90 {

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  ::cuda::ptx::mbarrier_init(bar, arrivals);
}

// After the inits and before the __syncthreads that publishes them: makes them visible to the
// async proxy (TMA completes transactions on them).
__device__ __forceinline__ void mbarrier_init_fence() {
  ::cuda::ptx::fence_mbarrier_init(::cuda::ptx::sem_release, ::cuda::ptx::scope_cluster);
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  (void)::cuda::ptx::mbarrier_arrive(bar);
}

// One arrival plus `bytes` of expected transactions (the TMA copies that fill the stage).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  (void)::cuda::ptx::mbarrier_arrive_expect_tx(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta,
                                               ::cuda::ptx::space_shared, bar, bytes);
}

// Raises the expected transaction count without arriving.
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t bytes) {
  ::cuda::ptx::mbarrier_expect_tx(::cuda::ptx::sem_relaxed, ::cuda::ptx::scope_cta,
                                  ::cuda::ptx::space_shared, bar, bytes);
}

// True once the phase of parity `phase` has completed (acquire semantics at CTA scope).
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* bar, uint32_t phase) {
  return ::cuda::ptx::mbarrier_try_wait_parity(bar, phase);
}

__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t phase) {
  while (!mbarrier_try_wait(bar, phase)) {
  }
}

// Position in a ring of `Stages` buffers: the stage index and the parity of the pass over the ring.
template <int Stages>
struct PipelineState {
  static_assert(Stages >= 1, "a pipeline needs at least one stage");
  uint32_t index = 0;
  uint32_t phase = 0;

  __device__ __forceinline__ void advance() {
    if (++index == Stages) {
      index = 0;
      phase ^= 1;
    }
  }
};

// Full/empty barrier pairs of a producer -> consumer ring. `full[s]` completes when the producer
// has arrived and the stage's bytes have landed; `empty[s]` when every consumer arrival released
// the stage.
template <int Stages>
struct Pipeline {
  uint64_t full[Stages];
  uint64_t empty[Stages];

  // One thread, before a __syncthreads.
  __device__ __forceinline__ void init(uint32_t producer_arrivals, uint32_t consumer_arrivals) {
    for (int s = 0; s < Stages; ++s) {
      mbarrier_init(&full[s], producer_arrivals);
      mbarrier_init(&empty[s], consumer_arrivals);
    }
    mbarrier_init_fence();
  }

  // Producer: wait until the consumers released the stage (the previous pass's phase).
  __device__ __forceinline__ void producer_acquire(const PipelineState<Stages>& st) {
    mbarrier_wait(&empty[st.index], st.phase ^ 1);
  }
  // Producer: arrive on the stage's full barrier, announcing the bytes its copies will deliver.
  __device__ __forceinline__ void producer_commit(const PipelineState<Stages>& st, uint32_t bytes) {
    mbarrier_arrive_expect_tx(&full[st.index], bytes);
  }
  __device__ __forceinline__ uint64_t* full_barrier(const PipelineState<Stages>& st) {
    return &full[st.index];
  }
  __device__ __forceinline__ void consumer_wait(const PipelineState<Stages>& st) {
    mbarrier_wait(&full[st.index], st.phase);
  }
  __device__ __forceinline__ void consumer_release(const PipelineState<Stages>& st) {
    mbarrier_arrive(&empty[st.index]);
  }
  // A consumer warp releases the stage with one arrival: the __syncwarp orders every lane's reads
  // of the stage before lane 0's arrival (its release covers only lane 0's own accesses otherwise).
  __device__ __forceinline__ void warp_release(const PipelineState<Stages>& st) {
    __syncwarp();
    if (lane_index() == 0) consumer_release(st);
  }
};

}  // namespace flamia::sm90
