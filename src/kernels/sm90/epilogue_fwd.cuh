// The forward's epilogue: O = O_acc * (2^R / l) to BF16 and LSE = ln 2 * (m - 8 + log2 l), written
// only for rows inside the document (guarded stores, no TMA: a box would write the next
// document's rows).
#pragma once

#include <cuda_bf16.h>

#include "softmax.cuh"

namespace flamia::sm90::fwd {

// Where a work item's rows go: recomputed at the store rather than carried through the key loop,
// where a consumer has no registers to spare.
struct ItemRows {
  int64_t begin;  // packed-buffer token of the document's first row
  int m0;         // the item's first row in the document
  int length;     // the document's length
};

__device__ __forceinline__ void store_outputs(const Params& p, const float (&o)[kAccRegs],
                                              RowState& st, const ItemRows& item,
                                              const int (&row)[kRows], int head, int quad) {
  // One division per row, not per element: O = O_acc * (2^R / l), as the emulator computes it.
  float scale[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    st.l[r] = quad_sum(st.l[r]);
    scale[r] = __fdiv_rn(exp2i(st.ref[r]), st.l[r]);
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (item.m0 + row[r] >= item.length) continue;
    const int64_t token = item.begin + item.m0 + row[r];
    uint16_t* dst = p.o + token * p.o_stride_token + int64_t(head) * p.o_stride_head;
#pragma unroll
    for (int g = 0; g < kColPairs; ++g) {
      const int i = 4 * g + 2 * r;
      const float x = o[i] * scale[r];
      const float y = o[i + 1] * scale[r];
      *reinterpret_cast<__nv_bfloat162*>(dst + 8 * g + 2 * quad) = __floats2bfloat162_rn(x, y);
    }
    if (quad == 0)
      p.lse[int64_t(head) * p.tokens + token] = kLn2 * ((st.m[r] - kPOffset) + log2f(st.l[r]));
  }
}

}  // namespace flamia::sm90::fwd
