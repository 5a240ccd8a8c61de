// Shared memory of the forward kernel: the Q ring (a work item's Q, its row factors and the item
// itself), the K and V^T rings with their per-key scale vectors, and the barriers. Every tile is
// 128B-swizzled and K-major, as TMA writes it and wgmma reads it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fwd_scales.cuh"
#include "mbarrier.cuh"
#include "wgmma.cuh"

namespace flamia::sm90::fwd {

template <ScoreOperand kScore>
struct SmemLayout : ScoreSpans<kScore> {
  static constexpr int kSpans = ScoreSpans<kScore>::kSpans;
  static constexpr uint32_t kQSpanBytes = kBlockM * wgmma::kSw128RowBytes;
  static constexpr uint32_t kKSpanBytes = kBlockN * wgmma::kSw128RowBytes;
  static constexpr uint32_t kQBytes = kSpans * kQSpanBytes;
  static constexpr uint32_t kKBytes = kSpans * kKSpanBytes;
  static constexpr uint32_t kVtBytes = kHeadDim * kBlockN;  // E4M3 V^T: [D][keys]
  static constexpr uint32_t kWarpgroupQBytes = wgmma::kM * wgmma::kSw128RowBytes;
  static_assert(kBlockN == int(wgmma::kSw128RowBytes), "a V^T row (keys) is one swizzle span");
  static_assert(kQSpanBytes % wgmma::kSw128AtomBytes == 0 &&
                    kKSpanBytes % wgmma::kSw128AtomBytes == 0 &&
                    kWarpgroupQBytes % wgmma::kSw128AtomBytes == 0,
                "descriptor bases stay 1024 B aligned");
};

// O's staging: each consumer warp's 16 rows as two boxes of 64 BF16 columns, 128 B rows
// 128B-swizzled as the TMA store reads them (epilogue_fwd.cuh), so that the 8 rows of one stmatrix
// matrix land in 8 different bank groups. mxfp8's shared memory has the 48 KB; mxfp8-qk16's BF16 Q
// and K tiles leave no room, and it stores O from registers.
constexpr int kOBoxes = kHeadDim / int(kOBoxCols);
constexpr uint32_t kOBoxBytes = kOBoxRows * wgmma::kSw128RowBytes;
constexpr uint32_t kOStageWarpBytes = kOBoxes * kOBoxBytes;
static_assert(kOBoxBytes % wgmma::kSw128AtomBytes == 0, "each box starts on a swizzle atom");
template <ScoreOperand kScore>
constexpr bool kOStaged = kScore == ScoreOperand::kE4m3;

// Where a work item's document lies in the packed batch: staged with the item, so the consumers
// start an item without a dependent read of cu_seqlens.
struct ItemDocument {
  int64_t begin;  // packed-buffer token of the document's first row
  int32_t length;
};

template <ScoreOperand kScore>
struct alignas(wgmma::kSw128AtomBytes) SharedStorage {
  using L = SmemLayout<kScore>;
  uint8_t q[kQStages][L::kQBytes];
  uint8_t k[kStages][L::kKBytes];
  uint8_t vt[kStages][L::kVtBytes];
  // The item's O rows on their way out (epilogue_fwd.cuh), where there is room: E4M3 Q and K. The
  // arrays before it are whole swizzle atoms, so each box is atom-aligned, as the swizzle needs.
  uint8_t o_stage[kOStaged<kScore> ? kBlockM / kOBoxRows : 1]
                 [kOStaged<kScore> ? kOStageWarpBytes : sizeof(uint4)];  // qk16: a placeholder
  KeyScales kscale[kStages];
  ValueScales vscale[kStages];
  QueryFactors q_factor[kQStages];  // E4M3 Q only
  WorkItem item[kQStages];
  ItemDocument item_doc[kQStages];  // the item's document, read by the producer from cu_seqlens
  Pipeline<kQStages> q_pipe;
  Pipeline<kStages> k_pipe, v_pipe;
};
static_assert(offsetof(SharedStorage<ScoreOperand::kE4m3>, o_stage) % wgmma::kSw128AtomBytes == 0,
              "O's boxes start on swizzle atoms");

}  // namespace flamia::sm90::fwd
