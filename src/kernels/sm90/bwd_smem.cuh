// Shared memory of the backward main kernel: the key block (K, V and K's K-major copy, loaded once
// per work item), the query-side ring (Q, dO, their K-major copies and the per-row vectors of one
// query tile), the quantized dS tile of the dQ product, and the dQ row-scale maxima.
//
// Every MMA operand is K-major and swizzled as TMA writes it and wgmma reads it: 128 B rows where
// K spans 128 bytes, 64 B rows for the query-side K-major copies (K = the tile's 64 queries).
#pragma once

#include <cstdint>

#include "bf16_rows.cuh"
#include "bwd_params.h"
#include "flamia/formats.h"
#include "flamia/row_terms.h"
#include "mbarrier.cuh"
#include "wgmma.cuh"

namespace flamia::sm90::bwd {

// Per query row of a tile, staged by the producer (bwd_scales.cuh). dO's row scale and dV's fold
// reference C enter P's exponent, so the gradient works on P'' = P 2^(e_dO - C + 8), which is dV's
// operand as it stands, and dS'' = P'' (dP 2^e_v - D 2^-e_dO) 2^e_q = dS 2^e_q 2^(8 - C), dK's
// operand up to its key scale and a power of two uniform over the step (softmax_bwd.cuh).
struct RowTerms {
  float rf;     // 2^e_q: S's row factor on E4M3 Q (the softmax scale rides on the key's) and
                // Q's scale folded into dS^T for dK
  float bias;   // e_dO - C + 8 - LSE * log2(e); -inf outside the document or where the row sees
                // no key of the block
  float delta;  // D 2^-e_dO to kStagedDeltaBits, rf in its low bits; 0 (and rf) outside the
                // document
};
// Staged as two floats a query, bias and the delta word, which carries rf (row_terms.h): a
// thread's sixteen queries in eight 16-byte loads (load_pair_terms).
constexpr int kRowTermFloats = 2;
constexpr int kQuadQueries = kBlockM / kQuadLanes;  // a thread's queries: 8 g + 2 quad + c
// A quad position's queries in its order n = 2 g + c, two floats each, then a pad that puts the
// four positions' 16-byte loads in distinct banks (a 144-byte stride: 4 words apart mod 32).
constexpr int kQuadTermFloats = kQuadQueries * kRowTermFloats + 4;
static_assert(kQuadTermFloats % 4 == 0, "16-byte loads");

struct alignas(16) QueryRows {
  float terms[kQuadLanes][kQuadTermFloats];
  float q_inverse[kBlockM];  // 2^-e_q: with dv_unit, dS'' back to dS (dQ's row unit); 0 outside
  float dv_unit;  // 2^(C - 8), C = max e_dO over the tile's rows that see the key block; 0: none
};

// Where the tile's query r = 8 g + 2 quad + c keeps its RowTerms: place 2 g + c of quad position
// quad's run (the order softmax_bwd.cuh's load_pair_terms reads).
__device__ __forceinline__ float* row_terms_of(QueryRows& rows, int r) {
  constexpr int kGroupQueries = 2 * kQuadLanes;  // an accumulator's 8-query column group
  const int quad = (r % kGroupQueries) / 2, place = (r / kGroupQueries) * 2 + r % 2;
  return rows.terms[quad] + place * kRowTermFloats;
}

// The dS tile's rows (queries) hold the key block's 128 keys, each 16 in transposed_slot order so
// that it meets K's codes_t in the dQ product.
constexpr uint32_t kDsBytes = kBlockM * kBlockN;
// Rotating buffers of per-query |dS| maxima as scale fields (e4m3_scale_field, for atomicMax): a
// step fills one while the previous one may still be read and the one before is being reset to
// the floor field, which leaves the readers no clamp to apply.
constexpr int kRowMaxFloor = int(e4m3_scale::kMinField);
constexpr int kMaxBuffers = 3;
constexpr int kDqStages = 2;

template <ScoreOperand kScore>
struct SmemLayout : ScoreSpans<kScore> {
  static constexpr int kSpans = ScoreSpans<kScore>::kSpans;
  static constexpr uint32_t kQSpanBytes = kBlockM * wgmma::kSw128RowBytes;
  static constexpr uint32_t kKSpanBytes = kBlockN * wgmma::kSw128RowBytes;
  static constexpr uint32_t kQBytes = kSpans * kQSpanBytes;      // score operand Q
  static constexpr uint32_t kKBytes = kSpans * kKSpanBytes;      // score operand K
  static constexpr uint32_t kCodesQBytes = kBlockM * kHeadDim;   // dO codes
  static constexpr uint32_t kCodesKBytes = kBlockN * kHeadDim;   // V codes, K codes_t
  static constexpr uint32_t kCodesTQBytes = kHeadDim * kBlockM;  // Q, dO codes_t
  static constexpr uint32_t kQStageBytes = kQBytes + kCodesQBytes + 2 * kCodesTQBytes;
  // K's tile codes (mxfp8's E4M3 score operand only): S where the forward's item saw the key block
  // whole (fwd::item_sees_tile_whole), so the recomputation reads the forward's codes.
  static constexpr bool kKeyTiles = kScore == ScoreOperand::kE4m3;
  static constexpr uint32_t kKTileBytes = kKeyTiles ? kKBytes : 0;
  static constexpr uint32_t kKeyBlockBytes = kKBytes + kKTileBytes + 2 * kCodesKBytes;
  // A consumer warpgroup's 64 keys of a [keys][128 B] tile.
  static constexpr uint32_t kWarpgroupKeyBytes = wgmma::kM * wgmma::kSw128RowBytes;
  static_assert(kHeadDim == int(wgmma::kSw128RowBytes), "an E4M3 row is one 128 B swizzle span");
  static_assert(kBlockM == int(wgmma::kSw64RowBytes), "a query tile's K-major copy: 64 B rows");
  static_assert(kBlockN == int(wgmma::kSw128RowBytes), "a key block's K-major copy: 128 B rows");
  static_assert(kQSpanBytes % wgmma::kSw128AtomBytes == 0 && kCodesTQBytes % 1024 == 0,
                "descriptor bases stay 1024 B aligned");
};

template <ScoreOperand kScore>
struct alignas(wgmma::kSw128AtomBytes) SharedStorage {
  using L = SmemLayout<kScore>;
  uint8_t k[L::kKBytes];  // score operand K
  // K's tile codes (a swizzle atom of padding for BF16 K, which has none)
  uint8_t k_tiles[L::kKeyTiles ? L::kKTileBytes : wgmma::kSw128AtomBytes];
  uint8_t v[L::kCodesKBytes];       // V codes [keys][D]
  uint8_t kt[L::kCodesKBytes];      // K codes_t [D][keys]
  uint8_t q[kQStages][L::kQBytes];  // score operand Q
  uint8_t dout[kQStages][L::kCodesQBytes];
  uint8_t qt[kQStages][L::kCodesTQBytes];     // Q codes_t [D][queries], 64B swizzle
  uint8_t doutt[kQStages][L::kCodesTQBytes];  // dO codes_t, likewise
  // Quantized dS [queries][keys]: one buffer, as a warpgroup writes the next step's only after
  // the kMaxReady barrier, which the other passes only once its dQ product has completed.
  uint8_t ds[kDsBytes];
  // Per warpgroup, by step parity: its dQ partial for the bulk reduction (one may still be read
  // while the next is written).
  float dq_stage[2][kDqStages][kDqHalfFloats];
  QueryRows rows[kQStages];
  alignas(8) int row_max[kMaxBuffers][kBlockM];  // 8-aligned: a thread's query pairs as int2
  WorkItem item;
  float k_tile_unit;    // 2^max e_k over the key block: the score unit on K's tile codes
  uint64_t item_ready;  // the copy warp's arrival once `item` holds the next work item
  Pipeline<1> kv_pipe;
  Pipeline<kQStages> q_pipe;
};

}  // namespace flamia::sm90::bwd
