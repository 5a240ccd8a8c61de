// The forward's epilogue: O = O_acc * (2^R / l) to BF16 and LSE = ln 2 * (m - 8 + log2 l), written
// only for rows inside the document. Where O's view allows 16-byte stores, mxfp8 stages a warp's
// rows in shared memory with stmatrix and sends them by TMA tensor stores: one box of all 16 rows,
// or, in the warp the document ends in, one-row boxes for the rows inside (a box must not reach
// the next document's rows). mxfp8-qk16 (no room to stage) stores 16 bytes a lane after quad
// transposes (bf16_rows.cuh); other views take BF16 pairs. Measured against per-row bulk copies
// (a uniform loop of 16 copies a warp): 2-6 % faster forward on many-document workloads
// (docs/PERF.md, item 152).
#pragma once

#include <cuda_bf16.h>

#include "bf16_rows.cuh"
#include "fwd_smem.cuh"
#include "proxy_fence.cuh"
#include "softmax.cuh"
#include "tma.cuh"

namespace flamia::sm90::fwd {

// Where a work item's rows go: recomputed at the store rather than carried through the key loop,
// where a consumer has no registers to spare.
struct ItemRows {
  int64_t begin;  // packed-buffer token of the document's first row
  int m0;         // the item's first row in the document
  int length;     // the document's length
};

constexpr int kWarpRows = int(kOBoxRows);  // a warp's accumulator rows
constexpr int kMatrixRows = 8;             // rows of an stmatrix matrix (8 x 8 BF16)
constexpr uint32_t kChunkBytes = 16;       // an stmatrix matrix row; the swizzle's unit
constexpr int kBoxChunks = int(wgmma::kSw128RowBytes / kChunkBytes);

__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c,
                                            uint32_t d) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
               "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
}

// The warp's 16 rows of O through its stage, two boxes of 64 columns: a thread's registers
// 4g..4g+3 are the 8 x 8 matrices (rows 0-7, column group g) and (rows 8-15, g) in stmatrix's
// fragment layout, so one stmatrix.x4 writes groups g and g + 1 of all 16 rows (lane l addresses
// row l % 8 of matrix l / 8). Row r's 16-byte chunk c of a box sits at chunk c ^ (r % 8) (the
// 128-byte swizzle). If all 16 rows lie in the document, lane 0 stores both boxes; else lane r
// stores row r, if inside, as two one-row boxes (the swizzle follows the shared address, so a row's
// box reads it in place). A lane's stores of the item before must have read the stage first. The
// branch comes after the staging, where O's registers are free: before it, it cost spills.
__device__ __forceinline__ void store_o_staged(const Params& p, const float (&o)[kAccRegs],
                                               const float (&scale)[kRows], const ItemRows& item,
                                               int warp_row0, int head, uint8_t* stage) {
  const int lane = int(lane_index());
  if (lane < kWarpRows) tma_store_wait_read<0>();
  __syncwarp();
  {
    const int matrix = lane / kMatrixRows;
    const int row = lane % kMatrixRows + kMatrixRows * (matrix % 2);
    // Groups g and g + 1 (g even) share a box; this lane's chunk of the pair is (g % 8) ^ swap.
    const uint32_t swap = uint32_t((matrix / 2) ^ (lane % kMatrixRows));
    const uint32_t base = uint32_t(__cvta_generic_to_shared(stage)) + row * wgmma::kSw128RowBytes;
#pragma unroll
    for (int g = 0; g < kColPairs; g += 2) {
      const int i = 4 * g;
      const uint32_t box = uint32_t(g / kBoxChunks) * kOBoxBytes;
      const uint32_t chunk = (uint32_t(g % kBoxChunks) ^ swap) * kChunkBytes;
      stmatrix_x4(base + box + chunk, bf16x2_bits(o[i] * scale[0], o[i + 1] * scale[0]),
                  bf16x2_bits(o[i + 2] * scale[1], o[i + 3] * scale[1]),
                  bf16x2_bits(o[i + 4] * scale[0], o[i + 5] * scale[0]),
                  bf16x2_bits(o[i + 6] * scale[1], o[i + 7] * scale[1]));
    }
  }
  const int first = item.m0 + warp_row0;
  const int rows = min(kWarpRows, item.length - first);
  fence_async_shared();  // the stmatrix writes reach the TMA stores' reads
  __syncwarp();
  if (rows == kWarpRows) {
    if (lane == 0) {
#pragma unroll
      for (int b = 0; b < kOBoxes; ++b)
        tma_store_3d(&p.map_o, b * int(kOBoxCols), head, int32_t(item.begin + first),
                     stage + b * kOBoxBytes);
    }
  } else if (lane < rows) {
#pragma unroll
    for (int b = 0; b < kOBoxes; ++b)
      tma_store_3d(&p.map_o_row, b * int(kOBoxCols), head, int32_t(item.begin + first + lane),
                   stage + b * kOBoxBytes + lane * wgmma::kSw128RowBytes);
  }
  tma_store_commit();
}

// O from registers: 16 bytes a lane after quad transposes where the view allows, else BF16 pairs.
__device__ __forceinline__ void store_o_registers(const Params& p, const float (&o)[kAccRegs],
                                                  const float (&scale)[kRows], const ItemRows& item,
                                                  const int (&row)[kRows], int head, int quad) {
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
  }
}

// `o_stage`: SharedStorage::o_stage (mxfp8: map_o is set where the view takes wide stores), else
// null.
__device__ __forceinline__ void store_outputs(const Params& p, const float (&o)[kAccRegs],
                                              RowState& st, const ItemRows& item,
                                              const int (&row)[kRows], int head, int quad,
                                              uint8_t* o_stage) {
  // One division per row, not per element: O = O_acc * (2^R / l), as the emulator computes it.
  float scale[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    st.l[r] = quad_sum(st.l[r]);
    scale[r] = __fdiv_rn(exp2i(st.ref[r]), st.l[r]);
  }
  if (o_stage != nullptr && p.wide_stores) {
    // row[0] is the warp's first row plus lane / 4 (wgmma::acc_row).
    const int warp_row0 = row[0] - int(lane_index()) / 4;
    store_o_staged(p, o, scale, item, warp_row0, head,
                   o_stage + (warp_row0 / kWarpRows) * kOStageWarpBytes);
  } else {
    store_o_registers(p, o, scale, item, row, head, quad);
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int doc_row = item.m0 + row[r];
    if (quad == 0 && doc_row < item.length)
      // lg2.approx (l >= 1): within the tests' LSE tolerance of the emulator's log2, ~35
      // instructions fewer than log2f; the backward reads this LSE, so the passes agree.
      p.lse[int64_t(head) * p.tokens + item.begin + doc_row] =
          kLn2 * ((st.m[r] - kPOffset) + __log2f(st.l[r]));
  }
}

}  // namespace flamia::sm90::fwd
