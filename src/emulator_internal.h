// Internals of the CPU emulator shared by its forward and backward stages.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "flamia/emulator.h"

namespace flamia::emu {

// Rows of one document and head of an operand: value[i][d] * 2^exponent[i]. `values` are what the
// MMA consumes (E4M3 code values, BF16 values, or NVFP4 e2m1 x local scale), unscaled.
struct ScaledRows {
  int rows = 0, dim = 0;
  std::vector<float> rm;      // [rows][dim]
  std::vector<float> cm;      // [dim][rows], built when a product contracts over dim with j inner
  std::vector<int> exponent;  // [rows]

  const float* row(int i) const { return &rm[size_t(i) * dim]; }
  void build_column_major() {
    cm.assign(rm.size(), 0.0f);
    for (int i = 0; i < rows; ++i)
      for (int d = 0; d < dim; ++d) cm[size_t(d) * rows + i] = rm[size_t(i) * dim + d];
  }
};

// The operands of one (document, query head) task, per product (DESIGN §2 table).
struct TaskOperands {
  ScaledRows sq, sk;   // score product S = Q K^T
  ScaledRows q8;       // dK = dS^T Q
  ScaledRows k8;       // dQ = dS K
  ScaledRows v;        // O = P V and dP = dO V^T
  ScaledRows g;        // dO: dP and dV = P^T dO
  bool fold_v = true;  // false when V has per-channel scales (vgroup16): dequantized in place
  // E4M3 operands with one exponent per token: in the key tiles the forward's items see whole
  // (ForwardItems::visible), S reads K's tile codes (mxfp8) and O reads V's (flamia/quantize.h),
  // with one exponent per tile (tile_requantized); empty where they do not apply.
  ScaledRows sk_tiles, v_tiles;
};

// `rows` with each tile of `tile` rows requantized to E4M3 at the tile's largest exponent (the
// quantizer's tile codes, flamia/quantize.h): values E4M3(x 2^(e - T)), exponent T.
ScaledRows tile_requantized(const ScaledRows& rows, int tile);

// The forward kernel's work items over one document (scheduler.h's end-aligned tiles, rows in
// units of kRowUnit) and which key tiles an item's rows all see: the kernel runs an item's tiles
// from the last down and takes all but the first masked_tiles as seen whole (with its tile
// shape, exactly those are; other shapes keep the exact condition too).
struct ForwardItems {
  static constexpr int kRowUnit = 64;
  int length = 0, block_m = 0, block_n = 0, lead = 0, masked_tiles = 0;
  bool causal = true;

  ForwardItems(int doc_length, const TileShape& t, bool causal_mask)
      : length(doc_length), block_m(t.block_m), block_n(t.block_n), causal(causal_mask) {
    const int unit = block_m % kRowUnit == 0 ? kRowUnit : block_m;
    lead = (block_m - (length + unit - 1) / unit * unit % block_m) % block_m;
    masked_tiles = causal ? (block_m + block_n - 1) / block_n : 1;
  }
  // The first row of the item holding document row i (negative for a leading partial item).
  int item_of(int i) const { return (i + lead) / block_m * block_m - lead; }
  // The item's last key tile: the one holding its last row's diagonal, or the document's end.
  int last_tile(int item0) const {
    const int key_end = causal ? std::min(item0 + block_m, length) : length;
    return (key_end - 1) / block_n;
  }
  bool visible(int item0, int kb) const {
    return kb <= last_tile(item0) - masked_tiles &&
           (!causal || (kb + 1) * block_n <= std::max(item0, 0) + 1);
  }
};

// Everything the stages need to build TaskOperands for any (document, head).
struct Problem {
  const AttentionBatch* batch = nullptr;
  const QuantizedAttention* quant = nullptr;  // null for the bf16 recipe
  EmulatorConfig config;
  PackedLayout layout;
  float scale = 0.0f;       // softmax scale
  float scale_log2 = 0.0f;  // softmax scale * log2(e)

  TaskOperands operands(int doc, int head_q, bool backward) const;
};

// Rounds P~ or a scaled dS element as the recipe's MMA operand: E4M3 or BF16.
inline float round_operand(Recipe r, float x) {
  return r == Recipe::kBf16 ? bf16::round(x) : e4m3::decode(e4m3::encode(x));
}

// out[r][c] = sum_d a[r0 + r][d] b[c0 + c][d] for r < m, c < n, in FP32 with d ascending.
inline void tile_product_abt(const ScaledRows& a, int r0, int m, const ScaledRows& b, int c0, int n,
                             float* out) {
  const int dim = a.dim;
  for (int r = 0; r < m; ++r) {
    float* o = out + size_t(r) * n;
    for (int c = 0; c < n; ++c) o[c] = 0.0f;
    const float* ar = a.row(r0 + r);
    for (int d = 0; d < dim; ++d) {
      const float x = ar[d];
      const float* bc = &b.cm[size_t(d) * b.rows + c0];
      for (int c = 0; c < n; ++c) o[c] += x * bc[c];
    }
  }
}

// x * 2^e for any e a sum or difference of two scale exponents can reach ([-254, 254]), in two
// exact steps where one would leave exp2i's range.
inline float scale_by_pow2(float x, int e) {
  if (e >= -126 && e <= 127) return x * exp2i(e);
  return (x * exp2i(e / 2)) * exp2i(e - e / 2);
}

// The scaled base-2 logit t_ij, the same function in both passes (forward-backward consistency).
inline float scaled_logit(float s_raw, float row_factor, int col_exponent) {
  return (s_raw * row_factor) * exp2i(col_exponent);
}

void forward_task(const Problem& p, int doc, int head_q, AttentionOutputs<float>& out,
                  EmulatorStats& stats);
void backward_task(const Problem& p, int doc, int head_q, const AttentionOutputs<float>& fwd,
                   std::vector<float>& dq, std::vector<float>& dk_part, std::vector<float>& dv_part,
                   EmulatorStats& stats);

}  // namespace flamia::emu
