// The forward's epilogue: O = O_acc * (2^R / l) to BF16 and LSE = ln 2 * (m - 8 + log2 l), written
// only for rows inside the document (guarded stores, no TMA: a box would write the next
// document's rows); 16 bytes a lane where O's view allows (bf16_rows.cuh), else BF16 pairs.
#pragma once

#include <cuda_bf16.h>

#include "bf16_rows.cuh"
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
    const bool inside = item.m0 + row[r] < item.length;
    const int64_t token = item.begin + item.m0 + row[r];
    // The thread's first column, 2 quad (a transposed group's is 8 quad).
    uint16_t* dst = p.o + token * p.o_stride_token + int64_t(head) * p.o_stride_head + 2 * quad;
    if (p.wide_stores) {
      // The whole warp transposes (no shuffle under a divergent row test); the stores are guarded.
#pragma unroll
      for (int k = 0; k < kColPairs / kQuadLanes; ++k) {
        uint32_t words[kQuadLanes];
#pragma unroll
        for (int j = 0; j < kQuadLanes; ++j) {
          const int i = 4 * (kQuadLanes * k + j) + 2 * r;
          words[j] = bf16x2_bits(o[i] * scale[r], o[i + 1] * scale[r]);
        }
        const uint4 group = quad_transpose_warp(words);
        // Lane q stores group q of the span, its 8 columns: 8 q on (the row pointer is 2 q on).
        if (inside)
          *reinterpret_cast<uint4*>(dst + kQuadSpanElems * k + (kWideStoreElems - 2) * quad) =
              group;
      }
    } else if (inside) {
#pragma unroll
      for (int g = 0; g < kColPairs; ++g) {
        const int i = 4 * g + 2 * r;
        *reinterpret_cast<uint32_t*>(dst + 8 * g) =
            bf16x2_bits(o[i] * scale[r], o[i + 1] * scale[r]);
      }
    }
    if (!inside) continue;
    if (quad == 0)
      p.lse[int64_t(head) * p.tokens + token] = kLn2 * ((st.m[r] - kPOffset) + log2f(st.l[r]));
  }
}

}  // namespace flamia::sm90::fwd
