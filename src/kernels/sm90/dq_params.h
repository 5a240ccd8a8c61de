// The split backward's dQ pass (dq_kernel.cuh): the deterministic mode (not the statistics
// build). The main kernel runs without dQ (DqAddition::kNone); this query-stationary kernel
// recomputes S and dP per (query block, key block), forms the dQ operand exactly as the fused
// kernel does and keeps dQ in registers, summed over the key blocks in ascending order: the ordered
// mode's additions, so its dQ is the fused ordered kernel's bit for bit, without an accumulator,
// turns or postprocess.
#pragma once

#include <vector>

#include "bwd_params.h"

namespace flamia::sm90::bwd::dqpass {

constexpr int kItemRows = 2 * kBlockM;  // query rows of a work item: two consumer warpgroups

// One work item: a 128-row query block of one document and query head, and the key blocks it
// visits (from the first).
struct alignas(16) DqWorkItem {
  int32_t doc;
  int32_t query_block;  // document-relative
  int32_t head;         // query head
  int32_t key_blocks;   // the sort key; at least 1
};
static_assert(sizeof(DqWorkItem) == 16, "one 16-byte vector load per item");

// Host: the items of a validated layout for `ctas` persistent CTAs: documents longest first, each
// document's items by key/value head (its query heads together), longest first within the head
// (the CTAs running at one time then read a few heads' key blocks, which stay in L2), but the last
// kTailWaves * ctas items longest first (the CTAs' finishing times), as the main kernel's list.
std::vector<DqWorkItem> dq_work_list(const PackedLayout& layout, bool causal, int ctas);

struct DqParams {
  CUtensorMap map_q;        // Q codes (mxfp8) or BF16 Q (mxfp8-qk16) [T][Hq][D]; kBlockM rows
  CUtensorMap map_dout;     // dO codes, likewise
  CUtensorMap map_k;        // K codes or BF16 K [T][Hkv][D]; kBlockN rows
  CUtensorMap map_k_tiles;  // K's codes_tiles, the same boxes (mxfp8)
  CUtensorMap map_v;        // V codes
  CUtensorMap map_kt;       // K codes_t [Hkv * D][Tt]: boxes of kBlockN positions x D
  const DqWorkItem* items = nullptr;
  int num_items = 0;
  int* counter = nullptr;  // next item; zeroed before the launch
  const int32_t* cu_seqlens = nullptr;
  const uint8_t* q_exponents = nullptr;     // [Hq][Tp] UE8M0
  const uint8_t* k_exponents = nullptr;     // [Hkv][Tp]
  const uint8_t* v_exponents = nullptr;     // [Hkv][Tp]
  const uint8_t* dout_exponents = nullptr;  // [Hq][Tp]
  int64_t tokens_padded = 0;
  const float* lse = nullptr;    // [Hq][T], natural log
  const float* delta = nullptr;  // [Hq][T], D (the preprocess's)
  uint16_t* dq = nullptr;        // BF16 bits, element strides below (even)
  int64_t dq_stride_token = 0, dq_stride_head = 0;
  int64_t tokens = 0;
  int group = 1;
  float scale_log2 = 0.0f;  // softmax scale * log2(e)
  float scale = 0.0f;       // softmax scale (dQ's final factor)
  bool rotate = false;      // Hadamard-rotated Q and K (mxfp8): dQ rotated back
};

// Instantiated per recipe (bwd_dq_mxfp8.cu, bwd_dq_qk16.cu).
template <ScoreOperand kScore, bool kCausal>
void launch_dq_pass(const DqParams& p, int ctas, cudaStream_t stream);

}  // namespace flamia::sm90::bwd::dqpass
