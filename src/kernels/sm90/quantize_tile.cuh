// The fused quantizer's kernel (DESIGN §3): one CTA quantizes a tile of up to kTileElems elements
// (128 tokens at head dim 128, 256 at 64) of one head of one operand, writing every array
// quantize_cpu writes, bit for bit. Tiles are packed (multiples of the tile size in the packed
// buffer) or, with KernelArgs::document_tiles, cut from each document's start
// (quantize_geometry.h).
//
// Work split. A row (token, head) of D BF16 values is D/8 lanes of one 16-byte load each; a thread
// owns the same 8-element chunk of 4 consecutive tokens per pass (two passes), so after quantizing
// it holds a 4 x 4 byte block per word that byte-permutes turn into one 32-bit word of codes_t (4
// tokens of one dim). All loads of the thread are issued before any use (32 KB per CTA in flight).
//
// Stages of a tile:
//   A  load, zero non-finite values (reporting the first one), rotate Q/K when asked (butterflies
//      across the lanes of a row: the same stages and operations as hadamard.h, so the same bits),
//      row maxima through shuffles into shared memory; with a transposed copy, warp 0 finds the
//      tile's span of codes_t (quantize_geometry.h) while the loads are in flight: one warp-wide
//      search of cu_seqlens for the document holding the tile's first token (32 documents a
//      round, none with one document), the window of 32 offsets from it, and the document
//      holding the token past the tile from that window;
//   P  block32/floor need the maxima of the document-local 32-token blocks that straddle the tile
//      edges: the tile reads a halo of up to 31 rows on each side, only as far as the blocks of
//      its first and last token reach (documents start at arbitrary offsets, so tiles aligned in
//      the packed buffer never align with blocks; document tiles do, and read none). vgroup16's V
//      needs per-channel maxima of document-local 16-key groups: one item per (group starting in
//      the tile or holding its first token, channel chunk) reads the whole group, at most 15 rows
//      beyond the tile, and spreads its exponents. A token's document comes from a binary search in
//      cu_seqlens;
//   E  one thread per token computes its exponent (every lane of a row doing it costs ~20 % of
//      the token policy's throughput) and the NVFP4 token exponent, into shared memory; unless the
//      span is aligned (the tile's tokens are whole 16-aligned groups of one document), one
//      thread per 16-position chunk of the span computes the chunk's record (its tokens in the
//      tile) from the window: no read of cu_seqlens unless the tile touches 32 documents;
//   B  codes (hardware RNE conversion, proven equal to e4m3::encode), NVFP4 nibbles and local
//      scales, and the transposed words (tile token order) into a swizzled shared tile;
//   T  (each tile one document's key tile: the document tiling at head dim 128, or packed
//      tiles where tiles_are_key_tiles holds) K's codes_tiles and V's codes_t_tiles from the
//      codes just made, at the tile's largest exponent, beside them in B and S (otherwise the
//      tile passes of tile_codes.h make them);
//   S  codes_t, per chunk of the span and dim: an aligned span copies aligned vectors of the
//      shared tile in slot order (16-byte stores, as when codes_t had no document positions) and
//      zeroes the gaps after a document ending at the tile's end; another span gathers each
//      chunk's 16 tokens from the shared tile (documents start at any token, so at any byte),
//      clears the bytes of other documents and the zero tail, permutes them into slot order and
//      stores 16 bytes, the gaps between documents included, but for the chunks that straddle the
//      tile's edges (at most two): the tile's tokens only, as words, halves or bytes. Then
//      16-byte stores of the exponent rows, padding tokens included.
// The tensor policy's maxima come from a first launch of this kernel (amax_only).
#pragma once

#include <cstdint>

#include "flamia/formats.h"
#include "flamia/quantize.h"
#include "fp8_convert.cuh"
#include "hadamard_lanes.cuh"
#include "quantize_geometry.h"

namespace flamia::sm90::quant {

constexpr int kVGroupBatch = 4;  // rows of a 16-key group loaded at once
// CTAs per SM the register budget is sized for: 3 x 32 KB of loads in flight per SM (80
// registers); the rotated instantiation keeps both passes' floats and gets 128 registers.
constexpr int kCtasPerSm = 3, kCtasPerSmRotated = 2;

struct OperandArgs {
  const uint16_t* in = nullptr;
  int64_t stride_token = 0, stride_head = 0;
  int heads = 0;
  ScalePolicy policy = ScalePolicy::kToken;  // the operand's effective policy
  bool rotate = false;
  uint8_t* codes = nullptr;    // null: none (QuantizeOptions::score_codes off for Q, K)
  uint8_t* codes_t = nullptr;  // null: no transposed copy
  uint8_t* exponents = nullptr;
  uint8_t* channel_exponents = nullptr;
  uint8_t* nv_packed = nullptr;  // null: no NVFP4 for this operand
  uint8_t* nv_scales = nullptr;
  uint8_t* nv_exponents = nullptr;
  // K's codes_tiles and V's codes_t_tiles where this kernel writes them: when every tile is one
  // document-relative key tile (quantize_gpu_fuses_tile_codes); null otherwise.
  uint8_t* codes_tiles = nullptr;
  uint8_t* codes_t_tiles = nullptr;
  int first_tile = 0;  // this operand's tiles are [first_tile, next operand's first_tile)
  int slot = 0;        // its Operand index in the status array (ops holds present operands only)
};

struct KernelArgs {
  OperandArgs ops[kNumOperands];  // the present operands, in Operand order
  int num_ops = 0;
  int64_t tokens = 0, tokens_padded = 0;
  int64_t tokens_t = 0;                 // codes_t's row length (QuantLayout::tokens_t)
  const int32_t* cu_seqlens = nullptr;  // device
  int num_docs = 0;
  unsigned long long* non_finite = nullptr;  // [kNumOperands]
  unsigned* tensor_amax = nullptr;           // [num_ops] float bits, like ops; tensor policy only
  bool amax_only = false;                    // the tensor policy's first launch
  // The document tiling's instantiation: each operand's tile index / heads is a slot, its tokens
  // [x, y) (x < 0: idle).
  const int2* document_tiles = nullptr;
};

template <int kDim>
struct Smem {
  using G = Geometry<kDim>;
  uint32_t transposed[kDim][G::kTileWords];  // swizzled, see transposed_swizzle
  union {
    alignas(kVectorBytes) uint8_t channel_exps[G::kTileTokens][kDim];  // vgroup16's V
    uint32_t transposed_tiles[kDim][G::kTileWords];  // codes_t_tiles' words (V of other policies)
  };
  float row_amax[kBlockHalo + G::kTileTokens + kBlockHalo];  // index kBlockHalo + t - t0
  alignas(kVectorBytes) uint8_t exps[G::kTileTokens];
  alignas(kVectorBytes) uint8_t nv_exps[G::kTileTokens];
  int group_begin[G::kTileTokens], group_end[G::kTileTokens];  // vgroup16: tokens - t0
  int num_groups;
  int64_t halo_lo, halo_hi;
  // codes_t: the tile's span and cu_seqlens from its first document (stage A), the records of
  // its chunks (stage E, unless aligned), read by stage S.
  TransposedSpan span;
  int32_t window[kWindowDocs];
  uint32_t chunk_records[G::kSpanChunks];
};

// ---- BF16 helpers ---------------------------------------------------------------------------

constexpr uint32_t kBf16x2AbsMask = 0x7FFF7FFFu;
// |h| + 0x80 reaches bit 15 exactly when h's exponent is all ones (inf, NaN); no carry between
// the halves since |h| <= 0x7FFF.
constexpr uint32_t kBf16x2ToTopBit = 0x00800080u;
constexpr uint32_t kBf16x2TopBits = 0x80008000u;
constexpr int kBf16Bits = 16;
constexpr uint32_t kHighHalf = 0xFFFF0000u;

// Zeroes the non-finite halves of two BF16 values; returns which (their top bits) in `bad`.
__device__ __forceinline__ uint32_t clean_bf16x2(uint32_t u, uint32_t& bad) {
  bad = ((u & kBf16x2AbsMask) + kBf16x2ToTopBit) & kBf16x2TopBits;
  return u & ~(bad | (bad - (bad >> (kBf16Bits - 1))));
}
__device__ __forceinline__ float bf16_lo(uint32_t u) {
  return __uint_as_float(u << kBf16Bits);
}
__device__ __forceinline__ float bf16_hi(uint32_t u) {
  return __uint_as_float(u & kHighHalf);
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// ---- documents --------------------------------------------------------------------------------

// The document holding token t (cu[b] <= t < cu[b + 1]; empty documents never match).
__device__ __forceinline__ int find_doc(const int32_t* cu, int num_docs, int64_t t) {
  int lo = 0, hi = num_docs;  // cu[lo] <= t < cu[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (__ldg(cu + mid) <= t) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The document-local group of `size` tokens holding t: [*begin, *end).
__device__ __forceinline__ void group_span(const KernelArgs& a, int64_t t, int size, int64_t* begin,
                                           int64_t* end) {
  const int b = find_doc(a.cu_seqlens, a.num_docs, t);
  const int64_t doc_begin = __ldg(a.cu_seqlens + b), doc_end = __ldg(a.cu_seqlens + b + 1);
  *begin = doc_begin + (t - doc_begin) / size * size;
  *end = min(*begin + size, doc_end);
}

// ---- rows -------------------------------------------------------------------------------------

__device__ __forceinline__ const uint4* chunk_ptr(const OperandArgs& op, int64_t t, int h, int c) {
  return reinterpret_cast<const uint4*>(op.in + t * op.stride_token + h * op.stride_head +
                                        c * kChunkElems);
}

template <int kLanes>
__device__ __forceinline__ float row_reduce_max(float m) {
#pragma unroll
  for (int bit = 1; bit < kLanes; bit *= 2) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, bit));
  return m;
}

__device__ __forceinline__ void to_floats(const uint4& raw, float (&x)[kChunkElems]) {
#pragma unroll
  for (int w = 0; w < kChunkElems / 2; ++w) {
    x[2 * w] = bf16_lo(word(raw, w));
    x[2 * w + 1] = bf16_hi(word(raw, w));
  }
}

__device__ __forceinline__ uint4 clean_chunk(uint4 v, uint32_t& any_bad) {
  uint32_t b0, b1, b2, b3;
  v.x = clean_bf16x2(v.x, b0);
  v.y = clean_bf16x2(v.y, b1);
  v.z = clean_bf16x2(v.z, b2);
  v.w = clean_bf16x2(v.w, b3);
  any_bad |= b0 | b1 | b2 | b3;
  return v;
}

__device__ __forceinline__ float chunk_amax(const float (&x)[kChunkElems]) {
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < kChunkElems; ++j) m = fmaxf(m, fabsf(x[j]));
  return m;
}

// The first non-finite element of the chunk at (t, h, c), by flat index, into the status word.
// Runs only when a load found one, so it re-reads the chunk rather than keep per-element flags.
template <int kDim>
__device__ void report_non_finite(const OperandArgs& op, unsigned long long* status, int64_t t,
                                  int h, int c) {
  const uint4 raw = __ldg(chunk_ptr(op, t, h, c));
  for (int k = 0; k < kChunkElems; ++k) {
    const uint16_t bits = uint16_t(word(raw, k / 2) >> (kBf16Bits * (k % 2)));
    if (!is_finite_float(bf16::decode(bits))) {
      atomicMin(status,
                static_cast<unsigned long long>((t * op.heads + h) * kDim + c * kChunkElems + k));
      return;
    }
  }
}

// ---- E2M1 ---------------------------------------------------------------------------------

// e2m1::encode_scaled's midpoints between neighbouring magnitudes, i = 0..6.
__host__ __device__ constexpr float e2m1_midpoint(int i) {
  constexpr float kMidpoints[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  return kMidpoints[i];
}
constexpr uint32_t kByteMask = 0xFF;
constexpr uint32_t kFloatSignShift = 31;
// Byte m: e4m3::encode(e2m1::decode(m)) for the magnitudes m = 0..7 (0, 0.5, 1, ..., 6).
constexpr uint64_t kE4m3OfE2m1 = 0x4C4844403C383000ull;

// e2m1::encode_scaled's magnitude code of a = |x| >= 0 in three comparisons instead of seven: the
// code is the number of midpoints m_i that a passes (a > m_i * scale, or a == m_i * scale for odd
// i: a tie goes to the even code), and passing is monotone in i. The thresholds are the same
// float products m_i * scale, so the codes are the same (tests compare every BF16 value).
__device__ __forceinline__ uint32_t e2m1_magnitude(float a, float scale) {
  const bool pass3 = a >= __fmul_rn(e2m1_midpoint(3), scale);
  const bool pass_mid = a >= __fmul_rn(pass3 ? e2m1_midpoint(5) : e2m1_midpoint(1), scale);
  const float last = pass3 ? (pass_mid ? e2m1_midpoint(6) : e2m1_midpoint(4))
                           : (pass_mid ? e2m1_midpoint(2) : e2m1_midpoint(0));
  return (pass3 ? 4u : 0u) + (pass_mid ? 2u : 0u) + (a > __fmul_rn(last, scale) ? 1u : 0u);
}

__device__ __forceinline__ bool sign_bit(float x) {
  return float_to_bits(x) >> kFloatSignShift;
}

// e2m1::encode_scaled(x, scale) for finite x.
__device__ __forceinline__ uint32_t e2m1_encode(float x, float scale) {
  const uint32_t m = e2m1_magnitude(fabsf(x), scale);
  return m == 0 ? 0u : (m | (sign_bit(x) ? uint32_t(e2m1::kSignBit) : 0u));
}

// vgroup16's 4-bit V: quantize_cpu's e4m3::encode(e2m1::decode(e2m1::encode_scaled(x, 2^e))), the
// E4M3 code of x's nearest E2M1 grid value, for finite x.
__device__ __forceinline__ uint32_t e2m1_grid_as_e4m3(float x, int e) {
  const uint32_t m = e2m1_magnitude(fabsf(x), exp2i(e));
  const uint32_t code = uint32_t(kE4m3OfE2m1 >> (kBitsPerByte * m)) & kByteMask;
  return m == 0 ? 0u : (code | (sign_bit(x) ? uint32_t(e4m3::kSignBit) : 0u));
}

// ---- NVFP4 ------------------------------------------------------------------------------------

// Smallest E4M3 local scale s with amax <= 6 * s * 2^e: quantize_cpu's search with the same
// float operations (the result is the least covering code whatever the starting point).
__device__ inline uint8_t nvfp4_local_scale(float amax, int e) {
  const float unit = exp2i(e);
  auto covers = [&](uint8_t code) {
    return __fmul_rn(__fmul_rn(e4m3::decode(code), e2m1::kMax), unit) >= amax;
  };
  uint8_t code =
      e4m3::encode_up(fminf(__fdiv_rn(__fmul_rn(amax, exp2i(-e)), e2m1::kMax), e4m3::kMax));
  while (!covers(code) && code < e4m3::kMaxCode) ++code;
  while (code > 0 && covers(uint8_t(code - 1))) --code;
  return code;
}

constexpr int kNibbleBits = 4;
constexpr int kChunksPerNvfp4Group = kNvfp4GroupSize / kChunkElems;

// One chunk of an NVFP4 row: a 16-element group spans lanes c and c ^ 1 (all lanes must call).
template <int kDim>
__device__ __forceinline__ void nvfp4_chunk(const OperandArgs& op, uint8_t exponent_code,
                                            const float (&x)[kChunkElems], int64_t t, int h, int c,
                                            bool valid) {
  static_assert(kChunksPerNvfp4Group == 2, "a group is two lanes' chunks");
  const int e = ue8m0::exponent(exponent_code);
  float m = fmaxf(chunk_amax(x), __shfl_xor_sync(kFullMask, chunk_amax(x), 1));
  const uint8_t s = m > 0.0f ? nvfp4_local_scale(m, e) : 0;
  const float scale = __fmul_rn(e4m3::decode(s), exp2i(e));
  uint32_t packed = 0;
  if (s != 0) {
#pragma unroll
    for (int k = 0; k < kChunkElems; ++k) packed |= e2m1_encode(x[k], scale) << (kNibbleBits * k);
  }
  if (!valid) return;
  const int64_t row = t * op.heads + h;
  *reinterpret_cast<uint32_t*>(op.nv_packed + row * (kDim / 2) + c * (kChunkElems / 2)) = packed;
  if (c % kChunksPerNvfp4Group == 0)
    op.nv_scales[row * (kDim / kNvfp4GroupSize) + c / kChunksPerNvfp4Group] = s;
}

// ---- policy stages ----------------------------------------------------------------------------

// The policy stages below stay out of line: they are off the token path, and inlined into the
// kernel (whose tile rows stay live in registers across them) they push it into spills.

// block32/floor: maxima of the halo rows [halo_lo, t0) and [t_end, halo_hi) into row_amax, every
// load issued before the first use.
template <int kDim, bool kRotate>
__device__ __noinline__ void block_halo(const OperandArgs& op, Smem<kDim>& sm, int h, int64_t t0,
                                        int64_t t_end, int c, int group) {
  using G = Geometry<kDim>;
  const int n_left = int(t0 - sm.halo_lo);
  const int n = n_left + int(sm.halo_hi - t_end);
  auto halo_token = [&](int k) { return k < n_left ? sm.halo_lo + k : t_end + (k - n_left); };
  uint4 raw[G::kHaloIters];
#pragma unroll
  for (int it = 0; it < G::kHaloIters; ++it) {
    const int k = it * G::kRowGroups + group;
    raw[it] = k < n ? __ldg(chunk_ptr(op, halo_token(k), h, c)) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int it = 0; it < G::kHaloIters; ++it) {
    if (it * G::kRowGroups >= n) break;  // CTA-uniform: the shuffles below see whole warps
    const int k = it * G::kRowGroups + group;
    uint32_t ignored = 0;  // the tile that owns the row reports it
    float x[1][kChunkElems];
    to_floats(clean_chunk(raw[it], ignored), x[0]);
    if constexpr (kRotate) {
      if (op.rotate) hadamard_rows<G::kLanesPerRow>(x, c);
    }
    const float m = row_reduce_max<G::kLanesPerRow>(chunk_amax(x[0]));
    if (k < n && c == 0) sm.row_amax[kBlockHalo + (halo_token(k) - t0)] = m;
  }
}

// vgroup16's V: the groups holding the tile's tokens (one per document-local 16-key group that
// starts in the tile, plus the one holding t0) are listed first; then one item per (group,
// channel chunk) reads the whole group and writes the channel exponents of its rows inside the
// tile, to shared memory (for the codes) and to the output.
template <int kDim>
__device__ __noinline__ void channel_exponents(const KernelArgs& a, const OperandArgs& op,
                                               Smem<kDim>& sm, int h, int64_t t0, int64_t t_end) {
  using G = Geometry<kDim>;
  constexpr int kLanes = G::kLanesPerRow;
  if (threadIdx.x == 0) sm.num_groups = 0;
  __syncthreads();
  if (threadIdx.x < G::kTileTokens && t0 + threadIdx.x < t_end) {
    const int64_t t = t0 + threadIdx.x;
    int64_t begin, end;
    group_span(a, t, kVGroupTokens, &begin, &end);
    if (t == t0 || t == begin) {  // slots in any order: each group writes only its own rows
      const int slot = atomicAdd(&sm.num_groups, 1);
      sm.group_begin[slot] = int(begin - t0);
      sm.group_end[slot] = int(end - t0);
    }
  }
  __syncthreads();
  const int items = sm.num_groups * kLanes;
  for (int item = threadIdx.x; item < items; item += kThreads) {
    const int slot = item / kLanes, c = item % kLanes;
    const int64_t begin = t0 + sm.group_begin[slot], end = t0 + sm.group_end[slot];
    uint32_t m[kChunkElems / 2] = {};
#pragma unroll
    for (int base = 0; base < kVGroupTokens; base += kVGroupBatch) {
      uint4 rows[kVGroupBatch];
#pragma unroll
      for (int j = 0; j < kVGroupBatch; ++j) {
        const int64_t r = begin + base + j;
        rows[j] = r < end ? __ldg(chunk_ptr(op, r, h, c)) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int j = 0; j < kVGroupBatch; ++j) {
        uint32_t ignored = 0;
        const uint4 clean = clean_chunk(rows[j], ignored);
#pragma unroll
        for (int w = 0; w < kChunkElems / 2; ++w)
          m[w] = __vmaxu2(m[w], word(clean, w) & kBf16x2AbsMask);
      }
    }
    uint32_t bytes[2] = {};
#pragma unroll
    for (int k = 0; k < kChunkElems; ++k) {
      const float amax = bf16::decode(uint16_t(m[k / 2] >> (kBf16Bits * (k % 2))));
      const uint32_t code = ue8m0::from_exponent(scale_exponent_up(amax, e2m1::kMax));
      bytes[k / kBytesPerWord] |= code << (kBitsPerByte * (k % kBytesPerWord));
    }
    const uint2 packed = make_uint2(bytes[0], bytes[1]);
    for (int64_t r = max(begin, t0); r < min(end, t_end); ++r) {
      *reinterpret_cast<uint2*>(&sm.channel_exps[r - t0][c * kChunkElems]) = packed;
      *reinterpret_cast<uint2*>(op.channel_exponents + (r * op.heads + h) * kDim +
                                c * kChunkElems) = packed;
    }
  }
}

// Exponent of token t0 + i (thread i): its policy's rule over the row maxima in shared memory
// (vgroup16's V keeps per-token exponents: the token rule). One thread per token computes it,
// rather than every lane of the row.
// Rows from t_limit on (padding; under the document tiling also the next document's, past t_end)
// take the padding code, the smallest: tile_exponent_max sees the tile's own tokens only.
template <int kDim>
__device__ __forceinline__ void token_exponents(const KernelArgs& a, int opi, Smem<kDim>& sm,
                                                int64_t t0, int64_t t_limit) {
  const OperandArgs& op = a.ops[opi];
  const int i = threadIdx.x;
  const int64_t t = t0 + i;
  uint8_t code = kPaddingExponentCode, nv_code = kPaddingExponentCode;
  if (t < t_limit) {
    const float amax = sm.row_amax[kBlockHalo + i];
    int e = scale_exponent_up(amax, e4m3::kMax);
    if (op.policy == ScalePolicy::kTensor) {
      e = scale_exponent_up(__uint_as_float(__ldg(a.tensor_amax + opi)), e4m3::kMax);
    } else if (op.policy == ScalePolicy::kBlock32 || op.policy == ScalePolicy::kFloor) {
      int64_t begin, end;
      group_span(a, t, kBlockTokens, &begin, &end);
      float m = 0.0f;
      for (int64_t r = begin; r < end; ++r) m = fmaxf(m, sm.row_amax[kBlockHalo + (r - t0)]);
      e = op.policy == ScalePolicy::kFloor ? scale_exponent_floor(m)
                                           : scale_exponent_up(m, e4m3::kMax);
    }
    code = ue8m0::from_exponent(e);
    if (op.nv_packed != nullptr)
      nv_code = ue8m0::from_exponent(scale_exponent_up(amax, kNvfp4TokenMax));
  }
  sm.exps[i] = code;
  sm.nv_exps[i] = nv_code;
}

// ---- codes ------------------------------------------------------------------------------------

// The words of 4 tokens' codes (a pass's rows of one lane) as 8 dims' words of codes_t (4 tokens
// each) into the shared tile.
template <int kDim>
__device__ __forceinline__ void store_transposed_words(uint32_t (*tile)[Geometry<kDim>::kTileWords],
                                                       const uint32_t (&codes)[kQuadTokens][2],
                                                       int c, int col) {
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const uint32_t lo01 = __byte_perm(codes[0][w], codes[1][w], kPermInterleaveLow);
    const uint32_t hi01 = __byte_perm(codes[0][w], codes[1][w], kPermInterleaveHigh);
    const uint32_t lo23 = __byte_perm(codes[2][w], codes[3][w], kPermInterleaveLow);
    const uint32_t hi23 = __byte_perm(codes[2][w], codes[3][w], kPermInterleaveHigh);
    const uint32_t dims[kBytesPerWord] = {
        __byte_perm(lo01, lo23, kPermLowHalves), __byte_perm(lo01, lo23, kPermHighHalves),
        __byte_perm(hi01, hi23, kPermLowHalves), __byte_perm(hi01, hi23, kPermHighHalves)};
#pragma unroll
    for (int j = 0; j < kBytesPerWord; ++j) {
      const int d = c * kChunkElems + w * kBytesPerWord + j;
      tile[d][col ^ transposed_swizzle<kDim>(d)] = dims[j];
    }
  }
}

// The thread's rows of one pass, quantized: one E4M3 exponent per row (e) or, for vgroup16's V,
// per element from shared memory; NVFP4 with the rows' token exponent codes (nv); codes to global
// memory, transposed words to shared memory; and the tile codes (OperandArgs::codes_tiles,
// codes_t_tiles) at tile_max, the tile's largest exponent.
template <int kDim>
__device__ __forceinline__ void emit_pass(const OperandArgs& op, Smem<kDim>& sm, int p,
                                          const float (&x)[kQuadTokens][kChunkElems],
                                          const int (&e)[kQuadTokens],
                                          const uint8_t (&nv)[kQuadTokens], int h, int t0,
                                          int t_end, int c, int group, int tile_max) {
  using G = Geometry<kDim>;
  const bool channel_scales = op.policy == ScalePolicy::kVGroup16;
  const bool tile_codes = op.codes_tiles != nullptr || op.codes_t_tiles != nullptr;
  uint32_t codes[kQuadTokens][2], tiles[kQuadTokens][2];
#pragma unroll
  for (int r = 0; r < kQuadTokens; ++r) {
    const int i = p * G::kTokensPerPass + group * kQuadTokens + r;
    const int t = t0 + i;
    const bool valid = t < t_end;
    if (channel_scales) {
      // Rows past the tokens hold zeros: any exponent gives code 0.
      const uint2 ce = valid ? *reinterpret_cast<const uint2*>(&sm.channel_exps[i][c * kChunkElems])
                             : make_uint2(0, 0);
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        codes[r][w] = 0;
#pragma unroll
        for (int b = 0; b < kBytesPerWord; ++b) {
          const uint32_t byte = ((w == 0 ? ce.x : ce.y) >> (kBitsPerByte * b)) & kByteMask;
          codes[r][w] |=
              e2m1_grid_as_e4m3(x[r][w * kBytesPerWord + b], ue8m0::exponent(uint8_t(byte)))
              << (kBitsPerByte * b);
        }
      }
    } else {
      const float s = exp2i(-e[r]);
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        const int k = w * kBytesPerWord;
        codes[r][w] = e4m3x4_rn_satfinite(__fmul_rn(x[r][k], s), __fmul_rn(x[r][k + 1], s),
                                          __fmul_rn(x[r][k + 2], s), __fmul_rn(x[r][k + 3], s));
      }
      if (tile_codes) {
        const float f = exp2i(tile_shift(e[r], tile_max));
#pragma unroll
        for (int w = 0; w < 2; ++w) tiles[r][w] = e4m3x4_scaled(codes[r][w], f, f, f, f);
      }
    }
    const int64_t row = (int64_t(t) * op.heads + h) * kDim + c * kChunkElems;
    if (valid && op.codes != nullptr)
      *reinterpret_cast<uint2*>(op.codes + row) = make_uint2(codes[r][0], codes[r][1]);
    if (valid && op.codes_tiles != nullptr)
      *reinterpret_cast<uint2*>(op.codes_tiles + row) = make_uint2(tiles[r][0], tiles[r][1]);
    if (op.nv_packed != nullptr) nvfp4_chunk<kDim>(op, nv[r], x[r], t, h, c, valid);
  }
  if (op.codes_t == nullptr) return;
  const int col = p * G::kRowGroups + group;  // tokens 4 col .. 4 col + 3 of the tile
  store_transposed_words<kDim>(sm.transposed, codes, c, col);
  if (op.codes_t_tiles != nullptr) store_transposed_words<kDim>(sm.transposed_tiles, tiles, c, col);
}

// The largest exponent of the tile's tokens (padding positions hold the smallest code).
template <int kDim>
__device__ __forceinline__ int tile_exponent_max(const Smem<kDim>& sm) {
  using G = Geometry<kDim>;
  uint32_t m = 0;  // four running byte maxima
#pragma unroll
  for (int k = 0; k < G::kTileTokens / kVectorBytes; ++k) {
    const uint4 v = *reinterpret_cast<const uint4*>(&sm.exps[k * kVectorBytes]);
    m = __vmaxu4(m, __vmaxu4(__vmaxu4(v.x, v.y), __vmaxu4(v.z, v.w)));
  }
  m = __vmaxu4(m, m >> 16);
  m = __vmaxu4(m, m >> 8);
  return ue8m0::exponent(uint8_t(m));
}

// ---- codes_t ------------------------------------------------------------------------------------
// The index arithmetic is in quantize_geometry.h; here are the device's lanes, reads and stores.

// One warp's lanes for quantize_geometry.h's warp-wide searches (all 32 lanes call).
struct WarpLanes {
  int lane;
  template <typename F>
  __device__ __forceinline__ int count(F f) const {
    return __popc(__ballot_sync(kFullMask, f(lane)));
  }
  template <typename F>
  __device__ __forceinline__ void each(F f) const {
    f(lane);
  }
  __device__ __forceinline__ void sync() const { __syncwarp(); }
};

// cu_seqlens[b] for b in [0, num_docs]: the layout's ends (0 and the token count) without a read,
// so one document reads nothing.
struct DocOffsets {
  const int32_t* cu;
  int num_docs, tokens;
  __device__ __forceinline__ int operator()(int b) const {
    return b == 0 ? 0 : b >= num_docs ? tokens : __ldg(cu + b);
  }
};

// cu_seqlens[b] for b >= the span's doc_lo: from the window in shared memory when it holds it.
template <int kDim>
struct WindowOffsets {
  const Smem<kDim>& sm;
  DocOffsets global;
  __device__ __forceinline__ int operator()(int b) const {
    const int i = b - sm.span.doc_lo;
    return i < kWindowDocs ? sm.window[i] : global(b);
  }
};

// codes_t's rows of one head: rows.storeN(d, p, x) writes N bytes at position p of dim d's row.
struct TransposedRows {
  uint8_t* head;  // codes_t's row of dim 0 of the head
  int64_t row_bytes;
  __device__ __forceinline__ uint8_t* at(int d, int64_t p) const {
    return head + int64_t(d) * row_bytes + p;
  }
  __device__ __forceinline__ void store16(int d, int64_t p, const uint4& v) const {
    *reinterpret_cast<uint4*>(at(d, p)) = v;
  }
  __device__ __forceinline__ void store4(int d, int64_t p, uint32_t v) const {
    *reinterpret_cast<uint32_t*>(at(d, p)) = v;
  }
  __device__ __forceinline__ void store2(int d, int64_t p, uint16_t v) const {
    *reinterpret_cast<uint16_t*>(at(d, p)) = v;
  }
  __device__ __forceinline__ void store1(int d, int64_t p, uint8_t v) const { *at(d, p) = v; }
};

// Stage A, warp 0, while the tile's loads are in flight: the span and the window.
template <int kDim, Tiles kTiles>
__device__ __forceinline__ void find_transposed_span(const KernelArgs& a, Smem<kDim>& sm, int t0,
                                                     int t_end) {
  const WarpLanes lanes{int(threadIdx.x)};
  const DocOffsets cu{a.cu_seqlens, a.num_docs, int(a.tokens)};
  const TransposedSpan s =
      find_span<kTiles>(lanes, cu, sm.window, a.num_docs, int(a.tokens), a.tokens_t, t0, t_end);
  if (threadIdx.x == 0) sm.span = s;
}

// Stages E and S of an unaligned span: records of chunks [base, base + kSpanChunks).
template <int kDim>
__device__ __forceinline__ void build_transposed_records(const KernelArgs& a, Smem<kDim>& sm,
                                                         int t0, int t_end, int base) {
  const WindowOffsets<kDim> at{sm, {a.cu_seqlens, a.num_docs, int(a.tokens)}};
  build_chunk_table<kDim>(sm.span, at, t0, t_end, base, int(threadIdx.x), sm.chunk_records);
}

// Stage S: the tile's span of codes_t. An aligned span takes the plain 16-byte copies; another
// one its chunks' records, in batches of kSpanChunks only when empty documents make it longer.
// V's codes_t_tiles beside codes_t where the launch writes them (OperandArgs::codes_t_tiles):
// packed, every span is aligned; under the document tiling all but tile 0 after leading empty
// documents.
template <int kDim, Tiles kTiles>
__device__ __forceinline__ void store_transposed(const KernelArgs& a, const OperandArgs& op,
                                                 Smem<kDim>& sm, int h, int t0, int t_end) {
  using G = Geometry<kDim>;
  TransposedRows rows{op.codes_t + int64_t(h) * kDim * a.tokens_t, a.tokens_t};
  if (sm.span.aligned) {
    store_aligned_span<kDim, kTiles>(sm.span, sm.transposed, t_end - t0, int(threadIdx.x), rows);
    if (op.codes_t_tiles != nullptr) {
      TransposedRows tile_rows{op.codes_t_tiles + int64_t(h) * kDim * a.tokens_t, a.tokens_t};
      store_aligned_span<kDim, kTiles>(sm.span, sm.transposed_tiles, t_end - t0, int(threadIdx.x),
                                       tile_rows);
    }
    return;
  }
  const int chunks = sm.span.chunks;  // CTA-uniform
  for (int base = 0;;) {
    store_span_chunks<kDim>(sm.span, sm.chunk_records, sm.transposed, base, int(threadIdx.x), rows);
    if (kTiles == Tiles::kDocument && op.codes_t_tiles != nullptr) {
      TransposedRows tile_rows{op.codes_t_tiles + int64_t(h) * kDim * a.tokens_t, a.tokens_t};
      store_span_chunks<kDim>(sm.span, sm.chunk_records, sm.transposed_tiles, base,
                              int(threadIdx.x), tile_rows);
    }
    base += G::kSpanChunks;
    if (base >= chunks) break;
    __syncthreads();  // the records are read
    build_transposed_records<kDim>(a, sm, t0, t_end, base);
    __syncthreads();
  }
}

// The tile's exponent rows, padding tokens included. Packed tiles start 16-aligned and reach Tp
// (a multiple of 16) where they end the batch, their rows past t_end holding the padding code:
// 16-byte stores. Document tiles: 16-byte stores where that holds as well, else one byte per
// token, and the padding after the batch's last token from the tile ending there.
template <int kDim, Tiles kTiles>
__device__ __forceinline__ void store_exponent_rows(const KernelArgs& a, const OperandArgs& op,
                                                    const Smem<kDim>& sm, int h, int t0,
                                                    int t_end) {
  using G = Geometry<kDim>;
  const int64_t tp = a.tokens_padded;
  const int i = threadIdx.x;
  if (kTiles == Tiles::kPacked ||
      (t0 % kVectorBytes == 0 && (t_end - t0 == G::kTileTokens || t_end == a.tokens))) {
    const int chunks = int(min(int64_t(G::kTileTokens), tp - t0)) / kVectorBytes;
    if (i < chunks) {
      *reinterpret_cast<uint4*>(op.exponents + h * tp + t0 + i * kVectorBytes) =
          *reinterpret_cast<const uint4*>(&sm.exps[i * kVectorBytes]);
      if (op.nv_packed != nullptr)
        *reinterpret_cast<uint4*>(op.nv_exponents + h * tp + t0 + i * kVectorBytes) =
            *reinterpret_cast<const uint4*>(&sm.nv_exps[i * kVectorBytes]);
    }
    return;
  }
  uint8_t* exps = op.exponents + h * tp;
  uint8_t* nv_exps = op.nv_packed != nullptr ? op.nv_exponents + h * tp : nullptr;
  if (i < t_end - t0) {
    exps[t0 + i] = sm.exps[i];
    if (nv_exps != nullptr) nv_exps[t0 + i] = sm.nv_exps[i];
  }
  if (t_end == a.tokens && a.tokens + i < tp) {
    exps[a.tokens + i] = kPaddingExponentCode;
    if (nv_exps != nullptr) nv_exps[a.tokens + i] = kPaddingExponentCode;
  }
}

// ---- the kernel -------------------------------------------------------------------------------

template <int kDim, bool kRotate, Tiles kTiles>
__global__ void __launch_bounds__(kThreads, kRotate ? kCtasPerSmRotated : kCtasPerSm)
    quantize_kernel(const __grid_constant__ KernelArgs a) {
  using G = Geometry<kDim>;
  constexpr int kL = G::kLanesPerRow;
  __shared__ Smem<kDim> sm;

  int opi = 0;
  while (opi + 1 < a.num_ops && int(blockIdx.x) >= a.ops[opi + 1].first_tile) ++opi;
  const OperandArgs& op = a.ops[opi];
  const int tile = int(blockIdx.x) - op.first_tile;
  const int h = tile % op.heads;
  // Token indices fit int32 (validate() bounds the token count); flat offsets are int64.
  int t0, t_end;
  if constexpr (kTiles == Tiles::kDocument) {
    const int2 range = a.document_tiles[tile / op.heads];
    if (range.x < 0) return;  // an idle slot: the whole CTA, before any barrier
    t0 = range.x;
    t_end = range.y;
  } else {
    t0 = tile / op.heads * G::kTileTokens;
    t_end = int(min(int64_t(t0) + G::kTileTokens, a.tokens));
  }
  const int c = threadIdx.x % kL;
  const int group = threadIdx.x / kL;
  auto tile_token = [&](int p, int r) { return p * G::kTokensPerPass + group * kQuadTokens + r; };

  // A: every load in flight first, then clean (and report), rotate, row maxima.
  uint4 raw[G::kPasses][kQuadTokens];
#pragma unroll
  for (int p = 0; p < G::kPasses; ++p)
#pragma unroll
    for (int r = 0; r < kQuadTokens; ++r) {
      const int t = t0 + tile_token(p, r);
      raw[p][r] = t < t_end ? __ldcs(chunk_ptr(op, t, h, c)) : make_uint4(0, 0, 0, 0);
    }
  // codes_t's span: warp 0 searches cu_seqlens while the loads are in flight (read after stage
  // P's barrier).
  if (op.codes_t != nullptr && !a.amax_only && threadIdx.x < kWarpLanes)
    find_transposed_span<kDim, kTiles>(a, sm, t0, t_end);
  uint32_t any_bad = 0;
#pragma unroll
  for (int p = 0; p < G::kPasses; ++p)
#pragma unroll
    for (int r = 0; r < kQuadTokens; ++r) raw[p][r] = clean_chunk(raw[p][r], any_bad);
  if (any_bad != 0) {
    for (int p = 0; p < G::kPasses; ++p)
      for (int r = 0; r < kQuadTokens; ++r) {
        const int t = t0 + tile_token(p, r);
        if (t < t_end) report_non_finite<kDim>(op, a.non_finite + op.slot, t, h, c);
      }
  }
  // The rotated instantiation keeps the rotated values of both passes (the rotation costs more
  // than the registers); the other re-reads raw's BF16 bits.
  float vals[kRotate ? G::kPasses : 1][kQuadTokens][kChunkElems];
  float amax[G::kPasses][kQuadTokens];
#pragma unroll
  for (int p = 0; p < G::kPasses; ++p) {
#pragma unroll
    for (int r = 0; r < kQuadTokens; ++r) {
      float x[kChunkElems];
      to_floats(raw[p][r], x);
      if constexpr (kRotate) {
#pragma unroll
        for (int j = 0; j < kChunkElems; ++j) vals[p][r][j] = x[j];
      } else {
        amax[p][r] = chunk_amax(x);
      }
    }
    if constexpr (kRotate) {
      if (op.rotate) hadamard_rows<kL>(vals[p], c);
#pragma unroll
      for (int r = 0; r < kQuadTokens; ++r) amax[p][r] = chunk_amax(vals[p][r]);
    }
#pragma unroll
    for (int r = 0; r < kQuadTokens; ++r) amax[p][r] = row_reduce_max<kL>(amax[p][r]);
  }

  if (a.amax_only) {  // the tensor policy's first launch: one maximum per operand
    float m = 0.0f;
#pragma unroll
    for (int p = 0; p < G::kPasses; ++p)
#pragma unroll
      for (int r = 0; r < kQuadTokens; ++r) m = fmaxf(m, amax[p][r]);
    m = row_reduce_max<kWarpLanes>(m);
    if (threadIdx.x % kWarpLanes == 0) atomicMax(a.tensor_amax + opi, __float_as_uint(m));
    return;
  }
  if (c == 0) {
#pragma unroll
    for (int p = 0; p < G::kPasses; ++p)
#pragma unroll
      for (int r = 0; r < kQuadTokens; ++r) sm.row_amax[kBlockHalo + tile_token(p, r)] = amax[p][r];
  }

  // P: what the policy needs beyond the tile's own rows.
  if (op.policy == ScalePolicy::kVGroup16) {
    channel_exponents<kDim>(a, op, sm, h, t0, t_end);
  } else if (op.policy == ScalePolicy::kBlock32 || op.policy == ScalePolicy::kFloor) {
    if (threadIdx.x == 0) {
      int64_t begin, end;
      group_span(a, t0, kBlockTokens, &begin, &end);
      sm.halo_lo = begin;
      group_span(a, t_end - 1, kBlockTokens, &begin, &end);
      sm.halo_hi = end;
    }
    __syncthreads();
    block_halo<kDim, kRotate>(op, sm, h, t0, t_end, c, group);
  }
  __syncthreads();

  // E: one exponent per token; the records of codes_t's chunks unless the span is aligned.
  if (threadIdx.x < G::kTileTokens)
    token_exponents<kDim>(a, opi, sm, t0, kTiles == Tiles::kDocument ? t_end : a.tokens);
  if (op.codes_t != nullptr && !sm.span.aligned)
    build_transposed_records<kDim>(a, sm, t0, t_end, 0);
  __syncthreads();

  // B: codes, NVFP4, transposed words; T: the tile codes beside them.
  const int tile_max =
      op.codes_tiles != nullptr || op.codes_t_tiles != nullptr ? tile_exponent_max<kDim>(sm) : 0;
#pragma unroll
  for (int p = 0; p < G::kPasses; ++p) {
    float x[kQuadTokens][kChunkElems];
    int e[kQuadTokens];
    uint8_t nv[kQuadTokens];
#pragma unroll
    for (int r = 0; r < kQuadTokens; ++r) {
      if constexpr (kRotate) {
#pragma unroll
        for (int j = 0; j < kChunkElems; ++j) x[r][j] = vals[p][r][j];
      } else {
        to_floats(raw[p][r], x[r]);
      }
      e[r] = ue8m0::exponent(sm.exps[tile_token(p, r)]);
      nv[r] = sm.nv_exps[tile_token(p, r)];
    }
    emit_pass<kDim>(op, sm, p, x, e, nv, h, t0, t_end, c, group, tile_max);
  }
  __syncthreads();

  // S: codes_t's span, then the exponent rows of the tile, and of the padding tokens after the
  // last one.
  if (op.codes_t != nullptr) store_transposed<kDim, kTiles>(a, op, sm, h, t0, t_end);
  store_exponent_rows<kDim, kTiles>(a, op, sm, h, t0, t_end);
}

}  // namespace flamia::sm90::quant
