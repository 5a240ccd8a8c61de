// Scale policies and the quantizer's output layouts (DESIGN §2, §3).
//
// The CPU quantizer here is the bit-exact oracle of the GPU quantizer: both write the same arrays.
//
// Layouts, for an operand with T tokens in num_docs documents, H heads, head dim D, Tp = T rounded
// up to kTokenPadding and Tt (a multiple of 16 too), so every row of the token-contiguous arrays
// starts 16-byte aligned, as TMA needs:
//   codes              [T][H][D]    E4M3, the head dim contiguous (K-major for products over D:
//                                   S = Q K^T, dP = dO V^T)
//   codes_t            [H][D][Tt]   E4M3, tokens contiguous (K-major for products over tokens:
//                                   O = P V uses V^T, dV = P^T dO uses dO^T, dQ = dS K uses K^T,
//                                   dK = dS^T Q uses Q^T), Tt = transposed_tokens(T, num_docs);
//                                   documents 16-aligned, tokens permuted in groups of 16 (below)
//   codes_t_tiles      [H][D][Tt]   V only, beside codes_t (not under vgroup16): codes_t with
//                                   each document-relative tile of kKeyTileTokens keys
//                                   requantized to the tile's largest exponent T, code
//                                   E4M3(decode(c) 2^(e(j) - T)) (below); the forward's fully
//                                   visible key tiles read it, so that P~ needs no per-key fold
//   codes_tiles        [T][H][D]    K only, beside its codes (score_codes): the same for K's
//                                   codes, which the score products of those tiles read (both
//                                   kernels, so that the backward recomputes the forward's S)
//   exponents          [H][Tp]      UE8M0, one per token and head; a block policy repeats its
//                                   block's exponent on every token of the block; padding 127
//   channel_exponents  [T][H][D]    UE8M0, vgroup16's V only (one exponent per document-local
//                                   16-key group and channel, repeated on each key); that V is
//                                   4-bit: x / 2^e on the E2M1 grid (e rounded up so |x| / 2^e
//                                   <= 6), stored as the E4M3 code of the grid value
//   NVFP4 (Q and K of the nvfp4-mixed recipe):
//     packed           [T][H][D/2]  E2M1 pairs, element 2i in the low nibble
//     local_scales     [T][H][D/16] positive E4M3, rounded up
//     exponents        [H][Tp]      UE8M0 token scale
// Value of an E4M3 element: decode(code) * 2^(exponent - 127). NVFP4: e2m1(code) * e4m3(local) *
// 2^(exponent - 127).
//
// codes_t's token positions. The kernels feed P (an f32 wgmma accumulator converted to E4M3) as the
// register A operand of an FP8 wgmma whose B operand is codes_t; the accumulator gives thread t of
// a quad columns {2t, 2t+1, 2t+8, 2t+9} of every 16 while the FP8 A fragment wants k = 4t..4t+3,
// so codes_t stores every 16 document-relative tokens in that permuted order instead of shuffling
// registers in the hot loop, and starts every document 16-aligned, so that any document-relative
// 16-aligned key tile is a plain TMA box:
//   - document b, tokens [begin_b, begin_b + L_b), starts at P_b = transposed_doc_begin(begin_b, b)
//     = round_up(begin_b + 15 b, 16); its token begin_b + r sits at P_b + transposed_slot(r), where
//     transposed_slot permutes each group of 16: slots 0..15 hold tokens 0,1,8,9, 2,3,10,11,
//     4,5,12,13, 6,7,14,15 of the group;
//   - the documents never overlap and fit in Tt = round_up(T + 15 num_docs, 16): with
//     x = begin_b + 15 b, P_b + round_up(L_b, 16) = round_up(round_up(x, 16) + L_b, 16) <=
//     round_up(x + L_b + 15, 16) = P_{b+1}, and P_num_docs = Tt (the same formula at begin = T);
//   - every position that holds no token (the slots past a document's last token in its last
//     group, the gap of 0 or 16 positions before the next document's start, the end of the buffer)
//     holds code 0: the kernels multiply masked zeros by these bytes, so every call writes them.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "flamia/formats.h"
#include "flamia/packed.h"

namespace flamia {

enum class ScalePolicy {
  kToken,     // one exponent per token and head over the head dim (default; causally isolated)
  kBlock32,   // FLAMIA geometry: document-local 32-token blocks x head dim
  kTensor,    // one exponent per tensor (baseline)
  kFloor,     // block32 geometry with the floor-rounded exponent, which can clamp (baseline)
  kVGroup16,  // 4-bit V (E2M1 grid) in document-local 16-key groups per channel: the paper's
              // leaky 4-bit-V baseline; Q, K, dO per token
};
constexpr ScalePolicy kAllScalePolicies[] = {ScalePolicy::kToken, ScalePolicy::kBlock32,
                                             ScalePolicy::kTensor, ScalePolicy::kFloor,
                                             ScalePolicy::kVGroup16};
const char* to_string(ScalePolicy p);
ScalePolicy parse_scale_policy(const std::string& name);  // throws Error listing the valid names

constexpr int kBlockTokens = 32;
constexpr int kVGroupTokens = 16;
constexpr int kNvfp4GroupSize = 16;
constexpr int kTokenPadding = 16;
constexpr int kTransposedGroup =
    16;  // codes_t: documents start aligned to it, tokens permuted in it
constexpr float kNvfp4TokenMax = e2m1::kMax * e4m3::kMax;  // token scale keeps local scales <= 448
// K's and V's tile codes (codes_tiles, codes_t_tiles): the forward kernel's key tile,
// document-relative.
constexpr int kKeyTileTokens = 128;
constexpr uint8_t kPaddingExponentCode = uint8_t(kZeroGroupExponent + ue8m0::kBias);

enum class Operand { kQ = 0, kK = 1, kV = 2, kDO = 3 };
constexpr int kNumOperands = 4;
const char* to_string(Operand op);

// codes_t's token count: T tokens in num_docs documents (see the layout comment above).
FLAMIA_HD constexpr int64_t transposed_tokens(int64_t tokens, int num_docs) {
  return (tokens + int64_t(kTransposedGroup - 1) * num_docs + kTransposedGroup - 1) /
         kTransposedGroup * kTransposedGroup;
}
// codes_t's position of document `doc`'s first token (doc_begin = cu_seqlens[doc]); a multiple
// of kTransposedGroup. transposed_doc_begin(tokens, num_docs) == transposed_tokens(tokens,
// num_docs).
FLAMIA_HD constexpr int64_t transposed_doc_begin(int64_t doc_begin, int doc) {
  return (doc_begin + int64_t(kTransposedGroup - 1) * doc + kTransposedGroup - 1) /
         kTransposedGroup * kTransposedGroup;
}
// Offset from its document's transposed_doc_begin of the document-relative token r.
FLAMIA_HD constexpr int transposed_slot(int r) {
  const int j = r & (kTransposedGroup - 1);
  return (r & ~(kTransposedGroup - 1)) + 4 * ((j & 7) >> 1) + 2 * (j >> 3) + (j & 1);
}

// Index arithmetic of the layouts above (usable from device code).
struct QuantLayout {
  int64_t tokens = 0;
  int64_t tokens_padded = 0;  // Tp: exponents' token count
  int64_t tokens_t = 0;       // Tt: codes_t's positions per row
  int heads = 0;
  int dim = 0;

  static QuantLayout make(int64_t tokens, int heads, int dim, int num_docs) {
    return {tokens, (tokens + kTokenPadding - 1) / kTokenPadding * kTokenPadding,
            transposed_tokens(tokens, num_docs), heads, dim};
  }
  FLAMIA_HD int64_t code(int64_t t, int h, int d) const { return (t * heads + h) * dim + d; }
  // `pos` is a codes_t position: transposed_doc_begin(begin_b, b) + transposed_slot(t - begin_b)
  // for token t of document b.
  FLAMIA_HD int64_t code_t(int h, int d, int64_t pos) const {
    return (int64_t(h) * dim + d) * tokens_t + pos;
  }
  FLAMIA_HD int64_t exponent(int h, int64_t t) const { return int64_t(h) * tokens_padded + t; }
  FLAMIA_HD int64_t nvfp4_byte(int64_t t, int h, int d) const {
    return (t * heads + h) * (dim / 2) + d / 2;
  }
  FLAMIA_HD int64_t nvfp4_scale(int64_t t, int h, int d) const {
    return (t * heads + h) * (dim / kNvfp4GroupSize) + d / kNvfp4GroupSize;
  }
  int64_t num_codes() const { return tokens * heads * dim; }
  int64_t num_codes_t() const { return int64_t(heads) * dim * tokens_t; }
  int64_t num_exponents() const { return int64_t(heads) * tokens_padded; }
};

struct E4M3Operand {
  QuantLayout layout;
  std::vector<uint8_t> codes;    // empty for Q and K without QuantizeOptions::score_codes
  std::vector<uint8_t> codes_t;  // empty unless QuantizeOptions::transposed
  std::vector<uint8_t> exponents;
  std::vector<uint8_t> channel_exponents;  // vgroup16's V only
  std::vector<uint8_t> codes_t_tiles;      // V with codes_t only (writes_codes_t_tiles)
  std::vector<uint8_t> codes_tiles;        // K with codes only (writes_codes_tiles)

  int exponent(int64_t t, int h, int d) const {
    return channel_exponents.empty() ? ue8m0::exponent(exponents[layout.exponent(h, t)])
                                     : ue8m0::exponent(channel_exponents[layout.code(t, h, d)]);
  }
  float value(int64_t t, int h, int d) const {
    return e4m3::decode(codes[layout.code(t, h, d)]) * exp2i(exponent(t, h, d));
  }
};

struct Nvfp4Operand {
  QuantLayout layout;
  std::vector<uint8_t> packed;
  std::vector<uint8_t> local_scales;
  std::vector<uint8_t> exponents;

  uint8_t code(int64_t t, int h, int d) const {
    uint8_t byte = packed[layout.nvfp4_byte(t, h, d)];
    return (d & 1) ? uint8_t(byte >> 4) : uint8_t(byte & 0xF);
  }
  // e2m1 * local scale: exact in BF16 (at most 5 significant bits), the operand the Hopper path
  // feeds to a BF16 MMA; the token scale is applied outside the product.
  float unscaled_value(int64_t t, int h, int d) const {
    return e2m1::decode(code(t, h, d)) * e4m3::decode(local_scales[layout.nvfp4_scale(t, h, d)]);
  }
  int exponent(int64_t t, int h) const { return ue8m0::exponent(exponents[layout.exponent(h, t)]); }
  float value(int64_t t, int h, int d) const {
    return unscaled_value(t, h, d) * exp2i(exponent(t, h));
  }
};

// First non-finite input element of each operand, as a flat index (t * H + h) * D + d, or -1.
struct NonFiniteReport {
  std::array<int64_t, kNumOperands> first_index{-1, -1, -1, -1};
  std::array<QuantLayout, kNumOperands> layouts{};

  bool any() const;
  // "non-finite input in K at token 17, head 3, dim 5" for the first operand (Q, K, V, dO order)
  // with one; empty when all are finite.
  std::string message() const;
  void throw_if_any() const;
};

// How the GPU quantizer cuts the packed batch into tiles (quantize_gpu; the CPU quantizer has no
// tiles). Every choice writes the same bytes. kPacked: at multiples of the tile size in the packed
// buffer; kDocument: from each document's start; kAuto: flamia/quantize_gpu.h's rule.
enum class QuantizerTiling { kAuto, kPacked, kDocument };

struct QuantizeOptions {
  ScalePolicy policy = ScalePolicy::kToken;
  bool hadamard = false;   // rotate Q and K along the head dim before quantizing
  bool transposed = true;  // write codes_t (the backward's and PV's K-major copies)
  // Write Q's and K's codes, the score product's operand. mxfp8-qk16 turns them off: its score
  // products read the BF16 inputs and its backward reads Q's and K's codes_t only
  // (writes_codes).
  bool score_codes = true;
  bool nvfp4_qk = false;                            // also write NVFP4 Q and K
  QuantizerTiling tiling = QuantizerTiling::kAuto;  // GPU only
};

// Whether the quantizers write `op`'s codes: always but for Q and K without score_codes.
inline bool writes_codes(const QuantizeOptions& options, Operand op) {
  return options.score_codes || (op != Operand::kQ && op != Operand::kK);
}

// Whether the quantizers write `op`'s codes_t_tiles: V's, beside its codes_t, for any policy
// whose V has one exponent per token (all but vgroup16).
inline bool writes_codes_t_tiles(const QuantizeOptions& options, Operand op) {
  return op == Operand::kV && options.transposed && options.policy != ScalePolicy::kVGroup16;
}
// Whether they write `op`'s codes_tiles: K's, beside its codes (K has one exponent per token
// under every policy).
inline bool writes_codes_tiles(const QuantizeOptions& options, Operand op) {
  return op == Operand::kK && writes_codes(options, op);
}

// A code of codes_t_tiles: code c of a key with exponent e in a tile whose largest exponent is
// tile_max, E4M3(decode(c) 2^(e - tile_max)), exact but where it lands below E4M3's normal range.
// Shifts past kTileShiftFloor give 0 either way (|decode(c)| < 2^9).
constexpr int kTileShiftFloor = 32;
FLAMIA_HD constexpr int tile_shift(int e, int tile_max) {
  return e - tile_max < -kTileShiftFloor ? -kTileShiftFloor : e - tile_max;
}
uint8_t tile_code(uint8_t code, int shift);
// codes_t_tiles (codes_tiles) of an E4M3 operand with codes_t (codes) and exponents, one per
// token, on `layout`; throws Error on an operand without them or of another layout.
std::vector<uint8_t> make_codes_t_tiles(const E4M3Operand& v, const PackedLayout& layout);
std::vector<uint8_t> make_codes_tiles(const E4M3Operand& k, const PackedLayout& layout);

// BF16 inputs (raw bits). An operand whose data is null is skipped (see quantize_cpu): the
// forward passes no dO, the training call's backward passes dO alone (Q, K, V were quantized by
// its forward). With no tokens nothing is read, but a present operand still needs a non-null
// pointer: its codes_t (all padding) is written.
struct AttentionInputs {
  PackedLayout layout;
  TokenTensor<const uint16_t> q, k, v, dout;
};

// Operand op's input in an AttentionInputs or a DeviceAttentionInputs (quantize_gpu.h).
template <typename Inputs>
const TokenTensor<const uint16_t>& operand_input(const Inputs& in, Operand op) {
  switch (op) {
    case Operand::kQ:
      return in.q;
    case Operand::kK:
      return in.k;
    case Operand::kV:
      return in.v;
    case Operand::kDO:
      break;
  }
  return in.dout;
}

// Operand op's head count: Q and dO have the query heads, K and V the key/value heads.
inline int operand_heads(const PackedLayout& layout, Operand op) {
  return op == Operand::kQ || op == Operand::kDO ? layout.heads_q : layout.heads_kv;
}

// The operands a quantizer call writes, in Operand order: those whose input data is non-null.
// Throws Error when there is none.
template <typename Inputs>
std::array<bool, kNumOperands> present_operands(const Inputs& in) {
  std::array<bool, kNumOperands> present{};
  bool any = false;
  for (int op = 0; op < kNumOperands; ++op) {
    present[op] = operand_input(in, Operand(op)).data != nullptr;
    any = any || present[op];
  }
  if (!any) throw Error("no operand to quantize: the Q, K, V and dO inputs are all null");
  return present;
}

struct QuantizedAttention {
  E4M3Operand q, k, v, dout;
  Nvfp4Operand q4, k4;  // empty unless QuantizeOptions::nvfp4_qk
  NonFiniteReport non_finite;

  const E4M3Operand& operand(Operand op) const;
};

// Validates the layout and the present operands' views (throws Error), then quantizes those
// operands. An operand whose input data is null is skipped: its arrays (and NVFP4 Q's or K's) stay
// empty, its non_finite entry is -1; at least one operand must be present (Error otherwise). Every
// scale is per operand, so a present operand's arrays are the same whichever others are present.
// Non-finite inputs do not throw: they are reported in non_finite, counted as 0 in every scale,
// and written as code 0, so they cannot reach other tokens through a scale or a masked MMA lane.
QuantizedAttention quantize_cpu(const AttentionInputs& in, const QuantizeOptions& options);

// The scale geometry of `policy` for operand `op` (vgroup16 changes V only).
ScalePolicy effective_policy(ScalePolicy policy, Operand op);

}  // namespace flamia
