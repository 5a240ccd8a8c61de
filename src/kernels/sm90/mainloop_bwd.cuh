// The backward consumer warpgroups' mainloop: warpgroup w owns keys 64w..64w+63 of the work item's
// key block and, for each query head of the group and each query tile from the diagonal on,
//   S^T = K Q^T and dP^T = V dO^T          (SS wgmma; S on E4M3 codes, K's tile codes where the
//                                            forward saw the key block whole, or on BF16 inputs)
//   P, dS and the folded operands           (softmax_bwd.cuh)
//   dV_tile = P~^T dO, dK_tile = dS~^T Q    (register-A QGMMA against the K-major copies of dO and
//                                            Q) added to FP32 dV and dK with their units: fresh
//                                            registers per tile, as the FP8 MMA chains imprecisely
//   dQ_tile = dS~ K                         (dS~ through shared memory, both warpgroups' keys; each
//                                            warpgroup takes 64 of the 128 head-dim columns)
// dQ partials go to the FP32 accumulator in global memory (epilogue_bwd.cuh); dK, dV are stored
// once per item (dK as FP32 rows where Q and K were Hadamard-rotated: rotated back after the
// kernel).
#pragma once

#include "bwd_scales.cuh"
#include "epilogue_bwd.cuh"
#include "named_barrier.cuh"
#include "proxy_fence.cuh"
#include "softmax_bwd.cuh"

namespace flamia::sm90::bwd {

enum class ConsumerBarrier : uint32_t {
  kMaxReady = kFirstNamedBarrier,  // every query's |dS| maximum's scale field is in row_max
  kDsReady,                        // the quantized dS tile is in shared memory
  kWarpgroup0,                     // ordered mode, one warpgroup: its dQ turn came / is done
  kWarpgroup1,
  kKeysSwapped0,  // one warpgroup: its keys' two codes exchanged in shared memory (swap_key_codes)
  kKeysSwapped1,
};
static_assert(named_barrier_id_valid(ConsumerBarrier::kKeysSwapped1), "named barrier ids");
constexpr uint32_t kConsumerThreads = 2 * kWarpgroupThreads;
constexpr int kHalfDim = kHeadDim / 2;  // dK, dV accumulate in two m64n64 halves

template <ScoreOperand kScore>
__device__ __forceinline__ void issue_score_products(float (&s)[kTileRegs], float (&dp)[kTileRegs],
                                                     const SharedStorage<kScore>& sm, int stage,
                                                     int warpgroup) {
  using L = SmemLayout<kScore>;
  wgmma::fence_operands(s);
  wgmma::fence_operands(dp);
  wgmma::fence();
  fwd::issue_score_steps<kScore, kBlockM>(s, sm.k + warpgroup * L::kWarpgroupKeyBytes,
                                          L::kKSpanBytes, sm.q[stage], L::kQSpanBytes);
  constexpr int kCodeSteps = int(wgmma::kSw128RowBytes / wgmma::kKBytes);
#pragma unroll
  for (int step = 0; step < kCodeSteps; ++step) {
    const uint32_t offset = step * wgmma::kKBytes;
    wgmma::mma_e4m3<kBlockM>(
        dp,
        wgmma::desc_advance(wgmma::make_desc_sw128(sm.v + warpgroup * L::kWarpgroupKeyBytes),
                            offset),
        wgmma::desc_advance(wgmma::make_desc_sw128(sm.dout[stage]), offset), step > 0);
  }
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::fence_operands(s);
  wgmma::fence_operands(dp);
}

// One m64n64 half of a key product, A from registers (keys x queries), B a query tile's K-major
// copy [D][queries] (64B swizzle), into fresh registers: committed, not waited for.
__device__ __forceinline__ void issue_key_product_half(float (&tile)[kTileRegs],
                                                       const uint32_t (&a)[kQuerySlices][4],
                                                       const uint8_t* bt, int half) {
  const uint64_t desc = wgmma::make_desc_sw64(bt + half * kHalfDim * int(wgmma::kSw64RowBytes));
  wgmma::fence_operands(tile);
  wgmma::fence();
#pragma unroll
  for (int k = 0; k < kQuerySlices; ++k)
    wgmma::mma_e4m3_rs<kHalfDim>(tile, a[k], wgmma::desc_advance(desc, k * wgmma::kKBytes), k > 0);
  wgmma::commit();
}

// acc += unit(key) * tile, once the tile's product is done.
__device__ __forceinline__ void add_key_tile(float (&acc)[kTileRegs], float (&tile)[kTileRegs],
                                             const float (&unit)[kKeyRows]) {
  wgmma::wait_all(tile);
#pragma unroll
  for (int i = 0; i < kTileRegs; ++i) acc[i] = fmaf(tile[i], unit[key_half(i)], acc[i]);
}

// dV += unit_v P~^T dO and dK += unit_k dS~^T Q in four m64n64 halves through one register tile.
// Two tiles in flight (a product overlapping the previous one's additions) spill dV and dK inside
// the loop and measured 4 % slower (docs/PERF.md).
__device__ __forceinline__ void accumulate_key_products(float (&dv)[2][kTileRegs],
                                                        float (&dk)[2][kTileRegs],
                                                        const KeyOperands& ops,
                                                        const uint8_t* doutt, const uint8_t* qt,
                                                        const float (&dv_unit)[kKeyRows]) {
  float tile[kTileRegs];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    issue_key_product_half(tile, ops.p, doutt, half);
    add_key_tile(dv[half], tile, dv_unit);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    issue_key_product_half(tile, ops.ds, qt, half);
    add_key_tile(dk[half], tile, ops.ds_unit);
  }
}

template <ScoreOperand kScore>
__device__ __forceinline__ void issue_dq_product(float (&dq)[kTileRegs],
                                                 const SharedStorage<kScore>& sm, int warpgroup) {
  const uint64_t desc_ds = wgmma::make_desc_sw128(sm.ds);
  const uint64_t desc_kt =
      wgmma::make_desc_sw128(sm.kt + warpgroup * kHalfDim * int(wgmma::kSw128RowBytes));
  wgmma::fence_operands(dq);
  wgmma::fence();
  constexpr int kSteps = int(wgmma::kSw128RowBytes / wgmma::kKBytes);
#pragma unroll
  for (int step = 0; step < kSteps; ++step)
    wgmma::mma_e4m3<kHalfDim>(dq, wgmma::desc_advance(desc_ds, step * wgmma::kKBytes),
                              wgmma::desc_advance(desc_kt, step * wgmma::kKBytes), step > 0);
  wgmma::commit();
  wgmma::wait_all(dq);
}

// dQ's operand: each listed query's maximum over all 128 keys -> er, then E4M3(dS 2^e_k / 2^er)
// (ds_folded holds dS 2^e_k) into the dS tile at [query][transposed_slot(key)]. A thread holds keys
// j and j + 8 of its warp's 16 and the lane 4 apart keys j ^ 1 and (j ^ 1) + 8: transposed_slot
// puts those four in one 32-bit word of a query row. So per 8-query group the two lanes swap their
// codes of both listed queries (one shuffle) and each stores one word: the even-key lane the even
// query's, the odd-key lane the odd one's. Row 8 g of the tile is 1024 g bytes on (the swizzle
// repeats every 8 rows), and the 32 lanes' words fall in 32 distinct banks.
template <bool kDiagnostics>
__device__ __forceinline__ void store_ds_tile(uint8_t* ds_tile, const float (&ds_folded)[kTileRegs],
                                              const int* row_max, int quad, int key_base,
                                              StepDiagnostics& diag) {
  constexpr uint32_t kGroupBytes = wgmma::kSw128AtomBytes;  // 8 queries of 128 B
  // __byte_perm selectors over {theirs, mine} (bytes 7..4, 3..0); a lane's codes `mine` are, in
  // byte order, its even query's keys j, j + 8 and its odd query's keys j, j + 8.
  constexpr uint32_t kEvenKeyWord = 0x5140;  // even query: j, j + 1, j + 8, j + 9
  constexpr uint32_t kOddKeyWord = 0x3726;   // odd query: j - 1, j, j + 7, j + 8
  constexpr unsigned kFull = 0xFFFFFFFFu;
  constexpr int kPartnerLane = 4;  // the lane holding keys j ^ 1
  // A thread's listed queries come in adjacent pairs (2 quad, 2 quad + 1 of each 8): one 8-byte
  // load per pair.
  float inv[kThreadQueries];
#pragma unroll
  for (int n = 0; n < kThreadQueries; n += 2) {
    const int2 fields = *reinterpret_cast<const int2*>(row_max + listed_query(quad, n));
    inv[n] = inverse_scale_e4m3_of_field(uint32_t(fields.x));
    inv[n + 1] = inverse_scale_e4m3_of_field(uint32_t(fields.y));
  }
  const int odd_key = key_base & 1;
  const uint32_t select = odd_key ? kOddKeyWord : kEvenKeyWord;
  uint8_t* word = ds_tile + wgmma::sw128_offset(uint32_t(2 * quad + odd_key),
                                                uint32_t(transposed_slot(key_base & ~1)));
#pragma unroll
  for (int g = 0; g < kColGroups; ++g) {
    float x[4];  // registers 4g..4g+3: (even query, key j), (odd, j), (even, j + 8), (odd, j + 8)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[k] = ds_folded[4 * g + k] * inv[2 * g + (k & 1)];
      if constexpr (kDiagnostics)
        diag.zero_dq += ds_folded[4 * g + k] != 0.0f && rounds_to_zero(x[k]);
    }
    const uint32_t mine = e4m3x4_rn_satfinite(x[0], x[2], x[1], x[3]);
    const uint32_t theirs = __shfl_xor_sync(kFull, mine, kPartnerLane);
    *reinterpret_cast<uint32_t*>(word + g * kGroupBytes) = __byte_perm(mine, theirs, select);
  }
}

// Exchanges the warpgroup's 64 keys of K's token codes (sm.k, where the score products read) and
// tile codes (sm.k_tiles): each warpgroup's S reads its own keys only, and its last score product
// has completed (issue_score_products waits), so no other warpgroup or product is in the way.
template <ScoreOperand kScore>
__device__ __forceinline__ void swap_key_codes(SharedStorage<kScore>& sm, int warpgroup) {
  using L = SmemLayout<kScore>;
  static_assert(L::kKeyTiles && L::kSpans == 1, "E4M3 keys: one span of 128 B rows");
  constexpr int kChunks = int(L::kWarpgroupKeyBytes / sizeof(uint4) / kWarpgroupThreads);
  uint4* a = reinterpret_cast<uint4*>(sm.k + warpgroup * L::kWarpgroupKeyBytes);
  uint4* b = reinterpret_cast<uint4*>(sm.k_tiles + warpgroup * L::kWarpgroupKeyBytes);
  const int t = int(threadIdx.x % kWarpgroupThreads);
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int at = t + i * int(kWarpgroupThreads);
    const uint4 x = a[at], y = b[at];
    a[at] = y;
    b[at] = x;
  }
  // The next score products read the keys through the async proxy.
  fence_async_shared();
  named_barrier_sync(
      warpgroup == 0 ? ConsumerBarrier::kKeysSwapped0 : ConsumerBarrier::kKeysSwapped1,
      kWarpgroupThreads);
}

// One query tile of one head against the warpgroup's keys: products, gradients, dV and dK
// accumulation, dS through shared memory, the dQ partial.
template <ScoreOperand kScore, bool kCausal, bool kDiagnostics, DqAddition kDq>
__device__ __forceinline__ void backward_step(const Params& p, SharedStorage<kScore>& sm,
                                              int warpgroup, const StepItem& item, int m,
                                              uint32_t step, bool whole_keys, const KeyRows& kr,
                                              PipelineState<kQStages>& q_state,
                                              float (&dv)[2][kTileRegs], float (&dk)[2][kTileRegs],
                                              PendingDq& pending) {
  const int t = threadIdx.x % kWarpgroupThreads;
  const int quad = t % 4;
  const int m0 = m * kBlockM;
  const int key_base = warpgroup * wgmma::kM + wgmma::acc_row(t, 0);
  sm.q_pipe.consumer_wait(q_state);
  flush_dq_partial(pending);  // the previous step's: no product is in flight here
  const QueryRows& rows = sm.rows[q_state.index];
  // whole_keys: S as the forward formed it where its item saw the key block whole, on K's tile
  // codes (in sm.k by then, swap_key_codes) with their one score unit.
  KeyRows step_keys = kr;
  if (whole_keys) step_keys.score[0] = step_keys.score[1] = sm.k_tile_unit;
  float s[kTileRegs], dp[kTileRegs];
  issue_score_products<kScore>(s, dp, sm, q_state.index, warpgroup);

  KeyOperands ops;
  StepDiagnostics diag;
  if constexpr (kDiagnostics) {
    const int64_t row_base = int64_t(item.head) * p.tokens + item.begin;
    diag.row_sum = p.row_sum + row_base;
    diag.row_abs = p.row_abs + row_base;
  }
  float query_max[kThreadQueries];
  const bool masked = (kCausal && m0 < item.n0 + kBlockN) || item.n0 + kBlockN > item.length ||
                      m0 + kBlockM > item.length;
  if (masked) {
    gradient_step<true, kCausal, kDiagnostics, kScore == ScoreOperand::kE4m3>(
        s, dp, rows, step_keys, quad, m0, item.length, ops, query_max, diag);
  } else {
    gradient_step<false, kCausal, kDiagnostics, kScore == ScoreOperand::kE4m3>(
        s, dp, rows, step_keys, quad, m0, item.length, ops, query_max, diag);
  }
  if constexpr (kDq == DqAddition::kNone) {
    // The split backward's dK/dV pass: the gradient's dQ-only values above are dead code here.
    const float dv_unit[kKeyRows] = {rows.dv_unit, rows.dv_unit};
    accumulate_key_products(dv, dk, ops, sm.doutt[q_state.index], sm.qt[q_state.index], dv_unit);
    sm.q_pipe.warp_release(q_state);
    q_state.advance();
    return;
  }
  int* row_max = sm.row_max[step % kMaxBuffers];
  publish_query_max(row_max, query_max, quad);
  named_barrier_sync(ConsumerBarrier::kMaxReady, kConsumerThreads);
  // The buffer of the step before last: read by everyone before this barrier, next filled two
  // steps on (after the next one).
  if (warpgroup == 0 && t < kBlockM) sm.row_max[(step + 2) % kMaxBuffers][t] = kRowMaxFloor;
  // dS leaves the registers before the dV and dK products need theirs.
  store_ds_tile<kDiagnostics>(sm.ds, dp, row_max, quad, key_base, diag);

  const float dv_unit[kKeyRows] = {rows.dv_unit, rows.dv_unit};
  // dS'' = dS 2^e_q 2^(8 - C): the dQ partial's rows (queries) take 2^-e_q and 2^(C - 8) back,
  // read before the stage goes.
  float q_inverse[kKeyRows];
#pragma unroll
  for (int r = 0; r < kKeyRows; ++r) q_inverse[r] = rows.q_inverse[wgmma::acc_row(t, 2 * r)];
  accumulate_key_products(dv, dk, ops, sm.doutt[q_state.index], sm.qt[q_state.index], dv_unit);
  sm.q_pipe.warp_release(q_state);
  q_state.advance();
  // The dS stores reach the dQ product's (async-proxy) reads: fenced only here, after the key
  // products, by when the stores have long completed (right after them the fence waited for them).
  fence_async_shared();
  named_barrier_sync(ConsumerBarrier::kDsReady, kConsumerThreads);

  float dq[kTileRegs];
  issue_dq_product<kScore>(dq, sm, warpgroup);
  add_dq_partial<kDq>(p, dq, row_max, q_inverse, dv_unit[0],
                      sm.dq_stage[warpgroup][step % kDqStages], item, m, t, warpgroup,
                      warpgroup == 0 ? ConsumerBarrier::kWarpgroup0 : ConsumerBarrier::kWarpgroup1,
                      pending);
  if constexpr (kDiagnostics) publish_diagnostics(p.diagnostics, diag);
}

// kRotated: Q and K were Hadamard-rotated; dK goes out as FP32 rows for the pass that rotates it
// back (store_key_gradient_rotated; the statistics build reads Params::dk_rotated). Code after the
// step loop moves the loop's schedule (docs/PERF.md, item 81), so the fast kernels carry only
// their own store path.
template <ScoreOperand kScore, bool kCausal, bool kDiagnostics, DqAddition kDq, bool kRotated>
__device__ void consumer_mainloop(const Params& p, SharedStorage<kScore>& sm, int warpgroup) {
  const int t = threadIdx.x % kWarpgroupThreads;
  const int key_base = warpgroup * wgmma::kM + wgmma::acc_row(t, 0);  // the thread's first key
  PipelineState<1> kv_state;
  PipelineState<kQStages> q_state;
  uint32_t step = 0;  // steps of this CTA so far: rotates row_max
  PendingDq pending;

  for (;;) {
    sm.kv_pipe.consumer_wait(kv_state);
    const WorkItem item = sm.item;
    if (item.doc < 0) {
      // Shared memory goes with the CTA: the last bulk dQ reductions (one per warp; none in
      // ordered mode, which adds from the registers) must have read their stages.
      flush_dq_partial(pending);
      if (lane_index() == 0) tma_store_wait_read<0>();
      return;
    }
    const int64_t begin = p.cu_seqlens[item.doc];
    const int length = int(p.cu_seqlens[item.doc + 1] - begin);
    const int n0 = item.key_block * kBlockN;

    KeyRows kr;
#pragma unroll
    for (int r = 0; r < kKeyRows; ++r) {
      kr.key[r] = n0 + key_base + 8 * r;
      const bool valid = kr.key[r] < length;
      const int64_t at = int64_t(item.kv_head) * p.tokens_padded + begin + kr.key[r];
      const float k_unit = valid ? exp2i(int(__ldg(p.k_exponents + at)) - ue8m0::kBias) : 0.0f;
      kr.fold[r] = k_unit;
      kr.score[r] = kScore == ScoreOperand::kE4m3 ? k_unit * p.scale_log2 : p.scale_log2;
      kr.v[r] = valid ? exp2i(int(__ldg(p.v_exponents + at)) - ue8m0::kBias) : 0.0f;
    }
    float dv[2][kTileRegs], dk[2][kTileRegs];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < kTileRegs; ++i) dv[h][i] = dk[h][i] = 0.0f;

    const int tiles = (length + kBlockM - 1) / kBlockM;
    const int first = first_query_tile(item.key_block, kCausal);
    // The query tiles whose forward item saw the key block whole: from m_whole on (causal: a few
    // tiles past the diagonal; otherwise all or none), S reads K's tile codes (whole_keys).
    auto whole = [&](int m) {
      return fwd::item_sees_tile_whole(length, m * kBlockM, item.key_block, kCausal);
    };
    int m_whole = tiles;
    if constexpr (SmemLayout<kScore>::kKeyTiles) {
      m_whole = first;
      if (kCausal) {
        while (m_whole < tiles && !whole(m_whole)) ++m_whole;
      } else if (!whole(first)) {
        m_whole = tiles;
      }
    }
    const int64_t doc_slot0 = dq_tile_slot(begin, item.doc, 0);  // its first tile, head 0
    for (int hh = 0; hh < p.group; ++hh) {
      const int head = item.kv_head * p.group + hh;
      const StepItem si{begin, length,         n0,
                        head,  item.key_block, int(int64_t(head) * p.dq_slots + doc_slot0)};
      // Token codes up to m_whole, then the tile codes, exchanged into the one buffer the score
      // products read (a per-step choice of buffer took their descriptors out of uniform
      // registers: ~100 more instructions a step) and back for the next query head.
      for (int m = first; m < tiles; ++m, ++step) {
        if constexpr (SmemLayout<kScore>::kKeyTiles)
          if (m == m_whole) swap_key_codes(sm, warpgroup);
        backward_step<kScore, kCausal, kDiagnostics, kDq>(
            p, sm, warpgroup, si, m, step, m >= m_whole, kr, q_state, dv, dk, pending);
      }
      if constexpr (SmemLayout<kScore>::kKeyTiles)
        if (m_whole < tiles && hh + 1 < p.group) swap_key_codes(sm, warpgroup);
    }
    // The last dQ product has completed, so the key block's shared memory is free: the producer
    // loads the next item's keys and first query tiles while dK and dV go out from registers.
    sm.kv_pipe.warp_release(kv_state);
    kv_state.advance();
    const int key0 = n0 + warpgroup * wgmma::kM;
    bool rotated = kRotated;
    if constexpr (kDiagnostics) rotated = p.dk_rotated != nullptr;
    if (rotated) {
      store_key_gradient_rotated(p, dk, begin, length, key0, item.kv_head, t);
      store_key_gradients<false>(p, dk, dv, begin, length, key0, item.kv_head, t);
    } else {
      store_key_gradients<true>(p, dk, dv, begin, length, key0, item.kv_head, t);
    }
  }
}

}  // namespace flamia::sm90::bwd
