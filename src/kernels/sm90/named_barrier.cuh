// Named barriers (bar.sync / bar.arrive): synchronise a subset of a CTA's warps, e.g. one
// warpgroup, or signal producer -> consumer without waiting. Hardware id 0 is __syncthreads', so a
// kernel's ids come from its own enum whose first value is kFirstNamedBarrier.
#pragma once

#include <cstdint>
#include <type_traits>

#include "arch.cuh"

namespace flamia::sm90 {

constexpr uint32_t kNamedBarrierCount = 16;  // hardware barriers per CTA
constexpr uint32_t kFirstNamedBarrier = 1;   // 0 belongs to __syncthreads

// For static_assert on a kernel's enum: every id must lie in [kFirstNamedBarrier, 16).
template <typename Id>
constexpr bool named_barrier_id_valid(Id id) {
  static_assert(std::is_enum_v<Id>, "named barrier ids come from an enum");
  return uint32_t(id) >= kFirstNamedBarrier && uint32_t(id) < kNamedBarrierCount;
}

// Waits until `threads` threads (a multiple of 32, counting this warp) arrived at barrier `id`.
template <typename Id>
__device__ __forceinline__ void named_barrier_sync(Id id, uint32_t threads) {
  static_assert(std::is_enum_v<Id>, "named barrier ids come from an enum");
  asm volatile("bar.sync %0, %1;" : : "r"(uint32_t(id)), "r"(threads) : "memory");
}

// Counts this warp towards barrier `id` and continues; the waiters use named_barrier_sync with the
// same thread count.
template <typename Id>
__device__ __forceinline__ void named_barrier_arrive(Id id, uint32_t threads) {
  static_assert(std::is_enum_v<Id>, "named barrier ids come from an enum");
  asm volatile("bar.arrive %0, %1;" : : "r"(uint32_t(id)), "r"(threads) : "memory");
}

}  // namespace flamia::sm90
