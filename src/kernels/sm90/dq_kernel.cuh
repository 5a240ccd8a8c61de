// The split backward's dQ pass (dq_params.h), one persistent CTA per multiprocessor, 384 threads:
//   warpgroup 0, warp 0  producer, on 24 registers: takes work items through an atomic counter,
//                        TMA-loads each item's Q (E4M3 codes, or BF16 rows for mxfp8-qk16) and
//                        dO (64-row boxes) into a ring (ScoreLayout::kItemStages), then for each
//                        key block from the first K's token codes and/or its tile codes (whichever
//                        the two warpgroups' S reads; BF16 rows for mxfp8-qk16), V, K's codes_t
//                        and the keys' factors into a two-stage ring. The other warps exit.
//   warpgroups 1, 2      consumers on 240 registers, 64 query rows each (a query tile of the
//                        fused kernel), taking turns on the tensor cores: a turn is the dQ
//                        product of a warpgroup's previous key block and the S and dP products of
//                        its next (the forward's ping-pong; measured neutral here, docs/PERF.md
//                        item 215).
// Per (query tile, key block) the consumers form the fused kernel's dQ operand from the same
// inputs by the same operations (softmax_bwd.cuh, bwd_scales.cuh, epilogue_bwd.cuh), in the
// accumulator layout with queries as rows: a thread's two rows carry their row terms through the
// item and each row's scale over the block's 128 keys is a quad reduction. The dQ product
// (register A against K's codes_t) times the row units is added to dQ in ascending key-block
// order with the rounding of the ordered mode's FP32 reductions; dQ goes out as BF16 at the item's
// end, scaled as the postprocess does.
// Included by the instantiation files (bwd_dq_mxfp8.cu, bwd_dq_qk16.cu) only.
#pragma once

#include <climits>

#include "bf16_rows.cuh"
#include "check.h"
#include "dq_params.h"
#include "epilogue_bwd.cuh"
#include "flamia/emulator.h"
#include "flamia/row_terms.h"
#include "fp8_convert.cuh"
#include "hadamard_lanes.cuh"
#include "mbarrier.cuh"
#include "named_barrier.cuh"
#include "setmaxnreg.cuh"
#include "softmax_bwd.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace flamia::sm90::bwd::dqpass {

constexpr int kKeys = kBlockN;                      // keys per step
constexpr int kAccRegs = wgmma::acc_regs(kKeys);    // S, dP and dQ: m64n128 each
constexpr int kSlices = kKeys / wgmma::kKE4m3;      // k32 slices of the dQ product
constexpr int kColGroups = kKeys / 8;               // 8-column groups of an accumulator
constexpr int kRowHalves = 2;                       // a thread's rows r and r + 8
constexpr int kTilesPerItem = kItemRows / kBlockM;  // query tiles: one per consumer warpgroup
constexpr int kKeyStages = 2;                       // key-block ring
constexpr uint32_t kRowBytes = wgmma::kSw128RowBytes;
constexpr uint32_t kTileBytes = kBlockM * kRowBytes;  // one warpgroup's 64 rows of dO codes
constexpr uint32_t kItemTileBytes = kTilesPerItem * kTileBytes;
constexpr uint32_t kKeyTileBytes = kKeys * kRowBytes;
constexpr int kProducerThreads = int(kWarpThreads);
constexpr int kKeysPerLane = kKeys / kProducerThreads;
static_assert(kHeadDim == int(kRowBytes) && kKeys == int(kRowBytes),
              "E4M3 rows of dO, V and K's codes_t are one 128 B swizzle span");
static_assert(kKeysPerLane * kProducerThreads == kKeys, "one warp covers a key block");

// The keys' factors of one block, where a consumer thread reads them: quad position q of column
// group g holds keys 8 g + 2 q and 8 g + 2 q + 1.
struct alignas(16) KeyFactors {
  float4 v_fold[kColGroups][kQuadLanes];  // 2^e_v of both keys, then 2^e_k (0 past the document)
  float2 score[kColGroups][kQuadLanes];   // c 2^e_k: S's column factor on K's token codes
  float tile_score;                       // c 2^(the block's largest e_k), mxfp8's tile codes
};

// S's operands Q and K: E4M3 codes (mxfp8) or BF16 inputs (mxfp8-qk16), in 128 B swizzle spans
// of the head dimension (one or two), as the fused kernel's SmemLayout.
template <ScoreOperand kScore>
struct ScoreLayout : ScoreSpans<kScore> {
  static constexpr uint32_t kQTileBytes = ScoreSpans<kScore>::kSpans * kTileBytes;
  static constexpr uint32_t kKBytes = ScoreSpans<kScore>::kSpans * kKeyTileBytes;
  // K's tile codes: mxfp8 only (the fused kernel's SmemLayout::kKeyTiles).
  static constexpr bool kKeyTiles = kScore == ScoreOperand::kE4m3;
  // The Q / dO ring: two stages of E4M3 Q; one of BF16 Q, whose rows take twice the bytes (the
  // next item's loads then wait for the item's last score products: once per item).
  static constexpr int kItemStages = kScore == ScoreOperand::kE4m3 ? 2 : 1;
};

// K's tile codes, a ring beside K's (mxfp8); none for BF16 K, whose pass needs every byte of the
// rest.
template <bool kKeyTiles, uint32_t kBytes>
struct KeyTileRing {
  uint8_t k_tiles[kKeyStages][kBytes];
};
template <uint32_t kBytes>
struct KeyTileRing<false, kBytes> {};

template <ScoreOperand kScore>
struct alignas(wgmma::kSw128AtomBytes) SharedStorage
    : KeyTileRing<ScoreLayout<kScore>::kKeyTiles, ScoreLayout<kScore>::kKBytes> {
  using L = ScoreLayout<kScore>;
  uint8_t q[L::kItemStages][kTilesPerItem][L::kQTileBytes];  // the item's query tiles
  uint8_t dout[L::kItemStages][kItemTileBytes];
  uint8_t k[kKeyStages][L::kKBytes];  // K's token codes or BF16 rows
  uint8_t v[kKeyStages][kKeyTileBytes];
  uint8_t kt[kKeyStages][kKeyTileBytes];  // K's codes_t [D][keys]
  KeyFactors keys[kKeyStages];
  DqWorkItem item[L::kItemStages];
  int c_ref[L::kItemStages][kTilesPerItem][kWarpgroupWarps];  // per consumer warp: its largest e_dO
  Pipeline<L::kItemStages> q_pipe;
  Pipeline<kKeyStages> kv_pipe;
};
template <ScoreOperand kScore>
constexpr size_t kSmemBytes = sizeof(SharedStorage<kScore>) + wgmma::kSw128AtomBytes;
static_assert(kSmemBytes<ScoreOperand::kE4m3> <= kMaxDynamicSmemBytes &&
                  kSmemBytes<ScoreOperand::kBf16> <= kMaxDynamicSmemBytes,
              "shared memory of a CTA");

enum class Warpgroup : uint32_t { kProducer = 0, kFirstConsumer = 1 };
constexpr uint32_t kConsumerWarpgroups = kTilesPerItem;
constexpr uint32_t kThreads = (1 + kConsumerWarpgroups) * kWarpgroupThreads;
constexpr uint32_t kProducerRegs = 24;
constexpr uint32_t kConsumerRegs = consumer_register_budget(1, kProducerRegs, kConsumerWarpgroups);
static_assert(register_split_fits(1, kProducerRegs, kConsumerWarpgroups, kConsumerRegs),
              "setmaxnreg budgets exceed the register file");
// S, dP and dQ live together through the gradient, beside the row terms and addresses.
constexpr uint32_t kConsumerRegHeadroom = 32;
static_assert(3 * kAccRegs + kConsumerRegHeadroom <= kConsumerRegs, "consumer register budget");

enum class Barrier : uint32_t {
  kTurn0 = kFirstNamedBarrier,  // warpgroup w may issue products: kTurn0 + w
  kTurn1,
  kRows0,  // warpgroup w's warps have published their c_ref: kRows0 + w
  kRows1,
};
static_assert(named_barrier_id_valid(Barrier::kRows1), "named barrier ids");
constexpr uint32_t kTurnThreads = 2 * kWarpgroupThreads;

// Full barriers: the item by the producer's elected lane (an arrival plus the bytes); a key block
// by all its lanes, each after its factor stores (the elected one's arrival carries the bytes).
// Empty barriers: lane 0 of every consumer warp (Pipeline::warp_release).
constexpr uint32_t kItemArrivals = 1;
constexpr uint32_t kKeyBlockArrivals = kWarpThreads;
constexpr uint32_t kConsumerWarps = kConsumerWarpgroups * kWarpgroupWarps;

__device__ __forceinline__ int tile_of(const DqWorkItem& item, int warpgroup) {
  return kTilesPerItem * item.query_block + warpgroup;
}

// Which K codes a query tile's S reads at a key block: the fused kernel's rule (mxfp8: its tile
// codes where the forward's item saw the block whole).
template <ScoreOperand kScore, bool kCausal>
__device__ __forceinline__ bool reads_tile_codes(int length, int tile, int key_block) {
  return ScoreLayout<kScore>::kKeyTiles &&
         fwd::item_sees_tile_whole(length, tile * kBlockM, key_block, kCausal);
}

template <ScoreOperand kScore, bool kCausal>
__device__ void produce(const DqParams& p, SharedStorage<kScore>& sm) {
  using L = ScoreLayout<kScore>;
  const int lane = int(lane_index());
  const bool elected = lane == 0;
  if (elected) {
    for (const CUtensorMap* map : {&p.map_q, &p.map_dout, &p.map_k, &p.map_v, &p.map_kt})
      tma_prefetch_descriptor(map);
    if constexpr (L::kKeyTiles) tma_prefetch_descriptor(&p.map_k_tiles);  // set for mxfp8 only
  }
  PipelineState<L::kItemStages> item_state;
  PipelineState<kKeyStages> key_state;
  for (;;) {
    int index = 0;
    if (elected) index = atomicAdd(p.counter, 1);
    index = __shfl_sync(0xFFFFFFFFu, index, 0);
    DqWorkItem item{-1, 0, 0, 0};
    if (index < p.num_items) item = p.items[index];
    sm.q_pipe.producer_acquire(item_state);
    if (elected) {
      sm.item[item_state.index] = item;
      uint64_t* full = sm.q_pipe.full_barrier(item_state);
      if (item.doc < 0) {
        mbarrier_arrive(full);
      } else {
        sm.q_pipe.producer_commit(item_state, kTilesPerItem * (L::kQTileBytes + kTileBytes));
        const int32_t token = int32_t(p.cu_seqlens[item.doc] + int64_t(tile_of(item, 0)) * kBlockM);
        for (int w = 0; w < kTilesPerItem; ++w) {
          for (int span = 0; span < L::kSpans; ++span)
            tma_load_3d(sm.q[item_state.index][w] + span * kTileBytes, &p.map_q,
                        span * L::kSpanElems, item.head, token + w * kBlockM, full);
          tma_load_3d(sm.dout[item_state.index] + w * kTileBytes, &p.map_dout, 0, item.head,
                      token + w * kBlockM, full);
        }
      }
    }
    item_state.advance();
    if (item.doc < 0) return;

    const int64_t begin = p.cu_seqlens[item.doc];
    const int length = int(p.cu_seqlens[item.doc + 1] - begin);
    const int kv_head = item.head / p.group;
    const int64_t t_begin = transposed_doc_begin(begin, item.doc);
    const uint8_t* k_codes = p.k_exponents + int64_t(kv_head) * p.tokens_padded + begin;
    const uint8_t* v_codes = p.v_exponents + int64_t(kv_head) * p.tokens_padded + begin;
    for (int kb = 0; kb < item.key_blocks; ++kb) {
      const int n0 = kb * kKeys;
      // The block's tile unit takes every key up to the padded end (the fused producer's rule: a
      // partial block's maximum may take in the next document's keys).
      const int64_t left = p.tokens_padded - (begin + n0);
      uint32_t ek[kKeysPerLane], ev[kKeysPerLane], tile_code = 0;
#pragma unroll
      for (int u = 0; u < kKeysPerLane; ++u) {
        const int j = kKeysPerLane * lane + u;
        ek[u] = j < left ? k_codes[n0 + j] : 0u;
        ev[u] = n0 + j < length ? v_codes[n0 + j] : 0u;
        tile_code = max(tile_code, ek[u]);
      }
      if constexpr (L::kKeyTiles) tile_code = __reduce_max_sync(0xFFFFFFFFu, tile_code);
      const bool tiles0 = reads_tile_codes<kScore, kCausal>(length, tile_of(item, 0), kb);
      const bool tiles1 = reads_tile_codes<kScore, kCausal>(length, tile_of(item, 1), kb);
      sm.kv_pipe.producer_acquire(key_state);
      KeyFactors& kf = sm.keys[key_state.index];
#pragma unroll
      for (int u = 0; u < kKeysPerLane; ++u) {
        const int c = kKeysPerLane * lane + u;
        const bool valid = n0 + c < length;
        const float k_unit = valid ? exp2i(int(ek[u]) - ue8m0::kBias) : 0.0f;
        const float v_unit = valid ? exp2i(int(ev[u]) - ue8m0::kBias) : 0.0f;
        const int g = c / 8, quad = (c % 8) / 2, half = c % 2;
        float* vf = reinterpret_cast<float*>(&kf.v_fold[g][quad]);
        vf[half] = v_unit;
        vf[2 + half] = k_unit;
        // S's column factor (KeyRows::score): c 2^e_k on K's codes, c on BF16 K.
        reinterpret_cast<float*>(&kf.score[g][quad])[half] =
            kScore == ScoreOperand::kE4m3 ? k_unit * p.scale_log2 : p.scale_log2;
      }
      if (elected) {
        if constexpr (L::kKeyTiles)
          kf.tile_score = ue8m0::decode(uint8_t(tile_code)) * p.scale_log2;
        const bool token_codes = !(tiles0 && tiles1), tile_codes = tiles0 || tiles1;
        uint64_t* full = sm.kv_pipe.full_barrier(key_state);
        // V and K's codes_t, and the K codes (or rows) the tiles read.
        sm.kv_pipe.producer_commit(
            key_state, 2 * kKeyTileBytes + (int(token_codes) + int(tile_codes)) * L::kKBytes);
        const int32_t token = int32_t(begin + n0);
        if (token_codes)
          for (int span = 0; span < L::kSpans; ++span)
            tma_load_3d(sm.k[key_state.index] + span * kKeyTileBytes, &p.map_k,
                        span * L::kSpanElems, kv_head, token, full);
        if constexpr (L::kKeyTiles)
          if (tile_codes)
            tma_load_3d(sm.k_tiles[key_state.index], &p.map_k_tiles, 0, kv_head, token, full);
        tma_load_3d(sm.v[key_state.index], &p.map_v, 0, kv_head, token, full);
        tma_load_2d(sm.kt[key_state.index], &p.map_kt, int32_t(t_begin + n0), kv_head * kHeadDim,
                    full);
      } else {
        mbarrier_arrive(sm.kv_pipe.full_barrier(key_state));
      }
      key_state.advance();
    }
  }
}

// A thread's two query rows: the fused producer's RowTerms and units (stage_query_rows,
// bwd_scales.cuh), which depend on the query tile alone (every row of a visited tile sees the key
// block). The same expressions written again, not a shared function: moving stage_query_rows's
// into one changes ptxas's schedule of the fused kernel's step loop (600 of 1555 instructions,
// checked by SASS; items 163 and 193 measured such moves at 0.7-3 %).
// GpuAttentionBwdBuffers.FastKernelsMatchTheStatisticsBuildBitwise holds the two equal.
struct ThreadRows {
  float rf[kRowHalves];         // 2^e_q
  float bias[kRowHalves];       // e_dO - C + 8 - LSE log2(e); -inf past the document
  float delta[kRowHalves];      // the delta word, D 2^-e_dO with rf in its low bits
  float q_inverse[kRowHalves];  // 2^-e_q; 0 past the document
  int row[kRowHalves];          // document-relative
  float dv_unit;                // 2^(C - 8)
};

template <ScoreOperand kScore>
__device__ __forceinline__ ThreadRows load_row_terms(const DqParams& p, SharedStorage<kScore>& sm,
                                                     int stage, int64_t begin, int length, int head,
                                                     int tile, int warpgroup, int t) {
  ThreadRows rt;
  int e_q[kRowHalves], e_g[kRowHalves];
  float lse[kRowHalves], delta[kRowHalves];
  int c_ref = INT_MIN;
#pragma unroll
  for (int h = 0; h < kRowHalves; ++h) {
    rt.row[h] = tile * kBlockM + wgmma::acc_row(t, 2 * h);
    const bool valid = rt.row[h] < length;
    const int64_t at = int64_t(head) * p.tokens_padded + begin + rt.row[h];
    const int64_t stat = int64_t(head) * p.tokens + begin + rt.row[h];
    e_q[h] = valid ? int(__ldg(p.q_exponents + at)) - ue8m0::kBias : 0;
    e_g[h] = valid ? int(__ldg(p.dout_exponents + at)) - ue8m0::kBias : 0;
    lse[h] = valid ? __ldg(p.lse + stat) : 0.0f;
    delta[h] = valid ? __ldg(p.delta + stat) : 0.0f;
    if (valid) c_ref = max(c_ref, e_g[h]);
  }
  // C: the largest dO exponent over the tile's rows in the document.
  c_ref = __reduce_max_sync(0xFFFFFFFFu, c_ref);
  const int warp = t / int(kWarpThreads);
  if (lane_index() == 0) sm.c_ref[stage][warpgroup][warp] = c_ref;
  named_barrier_sync(warpgroup == 0 ? Barrier::kRows0 : Barrier::kRows1, kWarpgroupThreads);
#pragma unroll
  for (int w = 0; w < int(kWarpgroupWarps); ++w) c_ref = max(c_ref, sm.c_ref[stage][warpgroup][w]);
  rt.dv_unit = c_ref == INT_MIN ? 0.0f : exp2i(c_ref - kPOffsetLog2);
#pragma unroll
  for (int h = 0; h < kRowHalves; ++h) {
    const bool valid = rt.row[h] < length;
    rt.bias[h] = valid ? float(e_g[h] - c_ref + kPOffsetLog2) - lse[h] * kLog2e : -INFINITY;
    rt.delta[h] = delta_word(valid ? delta[h] * exp2i(-e_g[h]) : 0.0f, exp2i(e_q[h]));
    rt.rf[h] = row_factor_of(rt.delta[h]);
    rt.q_inverse[h] = valid ? exp2i(-e_q[h]) : 0.0f;
  }
  return rt;
}

template <ScoreOperand kScore>
__device__ __forceinline__ void issue_score_products(float (&s)[kAccRegs], float (&dp)[kAccRegs],
                                                     const SharedStorage<kScore>& sm,
                                                     int item_stage, int key_stage, int warpgroup,
                                                     bool tiles) {
  using L = ScoreLayout<kScore>;
  const uint8_t* k = sm.k[key_stage];
  if constexpr (L::kKeyTiles)
    if (tiles) k = sm.k_tiles[key_stage];
  const uint64_t desc_do = wgmma::make_desc_sw128(sm.dout[item_stage] + warpgroup * kTileBytes);
  const uint64_t desc_v = wgmma::make_desc_sw128(sm.v[key_stage]);
  constexpr int kSteps = int(kRowBytes / wgmma::kKBytes);
  wgmma::fence_operands(s);
  wgmma::fence_operands(dp);
  wgmma::fence();
  fwd::issue_score_steps<kScore, kKeys>(s, sm.q[item_stage][warpgroup], kTileBytes, k,
                                        kKeyTileBytes);
#pragma unroll
  for (int step = 0; step < kSteps; ++step)
    wgmma::mma_e4m3<kKeys>(dp, wgmma::desc_advance(desc_do, step * wgmma::kKBytes),
                           wgmma::desc_advance(desc_v, step * wgmma::kKBytes), step > 0);
  wgmma::commit();
}

// dQ += (X~ K) * unit per row, in the ordered mode's rounding: the product times the unit, then
// an FP32 addition that flushes subnormals (as red.global.add.f32 does). The unit is a power of
// two, so that product is exact wherever it is a normal float, and one fma.rn.ftz rounds as the
// multiply and the addition do, in one instruction instead of two (docs/PERF.md item 221). They
// could differ only where the product is subnormal (the addition flushed it, the fma keeps it)
// and the sum so far lies below 2^-102.
__device__ __forceinline__ float fma_ftz(float a, float b, float c) {
  float d;
  asm("fma.rn.ftz.f32 %0, %1, %2, %3;" : "=f"(d) : "f"(a), "f"(b), "f"(c));
  return d;
}
__device__ __forceinline__ void add_dq_product(float (&dq)[kAccRegs],
                                               const uint32_t (&a)[kSlices][4], const uint8_t* kt,
                                               const float (&unit)[kRowHalves]) {
  float tile[kAccRegs];
  const uint64_t desc = wgmma::make_desc_sw128(kt);
  wgmma::fence_operands(tile);
  wgmma::fence();
#pragma unroll
  for (int k = 0; k < kSlices; ++k)
    wgmma::mma_e4m3_rs<kKeys>(tile, a[k], wgmma::desc_advance(desc, k * wgmma::kKBytes), k > 0);
  wgmma::commit();
  wgmma::wait_all(tile);
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) dq[i] = fma_ftz(tile[i], unit[key_half(i)], dq[i]);
}

// The fused kernel's gradient_step and store_ds_tile for one (query tile, key block), transposed:
// on return `a` holds the dQ operand's codes and `unit` the rows' dQ units (add_dq_partial's).
template <ScoreOperand kScore, bool kMasked, bool kCausal>
__device__ __forceinline__ void dq_operand(float (&s)[kAccRegs], float (&dp)[kAccRegs],
                                           const KeyFactors& kf, const ThreadRows& rt, bool tiles,
                                           int quad, int n0, int length, uint32_t (&a)[kSlices][4],
                                           float (&unit)[kRowHalves]) {
  float amax[kRowHalves] = {0.0f, 0.0f};
#pragma unroll
  for (int g = 0; g < kColGroups; ++g) {
    const float4 f = kf.v_fold[g][quad];
    const float2 score = tiles ? make_float2(kf.tile_score, kf.tile_score) : kf.score[g][quad];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = 4 * g + k, h = key_half(i), c = k & 1;
      float p = scaled_probability<kScore == ScoreOperand::kE4m3>(s[i], c ? score.y : score.x,
                                                                  rt.rf[h], rt.bias[h]);
      if constexpr (kMasked) {
        const int key = n0 + 8 * g + 2 * quad + c;
        const bool visible = key < length && rt.row[h] < length && (!kCausal || key <= rt.row[h]);
        if (!visible) p = 0.0f;
      }
      s[i] = scaled_gradient(p, rt.rf[h], dp[i], c ? f.y : f.x, rt.delta[h]) * (c ? f.w : f.z);
      amax[h] = fmaxf(amax[h], fabsf(s[i]));
    }
  }
  const uint32_t keys = quad_max_u16x2(scale_key_pair(amax[0], amax[1]));
  float inverse[kRowHalves];
#pragma unroll
  for (int h = 0; h < kRowHalves; ++h) {
    const uint32_t field = operand_field_of_pair(keys, h);
    inverse[h] = inverse_scale_e4m3_of_field(field);
    unit[h] = dq_row_unit(field, rt.q_inverse[h], rt.dv_unit);
  }
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) s[i] *= inverse[key_half(i)];
  pack_a_fragments<kSlices>(s, a);
}

// A thread's two rows of dQ back to the inputs' frame (Hadamard-rotated Q and K): the
// postprocess's rotate_row in the accumulator layout, where column 8 g + 2 quad + c of a row is
// register 4 g + 2 h + c. hadamard_rotate's stages in its order, each the same correctly rounded
// a + b and a - b: span 1 (c) in the thread, spans 2 and 4 (quad) across the quad's lanes, spans
// 8 to 64 (g) in the thread again; then its one multiply. So dQ comes out as the ordered path's.
// Every lane of the warp takes part (the shuffles).
__device__ __forceinline__ void rotate_rows_back(float (&dq)[kAccRegs], int quad) {
  constexpr int kGroupRegs = 4;  // registers of an 8-column group
  constexpr int kPairSpan = 1, kQuadSpans = 2;
#pragma unroll
  for (int i = 0; i < kAccRegs; i += 2 * kPairSpan) hadamard_pair(dq[i], dq[i + kPairSpan]);
#pragma unroll
  for (int b = 0; b < kQuadSpans; ++b) {
    const uint32_t lane_bit = 1u << b;  // quad position bit b: column bit b + 1
    const bool upper = quad & int(lane_bit);
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) dq[i] = hadamard_across_lanes(dq[i], lane_bit, upper);
  }
#pragma unroll
  for (int span = 1; span < kColGroups; span *= 2)  // in groups: columns 8 span apart
#pragma unroll
    for (int g = 0; g < kColGroups; ++g)
      if ((g & span) == 0)
#pragma unroll
        for (int k = 0; k < kGroupRegs; ++k)
          hadamard_pair(dq[kGroupRegs * g + k], dq[kGroupRegs * (g + span) + k]);
  const float scale = hadamard_scale<float>(kHeadDim);
#pragma unroll
  for (int i = 0; i < kAccRegs; ++i) dq[i] = __fmul_rn(dq[i], scale);
}

__device__ __forceinline__ void begin_turn(int warpgroup) {
  named_barrier_sync(warpgroup == 0 ? Barrier::kTurn0 : Barrier::kTurn1, kTurnThreads);
}
__device__ __forceinline__ void end_turn(int warpgroup) {
  named_barrier_arrive(warpgroup == 0 ? Barrier::kTurn1 : Barrier::kTurn0, kTurnThreads);
}

template <ScoreOperand kScore, bool kCausal>
__device__ void consume(const DqParams& p, SharedStorage<kScore>& sm, int warpgroup) {
  using L = ScoreLayout<kScore>;
  const int t = int(threadIdx.x % kWarpgroupThreads);
  const int quad = t % kQuadLanes;
  PipelineState<L::kItemStages> item_state;
  PipelineState<kKeyStages> key_state;
  if (warpgroup == 1) end_turn(1);  // warpgroup 0 takes the first turn
  for (;;) {
    sm.q_pipe.consumer_wait(item_state);
    const DqWorkItem item = sm.item[item_state.index];
    if (item.doc < 0) return;
    const int64_t begin = p.cu_seqlens[item.doc];
    const int length = int(p.cu_seqlens[item.doc + 1] - begin);
    const int tile = tile_of(item, warpgroup);
    const int m0 = tile * kBlockM;
    const ThreadRows rt =
        load_row_terms(p, sm, int(item_state.index), begin, length, item.head, tile, warpgroup, t);
    float dq[kAccRegs];
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) dq[i] = 0.0f;
    uint32_t a[kSlices][4];
    float unit[kRowHalves];
    PipelineState<kKeyStages> previous = key_state;
    for (int kb = 0; kb < item.key_blocks; ++kb) {
      const int n0 = kb * kKeys;
      const bool tiles = reads_tile_codes<kScore, kCausal>(length, tile, kb);
      float s[kAccRegs], dp[kAccRegs];
      begin_turn(warpgroup);
      if (kb > 0) {
        add_dq_product(dq, a, sm.kt[previous.index], unit);
        sm.kv_pipe.warp_release(previous);
      }
      sm.kv_pipe.consumer_wait(key_state);
      issue_score_products(s, dp, sm, int(item_state.index), int(key_state.index), warpgroup,
                           tiles);
      end_turn(warpgroup);
      wgmma::wait_all(s);
      wgmma::fence_operands(dp);
      // The item's Q and dO are read for the last time: the producer may load the next item's
      // while this block's gradient runs (with mxfp8-qk16's one stage, the next item waits here).
      if (kb + 1 == item.key_blocks) sm.q_pipe.warp_release(item_state);
      const KeyFactors& kf = sm.keys[key_state.index];
      const bool masked =
          (kCausal && m0 < n0 + kKeys) || n0 + kKeys > length || m0 + kBlockM > length;
      if (masked) {
        dq_operand<kScore, true, kCausal>(s, dp, kf, rt, tiles, quad, n0, length, a, unit);
      } else {
        dq_operand<kScore, false, kCausal>(s, dp, kf, rt, tiles, quad, n0, length, a, unit);
      }
      previous = key_state;
      key_state.advance();
    }
    item_state.advance();
    begin_turn(warpgroup);
    add_dq_product(dq, a, sm.kt[previous.index], unit);
    sm.kv_pipe.warp_release(previous);
    end_turn(warpgroup);
    // dQ = dq * scale (rotated back with Hadamard-rotated Q and K) to BF16, as the postprocess
    // rounds it; pairs of columns per row.
#pragma unroll
    for (int i = 0; i < kAccRegs; ++i) dq[i] *= p.scale;
    if (p.rotate) rotate_rows_back(dq, quad);
#pragma unroll
    for (int h = 0; h < kRowHalves; ++h) {
      if (rt.row[h] >= length) continue;
      uint16_t* out =
          p.dq + (begin + rt.row[h]) * p.dq_stride_token + int64_t(item.head) * p.dq_stride_head;
#pragma unroll
      for (int g = 0; g < kColGroups; ++g) {
        const int i = 4 * g + 2 * h;
        *reinterpret_cast<uint32_t*>(out + wgmma::acc_col(t, i)) = bf16x2_bits(dq[i], dq[i + 1]);
      }
    }
  }
}

template <ScoreOperand kScore, bool kCausal>
__global__ void __launch_bounds__(kThreads, 1) dq_kernel(const __grid_constant__ DqParams p) {
  extern __shared__ uint8_t smem_raw[];
  auto& sm = wgmma::sw128_aligned_storage<SharedStorage<kScore>>(smem_raw);
  if (threadIdx.x == 0) {
    sm.q_pipe.init(kItemArrivals, kConsumerWarps);
    sm.kv_pipe.init(kKeyBlockArrivals, kConsumerWarps);
  }
  __syncthreads();
  const uint32_t warpgroup = warpgroup_index();
  if (warpgroup == uint32_t(Warpgroup::kProducer)) {
    setmaxnreg_dec<kProducerRegs>();
    if (warp_index() == 0) produce<kScore, kCausal>(p, sm);
  } else {
    setmaxnreg_inc<kConsumerRegs>();
    consume<kScore, kCausal>(p, sm, int(warpgroup - uint32_t(Warpgroup::kFirstConsumer)));
  }
}

template <ScoreOperand kScore, bool kCausal>
void launch_dq_pass_impl(const DqParams& p, int ctas, cudaStream_t stream) {
  const auto kernel = dq_kernel<kScore, kCausal>;
  constexpr int kBytes = int(kSmemBytes<kScore>);
  FLAMIA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  kernel<<<ctas, kThreads, kBytes, stream>>>(p);
  FLAMIA_CUDA_CHECK_LAUNCH();
}

}  // namespace flamia::sm90::bwd::dqpass
