// The backward attention kernels' geometry and parameters, shared by their device stages and the
// host code that launches them (attention_bwd.cu).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "flamia/packed.h"
#include "fwd_params.h"

namespace flamia::sm90::bwd {

using fwd::ScoreOperand;
using fwd::ScoreSpans;

constexpr int kBlockM = 64;    // query rows per step of a work item
constexpr int kBlockN = 128;   // keys per work item: two consumer warpgroups of 64
constexpr int kHeadDim = 128;  // the one head dimension instantiated
constexpr int kQStages = 2;    // depth of the query-side ring (Q, dO, their K-major copies, rows)

// One key block of one document and key/value head; the CTA loops over the group's query heads
// and, for each, over the query tiles from the causal diagonal (or the first) to the last.
struct alignas(16) WorkItem {
  int32_t doc;
  int32_t key_block;  // document-relative
  int32_t kv_head;
  int32_t query_tiles;  // per query head: the sort key
};
static_assert(sizeof(WorkItem) == 16, "one 16-byte vector load per item");

// First query tile a key block visits: causal, the one holding the block's first key.
FLAMIA_HD int32_t first_query_tile(int32_t key_block, bool causal) {
  return causal ? key_block * (kBlockN / kBlockM) : 0;
}

// Host: the work list of a validated layout for `ctas` persistent CTAs. Default (also the split
// backward's dK/dV pass): documents longest first, each document's items in (key/value head, key
// block) order (L2 locality), but the last kTailWaves * ctas items longest first (the CTAs'
// finishing times). Ordered (the statistics build's deterministic dQ additions): items longest
// first, ties in (document, head, key block) order (no concurrent CTA waits on another's dQ turn).
// In both a key block comes after the lower ones of its document and head — what the ordered turns
// rely on to be free of deadlock.
constexpr int kTailWaves = 4;
std::vector<WorkItem> backward_work_list(const PackedLayout& layout, bool causal, bool ordered,
                                         int ctas);

// The FP32 dQ accumulator and the deterministic mode's turn counters hold one slot per (query
// head, query tile of a document); the tiles of document b start at slot (cu_seqlens[b] + b *
// kBlockM) / kBlockM, so no two documents share one.
FLAMIA_HD int64_t dq_tile_slot(int64_t doc_begin, int doc, int q_tile) {
  return (doc_begin + int64_t(doc) * kBlockM) / kBlockM + q_tile;
}
inline int64_t dq_tile_slots(int64_t tokens, int num_docs) {
  return dq_tile_slot(tokens, num_docs, 0) + 1;
}

// A slot is a query tile's dQ [kBlockM][kHeadDim] as two halves of kHeadDim / 2 columns (one per
// consumer warpgroup), each in the order of the warpgroup's m64n64 accumulator fragment, warp by
// warp: register i of lane l of warp w at w * kDqWarpFloats + (i / 4) * 128 + 4 l + i % 4. Each
// warp's part is contiguous, so it can go to the accumulator in one bulk reduction of its own with
// no wait for the other warps (and a half is contiguous too), and the lanes' 16-byte shared
// stores are free of bank conflicts.
constexpr int kDqHalfFloats = kBlockM * kHeadDim / 2;
constexpr int kDqSlotFloats = 2 * kDqHalfFloats;
constexpr int kDqFragThreads = 128;  // one warpgroup
constexpr int kDqLanes = 32;         // one warp
constexpr int kDqWarpFloats = kDqHalfFloats / (kDqFragThreads / kDqLanes);
constexpr int kOrderedTurnsPerKeyBlock = 2;  // ordered mode: one turn per warpgroup
FLAMIA_HD int dq_fragment_offset(int thread, int reg) {
  return (thread / kDqLanes) * kDqWarpFloats + (reg / 4) * 4 * kDqLanes + 4 * (thread % kDqLanes) +
         reg % 4;
}
// The offset in its slot of dQ row `row`, column `col` (wgmma::acc_row / acc_col inverted).
FLAMIA_HD int dq_slot_offset(int row, int col) {
  const int half = col / (kHeadDim / 2), c = col % (kHeadDim / 2);
  const int warp = row / 16, r = row % 16;
  const int thread = 32 * warp + 4 * (r % 8) + (c % 8) / 2;
  const int reg = 4 * (c / 8) + 2 * (r / 8) + c % 2;
  return half * kDqHalfFloats + dq_fragment_offset(thread, reg);
}

// The inverse of dq_slot_offset for a float4 of a slot (offset a multiple of 4): its first
// element's row and column; its four elements are (row, col), (row, col + 1), (row + 8, col) and
// (row + 8, col + 1).
struct DqQuad {
  int row, col;
};
FLAMIA_HD DqQuad dq_slot_quad(int offset) {
  constexpr int kGroupFloats = 4 * kDqLanes;  // one register group of a warp
  const int half = offset / kDqHalfFloats, in_half = offset % kDqHalfFloats;
  const int warp = in_half / kDqWarpFloats, in_warp = in_half % kDqWarpFloats;
  const int group = in_warp / kGroupFloats, lane = in_warp % kGroupFloats / 4;
  return {16 * warp + lane / 4, half * (kHeadDim / 2) + 8 * group + 2 * (lane % 4)};
}

// DESIGN §4's backward statistics, gathered when Params::diagnostics is set (the emulator's
// EmulatorStats definitions).
struct DiagnosticCounters {
  unsigned long long ds_entries;    // visible dS entries
  unsigned long long ds_nonzero;    // of which nonzero
  unsigned long long ds_zero_dq;    // nonzero dS rounded to E4M3 zero in dQ's operand
  unsigned long long ds_zero_dk;    // ... in dK's operand
  unsigned long long pt_underflow;  // nonzero P rounded to zero in dV's operand
};

struct Params {
  CUtensorMap map_q;        // score operand Q [T][Hq][D]: E4M3 codes or BF16 inputs; kBlockM rows
  CUtensorMap map_k;        // score operand K [T][Hkv][D]; kBlockN rows
  CUtensorMap map_k_tiles;  // K's codes_tiles, the same boxes (mxfp8)
  CUtensorMap map_v;        // V codes [T][Hkv][D]
  CUtensorMap map_dout;     // dO codes [T][Hq][D]
  CUtensorMap map_qt;       // Q codes_t [Hq * D][Tt]: boxes of kBlockM positions x D, 64B swizzle
  CUtensorMap map_doutt;    // dO codes_t, likewise
  CUtensorMap map_kt;       // K codes_t [Hkv * D][Tt]: boxes of kBlockN positions x D
  const WorkItem* items = nullptr;
  int num_items = 0;
  int* counter = nullptr;                   // next item; zeroed before the launch
  const int32_t* cu_seqlens = nullptr;      // device
  const uint8_t* q_exponents = nullptr;     // [Hq][Tp] UE8M0
  const uint8_t* k_exponents = nullptr;     // [Hkv][Tp]
  const uint8_t* v_exponents = nullptr;     // [Hkv][Tp]
  const uint8_t* dout_exponents = nullptr;  // [Hq][Tp]
  int64_t tokens_padded = 0;                // Tp
  const float* lse = nullptr;               // [Hq][T], natural log (the forward's)
  const float* delta = nullptr;             // [Hq][T], D (the preprocess's)
  float* dq_accum = nullptr;  // [Hq][dq_tile_slots][kDqSlotFloats] FP32, zeroed before the launch
  int64_t dq_slots = 0;       // dq_tile_slots
  int* dq_turns = nullptr;    // [Hq][dq_slots]; null: unordered dQ reductions
  uint16_t* dk = nullptr;     // BF16 bits, element strides below
  uint16_t* dv = nullptr;
  int64_t dk_stride_token = 0, dk_stride_head = 0;
  int64_t dv_stride_token = 0, dv_stride_head = 0;
  bool wide_stores = false;  // dK and dV take 16-byte stores (bf16_rows.cuh)
  int64_t tokens = 0;
  int heads_q = 0;
  int group = 1;            // query heads per key/value head
  float scale_log2 = 0.0f;  // softmax scale * log2(e)
  float scale = 0.0f;       // softmax scale (dK's final factor)
  // [T][Hkv][D] FP32, with Hadamard-rotated Q and K: dK = scale * acc goes there, for
  // launch_rotate_dk (dk is not written then); null otherwise.
  float* dk_rotated = nullptr;
  DiagnosticCounters* diagnostics = nullptr;  // null: none gathered (the fast path)
  float* row_sum = nullptr;                   // [Hq][T] sum_j dS_ij, with diagnostics
  float* row_abs = nullptr;                   // [Hq][T] sum_j |dS_ij|
};

// How the main kernel adds a step's dQ partial to the FP32 accumulator (epilogue_bwd.cuh): by bulk
// reductions in any order (kBulk), or, in the statistics build, as Params::dq_turns says: from the
// registers in key-block order where it is set (deterministic). kNone: no dQ at all, the split
// backward's dK/dV pass (the deterministic mode; dQ comes from the query-stationary pass of
// dq_kernel.cuh).
enum class DqAddition { kBulk, kByParams, kNone };

// Launches the persistent main kernel (bwd_mxfp8.cu, bwd_mxfp8_split.cu, bwd_qk16.cu,
// bwd_qk16_split.cu) with `ctas` CTAs; with Params::diagnostics set, its statistics build
// (bwd_diagnostics.cu), which reads Params::dk_rotated too.
template <ScoreOperand kScore, bool kCausal, DqAddition kDq>
void launch_backward(const Params& p, int ctas, cudaStream_t stream);
template <ScoreOperand kScore, bool kCausal>
void launch_backward_diagnostics(const Params& p, int ctas, cudaStream_t stream);
// With Params::dk_rotated (mxfp8 only; bwd_mxfp8_rotated.cu, bwd_mxfp8_rotated_split.cu).
template <bool kCausal, DqAddition kDq>
void launch_backward_rotated(const Params& p, int ctas, cudaStream_t stream);

// Preprocess: D = rowsum(dequant(dO_q) * O) per (query head, token) (bwd_prepost.cu).
struct PreprocessParams {
  const uint8_t* dout_codes = nullptr;      // [T][Hq][D]
  const uint8_t* dout_exponents = nullptr;  // [Hq][Tp]
  int64_t tokens_padded = 0;
  const uint16_t* o = nullptr;  // BF16 bits, element strides below
  int64_t o_stride_token = 0, o_stride_head = 0;
  float* delta = nullptr;  // [Hq][T]
  int64_t tokens = 0;
  int heads_q = 0;
  DqClear dq_clear;  // zeroed here unless marked zeroed (dq_clear.cuh)
};
void launch_preprocess(const PreprocessParams& p, cudaStream_t stream);

// A BF16 output of [T][H][D] rows (element strides, like TokenTensor), which the postprocess and
// the dK rotation write four elements at a time: one 8-byte store where the view allows
// (`quad_stores`), else two pairs.
struct Bf16Rows {
  uint16_t* data = nullptr;
  int64_t stride_token = 0, stride_head = 0;
  bool quad_stores = false;
};

// Postprocess: dQ = dq_accum * scale (Hadamard-rotated back with `rotate`), to BF16.
struct PostprocessParams {
  const float* dq_accum = nullptr;  // as Params::dq_accum
  int64_t dq_slots = 0;
  const int32_t* cu_seqlens = nullptr;  // device
  int num_docs = 0;
  Bf16Rows dq;
  int64_t tokens = 0;
  int heads_q = 0;
  float scale = 0.0f;
  bool rotate = false;       // Q and K were Hadamard-rotated (QuantizeOptions::hadamard)
  int* dq_zeroed = nullptr;  // DqClear::zeroed, reset here (the accumulator's last reader)
};
void launch_postprocess(const PostprocessParams& p, cudaStream_t stream);

// With Hadamard-rotated Q and K: dK = the main kernel's FP32 rows (Params::dk_rotated) rotated back
// to the inputs' frame, to BF16.
struct RotateDkParams {
  const float* dk_rotated = nullptr;  // [T][Hkv][D]
  Bf16Rows dk;
  int64_t tokens = 0;
  int heads_kv = 0;
};
void launch_rotate_dk(const RotateDkParams& p, cudaStream_t stream);

}  // namespace flamia::sm90::bwd
