// The backward's FP32 dQ accumulator must start at zero. The training call's forward kernel zeroes
// it with otherwise idle warps (its memory bandwidth is unused) and marks it zeroed; the backward's
// preprocess zeroes it only when unmarked, and the postprocess, its last reader, unmarks it. The
// mark lives on the device so that CUDA graphs replay the protocol: a backward captured or replayed
// without a forward before it still starts from zero.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flamia::sm90 {

struct DqClear {
  uint4* accum = nullptr;  // null: nothing to clear
  int64_t vectors = 0;     // 16-byte vectors of the accumulator
  int* zeroed = nullptr;   // device flag: 1 once zeroed, 0 once read by a postprocess
  // Between a warp's stores: the forward paces its clear so that the stores do not crowd out its
  // own loads (unpaced, they made the 16x4096 forward 0.1 ms slower, docs/PERF.md).
  uint32_t pause_ns = 0;
};

// Thread `first` of `threads` zeroes vectors first, first + threads, ...: consecutive threads store
// consecutive vectors (a warp's store is 512 contiguous bytes). Streaming stores, so that the zeros
// do not evict the running kernel's operands from L2.
__device__ __forceinline__ void zero_vectors(uint4* dst, int64_t vectors, int64_t first,
                                             int64_t threads, uint32_t pause_ns = 0) {
  for (int64_t i = first; i < vectors; i += threads) {
    __stcs(dst + i, make_uint4(0, 0, 0, 0));
    if (pause_ns != 0) __nanosleep(pause_ns);
  }
}

}  // namespace flamia::sm90
