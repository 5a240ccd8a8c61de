// Thread-organisation constants of sm_90 shared by the primitives: warps and warpgroups.
#pragma once

#include <cstdint>

namespace flamia::sm90 {

constexpr uint32_t kWarpThreads = 32;
constexpr uint32_t kWarpgroupWarps = 4;  // wgmma and setmaxnreg act on 4 consecutive warps
constexpr uint32_t kWarpgroupThreads = kWarpThreads * kWarpgroupWarps;
// The most dynamic shared memory one CTA may opt into on sm_90 (227 KB).
constexpr uint32_t kMaxDynamicSmemBytes = 227 * 1024;

// Warp-uniform (the shuffle tells the compiler so, which keeps role branches uniform).
__device__ __forceinline__ uint32_t warp_index() {
  return __shfl_sync(0xffffffffu, threadIdx.x / kWarpThreads, 0);
}
__device__ __forceinline__ uint32_t warpgroup_index() {
  return __shfl_sync(0xffffffffu, threadIdx.x / kWarpgroupThreads, 0);
}
// The same, read from %tid.x anew at each call (volatile: never kept in a register between calls),
// for a value needed now and then across a loop whose registers are all taken.
__device__ __forceinline__ uint32_t warpgroup_index_reread() {
  uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  return tid / kWarpgroupThreads;
}
__device__ __forceinline__ uint32_t lane_index() {
  return threadIdx.x % kWarpThreads;
}

}  // namespace flamia::sm90
