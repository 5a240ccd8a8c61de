// The forward attention kernel's geometry and parameters, shared by its device stages and the host
// code that launches it (attention_fwd.cc).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "dq_clear.cuh"
#include "scheduler.h"
#include "wgmma.cuh"

namespace flamia::sm90::fwd {

constexpr int kBlockM = 192;  // query rows per work item: three consumer warpgroups of 64
constexpr int kBlockN = 128;  // keys per tile
constexpr int kConsumerWarpgroups = kBlockM / wgmma::kM;
constexpr int kHeadDim = 128;  // the one head dimension instantiated
constexpr int kStages = 2;     // depth of the K and V^T rings
constexpr int kQStages = 2;    // depth of the Q ring (a work item's Q travels with it)
// O leaves the mxfp8 kernel in TMA boxes of one warp's accumulator rows by one 128-byte swizzle
// span.
constexpr uint32_t kOBoxCols = wgmma::kSw128RowBytes / sizeof(uint16_t);
constexpr uint32_t kOBoxRows = wgmma::kM / kWarpgroupWarps;
constexpr uint32_t kClearWarps = kWarpgroupWarps - 1;  // the producer warpgroup's spare warps

// The work list's geometry: tiles aligned to the document's end in warpgroup rows, so a partial
// tile is a document's first (fewest keys) and every warpgroup's rows stay 64-aligned in the
// document (the masked softmax relies on it).
constexpr ScheduleGeometry schedule_geometry(bool causal) {
  return ScheduleGeometry{kBlockM, kBlockN, causal, wgmma::kM};
}

// An item runs its key tiles from the last down; the first masked_tiles hold its rows' diagonal
// (causal; two of 128 keys for 192 rows) or the document's end, and every row of the item sees
// each later tile whole. There both kernels' score products read K's tile codes (the backward
// recomputes the forward's S) and the forward reads V's (flamia/quantize.h).
FLAMIA_HD constexpr int masked_tiles(bool causal) {
  return causal ? (kBlockM + kBlockN - 1) / kBlockN : 1;
}
// Whether the item holding document row `row` sees key tile `kb` whole (a later tile, above).
FLAMIA_HD bool item_sees_tile_whole(int32_t doc_len, int32_t row, int32_t kb, bool causal) {
  const ScheduleGeometry g = schedule_geometry(causal);
  const int32_t q_tile = (row + schedule_lead_rows(doc_len, g)) / kBlockM;
  return kb <= schedule_key_blocks(doc_len, q_tile, g) - 1 - masked_tiles(causal);
}

// The operands of the score product S = Q K^T.
enum class ScoreOperand {
  kE4m3,  // mxfp8: E4M3 codes with per-token exponents (any policy's exponent arrays)
  kBf16,  // mxfp8-qk16: the BF16 inputs
};

// A score operand's rows (the head dim) in 128-byte swizzle spans, each its own [rows][128 B] tile
// (E4M3: one span; BF16: two), and the k steps of the score product over them. Both kernels and
// the score-consistency probe walk the head dim this way.
template <ScoreOperand kScore>
struct ScoreSpans {
  static constexpr int kElemBytes = kScore == ScoreOperand::kE4m3 ? 1 : 2;
  static constexpr int kSpans = kHeadDim * kElemBytes / int(wgmma::kSw128RowBytes);
  static constexpr int kSpanElems = int(wgmma::kSw128RowBytes) / kElemBytes;
  static constexpr int kStepsPerSpan = int(wgmma::kSw128RowBytes / wgmma::kKBytes);
  static constexpr int kSteps = kSpans * kStepsPerSpan;
};

// A score product over the head dim, acc = A B^T, in ScoreSpans's k steps: A's and B's spans are
// [rows][128 B] tiles a_span_bytes and b_span_bytes apart. Issued only: the caller fences, commits
// and waits.
template <ScoreOperand kScore, int N>
__device__ __forceinline__ void issue_score_steps(float (&acc)[wgmma::acc_regs(N)],
                                                  const uint8_t* a, uint32_t a_span_bytes,
                                                  const uint8_t* b, uint32_t b_span_bytes) {
  using S = ScoreSpans<kScore>;
#pragma unroll
  for (int step = 0; step < S::kSteps; ++step) {
    const int span = step / S::kStepsPerSpan;
    const uint32_t offset = (step % S::kStepsPerSpan) * wgmma::kKBytes;
    const uint64_t desc_a =
        wgmma::desc_advance(wgmma::make_desc_sw128(a + span * a_span_bytes), offset);
    const uint64_t desc_b =
        wgmma::desc_advance(wgmma::make_desc_sw128(b + span * b_span_bytes), offset);
    if constexpr (kScore == ScoreOperand::kE4m3) {
      wgmma::mma_e4m3<N>(acc, desc_a, desc_b, step > 0);
    } else {
      wgmma::mma_bf16<N>(acc, desc_a, desc_b, step > 0);
    }
  }
}

struct Params {
  CUtensorMap map_q;         // [T][Hq][D]: E4M3 codes or BF16 inputs
  CUtensorMap map_k;         // [T][Hkv][D]
  CUtensorMap map_k_tiles;   // K's codes_tiles, the same shape (mxfp8): the fully visible tiles
  CUtensorMap map_vt;        // V's codes_t: [Hkv * D][Tt] (flamia/quantize.h)
  CUtensorMap map_vt_tiles;  // V's codes_t_tiles, the same shape: the fully visible key tiles
  CUtensorMap map_o;         // O [T][Hq][D] in boxes of one warp's rows (mxfp8, wide_stores)
  CUtensorMap map_o_row;     // the same in boxes of one row: a warp's rows the document ends in
  const WorkItem* items = nullptr;
  int num_items = 0;
  int* counter = nullptr;                // next item; zeroed by build_schedule
  const int32_t* cu_seqlens = nullptr;   // device
  const uint8_t* q_exponents = nullptr;  // [Hq][Tp] UE8M0; unused for kBf16
  const uint8_t* k_exponents = nullptr;  // [Hkv][Tp]; unused for kBf16
  const uint8_t* v_exponents = nullptr;  // [Hkv][Tp]
  int64_t tokens_padded = 0;             // Tp
  uint16_t* o = nullptr;                 // BF16 bits, element strides below
  int64_t o_stride_token = 0, o_stride_head = 0;
  bool wide_stores = false;  // O takes 16-byte stores (bf16_rows.cuh)
  float* lse = nullptr;      // [Hq][T]
  int64_t tokens = 0;
  int group = 1;            // query heads per key/value head
  float scale_log2 = 0.0f;  // softmax scale * log2(e)
  DqClear dq_clear;  // zeroed by the producer warpgroup's spare warps (dq_clear.cuh); may be none
};

// Launches the persistent kernel (fwd_mxfp8.cu, fwd_qk16.cu) with `ctas` CTAs.
template <ScoreOperand kScore, bool kCausal>
void launch_forward(const Params& p, int ctas, cudaStream_t stream);

template <ScoreOperand kScore>
size_t forward_smem_bytes();

}  // namespace flamia::sm90::fwd
