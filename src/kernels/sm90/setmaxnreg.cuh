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
// An SM's register file is split among its four sub-partitions (warp schedulers); warp w runs on
// sub-partition w % 4 and takes its registers from that one's quarter.
constexpr uint32_t kSubPartitions = 4;
constexpr uint32_t kRegistersPerSubPartition = kRegistersPerSm / kSubPartitions;
constexpr uint32_t kMaxnregMin = 24;
constexpr uint32_t kMaxnregMax = 256;
constexpr uint32_t kMaxnregGranule = 8;

constexpr bool maxnreg_valid(uint32_t regs) {
  return regs >= kMaxnregMin && regs <= kMaxnregMax && regs % kMaxnregGranule == 0;
}

// Registers per thread that ptxas may use at entry for `threads` threads and one CTA per SM: the
// busiest sub-partition's warps share its quarter of the file. For whole warpgroups that is the
// file over the threads; a ninth warp costs as much as a fourth warpgroup (288 threads: 168, not
// 65536 / 288), so no single producer warp can free registers beside two consumer warpgroups that
// a producer warpgroup could not (docs/PERF.md, item 205).
constexpr uint32_t entry_register_cap(uint32_t threads) {
  const uint32_t warps = (threads + kWarpThreads - 1) / kWarpThreads;
  const uint32_t busiest = (warps + kSubPartitions - 1) / kSubPartitions;
  return kRegistersPerSubPartition / (busiest * kWarpThreads) / kMaxnregGranule * kMaxnregGranule;
}

// The CTA's registers are those allocated at launch, entry_register_cap per thread, not the whole
// register file: setmaxnreg.inc waits until decs return enough, so budgets above this pool never
// run (the warps hang in the inc). Per thread of one warpgroup, summed over the warpgroups:
constexpr uint32_t launch_register_pool(uint32_t warpgroups) {
  return warpgroups * entry_register_cap(warpgroups * kWarpgroupThreads);
}

// True when the warpgroups' budgets after setmaxnreg fit the registers allocated at launch.
constexpr bool register_split_fits(uint32_t producer_warpgroups, uint32_t producer_regs,
                                   uint32_t consumer_warpgroups, uint32_t consumer_regs) {
  return maxnreg_valid(producer_regs) && maxnreg_valid(consumer_regs) &&
         producer_warpgroups * producer_regs + consumer_warpgroups * consumer_regs <=
             launch_register_pool(producer_warpgroups + consumer_warpgroups);
}

// The largest per-thread budget the consumer warpgroups can take once the producers run on
// `producer_regs`: the launch pool split evenly, rounded down to the setmaxnreg granule.
constexpr uint32_t consumer_register_budget(uint32_t producer_warpgroups, uint32_t producer_regs,
                                            uint32_t consumer_warpgroups) {
  const uint32_t per_thread_pool = launch_register_pool(producer_warpgroups + consumer_warpgroups);
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

// 3 warpgroups: 168 per thread at launch, so 40 + 2 x 232 and 24 + 2 x 240 (the backward) use the
// pool exactly, and 32 + 2 x 240 would not fit (it hangs).
static_assert(consumer_register_budget(1, 40, 2) == 232 &&
                  consumer_register_budget(1, 32, 2) == 232 &&
                  consumer_register_budget(1, 24, 2) == 240,
              "launch pool of three warpgroups");
// 4 warpgroups: 128 per thread at launch, so 32 + 3 x 160 fits.
static_assert(consumer_register_budget(1, 32, 3) == 160, "launch pool of four warpgroups");
// Two warpgroups and one more warp: three warps on one sub-partition, as with three warpgroups.
static_assert(entry_register_cap(2 * kWarpgroupThreads + kWarpThreads) == entry_register_cap(384),
              "a ninth warp");

}  // namespace flamia::sm90
