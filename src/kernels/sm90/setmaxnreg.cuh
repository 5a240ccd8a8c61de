// setmaxnreg: a warpgroup hands registers back to (dec) or takes them from (inc) the SM's pool, so
// a producer warpgroup can run on few registers while consumers hold large accumulators.
//
// PTX rules (setmaxnreg): the count is in [24, 256] and a multiple of 8; every warp of the
// warpgroup executes the same instruction. ptxas honours it only when the kernel has an entry cap
// (__launch_bounds__(threads, 1) or -maxrregcount); otherwise it warns (C7508) and ignores it.
#pragma once

#include <cstdint>

#include "arch.cuh"

namespace flamia::sm90 {

constexpr uint32_t kRegistersPerSm = 64 * 1024;
constexpr uint32_t kMaxnregMin = 24;
constexpr uint32_t kMaxnregMax = 256;
constexpr uint32_t kMaxnregGranule = 8;

constexpr bool maxnreg_valid(uint32_t regs) {
  return regs >= kMaxnregMin && regs <= kMaxnregMax && regs % kMaxnregGranule == 0;
}

// Registers per thread that ptxas may use at entry for `threads` threads and one CTA per SM.
constexpr uint32_t entry_register_cap(uint32_t threads) {
  return kRegistersPerSm / threads / kMaxnregGranule * kMaxnregGranule;
}

// True when the warpgroups' budgets after setmaxnreg fit the SM's register file.
constexpr bool register_split_fits(uint32_t producer_warpgroups, uint32_t producer_regs,
                                   uint32_t consumer_warpgroups, uint32_t consumer_regs) {
  return maxnreg_valid(producer_regs) && maxnreg_valid(consumer_regs) &&
         kWarpgroupThreads *
                 (producer_warpgroups * producer_regs + consumer_warpgroups * consumer_regs) <=
             kRegistersPerSm;
}

// The largest per-thread budget the consumer warpgroups can take once the producers run on
// `producer_regs`: the register file split evenly, rounded down to the setmaxnreg granule.
constexpr uint32_t consumer_register_budget(uint32_t producer_warpgroups, uint32_t producer_regs,
                                            uint32_t consumer_warpgroups) {
  const uint32_t per_thread_pool = kRegistersPerSm / kWarpgroupThreads;  // summed over warpgroups
  const uint32_t left = per_thread_pool - producer_warpgroups * producer_regs;
  const uint32_t even = left / consumer_warpgroups / kMaxnregGranule * kMaxnregGranule;
  return even < kMaxnregMax ? even : kMaxnregMax;
}

template <uint32_t Regs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(maxnreg_valid(Regs), "setmaxnreg: count in [24, 256], multiple of 8");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" : : "n"(Regs));
}

template <uint32_t Regs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(maxnreg_valid(Regs), "setmaxnreg: count in [24, 256], multiple of 8");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" : : "n"(Regs));
}

}  // namespace flamia::sm90
