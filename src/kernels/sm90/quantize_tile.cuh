// The fused quantizer's kernel (DESIGN §3): one CTA quantizes a tile of kTileElems elements (128
// tokens at head dim 128, 256 at 64) of one head of one operand, writing every array quantize_cpu
// writes, bit for bit.
//
// Work split. A row (token, head) of D BF16 values is D/8 lanes of one 16-byte load each; a thread
// owns the same 8-element chunk of 4 consecutive tokens per pass (two passes), so after quantizing
// it holds a 4 x 4 byte block per word that byte-permutes turn into one 32-bit word of codes_t (4
// tokens of one dim). All loads of the thread are issued before any use (32 KB per CTA in flight).
//
// Stages of a tile:
//   A  load, zero non-finite values (reporting the first one), rotate Q/K when asked (butterflies
//      across the lanes of a row: the same stages and operations as hadamard.h, so the same bits),
//      row maxima through shuffles into shared memory;
//   P  block32/floor need the maxima of the document-local 32-token blocks that straddle the tile
//      edges: the tile reads a halo of up to 31 rows on each side, only as far as the blocks of
//      its first and last token reach (documents start at arbitrary offsets, so tiles aligned in
//      the packed buffer never align with blocks). vgroup16's V needs per-channel maxima of
//      document-local 16-key groups: one item per (group starting in the tile or holding its first
//      token, channel chunk) reads the whole group, at most 15 rows beyond the tile, and spreads
//      its exponents. A token's document comes from a binary search in cu_seqlens;
//   E  one thread per token computes its exponent (every lane of a row doing it costs ~20 % of
//      the token policy's throughput) and the NVFP4 token exponent, into shared memory; with a
//      transposed copy, the thread of each token that starts a document-relative 16-token group
//      (or holds the tile's first token) lists that group (flamia/quantize.h: codes_t's positions),
//      and two threads find the documents whose trailing gap the tile writes;
//   B  codes (hardware RNE conversion, proven equal to e4m3::encode), NVFP4 nibbles and local
//      scales, and the transposed words (tile token order) into a swizzled shared tile;
//   S  codes_t: per listed group and dim, 16 bytes gathered from the shared tile (documents start
//      at any token, so at any byte), masked to the group's tokens in the tile and permuted into
//      the group's slot order: one 16-byte store when every token of the group is in the tile
//      (its zero tail included), else byte stores of the tile's tokens (and of the zero tail when
//      the tile holds the document's last token); then zero 16-byte stores of the gaps between
//      documents, each written by the tile holding the token just before the next document's
//      start (token 0's tile for leading empty documents; quantize_gpu zeroes codes_t when there
//      are no tokens at all). Then 16-byte stores of the exponent rows, padding tokens included.
// The tensor policy's maxima come from a first launch of this kernel (amax_only).
#pragma once

#include <cstdint>

#include "flamia/formats.h"
#include "flamia/hadamard.h"
#include "flamia/quantize.h"
#include "fp8_convert.cuh"

namespace flamia::sm90::quant {

constexpr int kThreads = 256;
constexpr int kTileElems = 16384;  // per CTA: 32 KB of BF16 in, codes_t rows of 128 or 256 bytes
constexpr int kQuadTokens = 4;     // tokens per thread per pass: one word of codes_t
constexpr int kChunkElems = 8;     // BF16 elements per 16-byte load
constexpr int kVectorBytes = 16;
constexpr int kBytesPerWord = 4;
constexpr int kWarpLanes = 32;
constexpr int kBlockHalo = kBlockTokens - 1;  // rows a 32-token block reaches past a tile edge
constexpr int kVGroupBatch = 4;               // rows of a 16-key group loaded at once
constexpr unsigned kFullMask = 0xFFFFFFFFu;
// CTAs per SM the register budget is sized for: 3 x 32 KB of loads in flight per SM (80
// registers); the rotated instantiation keeps both passes' floats and gets 128 registers.
constexpr int kCtasPerSm = 3, kCtasPerSmRotated = 2;

__host__ __device__ constexpr int tile_tokens(int dim) {
  return kTileElems / dim;
}

template <int kDim>
struct Geometry {
  static constexpr int kTileTokens = tile_tokens(kDim);
  static constexpr int kLanesPerRow = kDim / kChunkElems;
  static constexpr int kRowGroups = kThreads / kLanesPerRow;
  static constexpr int kGroupsPerWarp = kWarpLanes / kLanesPerRow;
  static constexpr int kTokensPerPass = kRowGroups * kQuadTokens;
  static constexpr int kPasses = kTileTokens / kTokensPerPass;
  static constexpr int kTileWords = kTileTokens / kQuadTokens;  // words per codes_t row
  static constexpr int kHaloIters = (2 * kBlockHalo + kRowGroups - 1) / kRowGroups;
  static_assert(kPasses >= 1 && kTileTokens % kTokensPerPass == 0, "tile must be whole passes");
  static_assert(kTileWords % kWarpLanes == 0, "the swizzle spreads one warp over 32 banks");
  static_assert(kTileTokens <= kThreads, "one thread per token in stage E");
};

struct OperandArgs {
  const uint16_t* in = nullptr;
  int64_t stride_token = 0, stride_head = 0;
  int heads = 0;
  ScalePolicy policy = ScalePolicy::kToken;  // the operand's effective policy
  bool rotate = false;
  uint8_t* codes = nullptr;
  uint8_t* codes_t = nullptr;  // null: no transposed copy
  uint8_t* exponents = nullptr;
  uint8_t* channel_exponents = nullptr;
  uint8_t* nv_packed = nullptr;  // null: no NVFP4 for this operand
  uint8_t* nv_scales = nullptr;
  uint8_t* nv_exponents = nullptr;
  int first_tile = 0;  // this operand's tiles are [first_tile, next operand's first_tile)
};

struct KernelArgs {
  OperandArgs ops[kNumOperands];
  int num_ops = 0;
  int64_t tokens = 0, tokens_padded = 0;
  int64_t tokens_t = 0;                 // codes_t's row length (QuantLayout::tokens_t)
  const int32_t* cu_seqlens = nullptr;  // device
  int num_docs = 0;
  unsigned long long* non_finite = nullptr;  // [kNumOperands]
  unsigned* tensor_amax = nullptr;           // [kNumOperands] float bits, tensor policy only
  bool amax_only = false;                    // the tensor policy's first launch
};

template <int kDim>
struct Smem {
  using G = Geometry<kDim>;
  uint32_t transposed[kDim][G::kTileWords];  // swizzled, see transposed_swizzle
  alignas(kVectorBytes) uint8_t channel_exps[G::kTileTokens][kDim];  // vgroup16's V
  float row_amax[kBlockHalo + G::kTileTokens + kBlockHalo];          // index kBlockHalo + t - t0
  alignas(kVectorBytes) uint8_t exps[G::kTileTokens];
  alignas(kVectorBytes) uint8_t nv_exps[G::kTileTokens];
  int group_begin[G::kTileTokens], group_end[G::kTileTokens];  // vgroup16: tokens - t0
  int num_groups;
  int64_t halo_lo, halo_hi;
  // codes_t's document-relative 16-token groups holding tokens of the tile (stage E lists them,
  // stage S stores them).
  struct alignas(kVectorBytes) TransposedGroup {
    int64_t pos;      // codes_t position of the group's slot 0
    int first;        // the group's first token - t0 (-15 .. tile - 1)
    uint32_t bounds;  // TransposedBounds
  } tgroups[G::kTileTokens];
  int num_tgroups;
  int gap_doc_lo, gap_doc_hi;  // documents whose trailing gap the tile zeroes
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

// The smallest b in [0, num_docs) with cu[b + 1] > x, or num_docs if none.
__device__ __forceinline__ int first_doc_ending_after(const int32_t* cu, int num_docs, int64_t x) {
  int lo = 0, hi = num_docs;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (__ldg(cu + mid + 1) > x) {
      hi = mid;
    } else {
      lo = mid + 1;
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

// Orthonormal Walsh-Hadamard rotation of rows spread over kLanes lanes, kChunkElems values each:
// hadamard_rotate's stages in the same order (spans 1, 2, 4 inside the thread, then across
// lanes), each a set of correctly rounded a + b and a - b, then one multiply.
template <int kLanes, int kRows>
__device__ __forceinline__ void hadamard_rows(float (&v)[kRows][kChunkElems], int lane_c) {
#pragma unroll
  for (int span = 1; span < kChunkElems; span *= 2)
#pragma unroll
    for (int base = 0; base < kChunkElems; base += 2 * span)
#pragma unroll
      for (int j = base; j < base + span; ++j)
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float a = v[r][j], b = v[r][j + span];
          v[r][j] = __fadd_rn(a, b);
          v[r][j + span] = __fsub_rn(a, b);
        }
#pragma unroll
  for (int bit = 1; bit < kLanes; bit *= 2) {
    const bool upper = lane_c & bit;  // holds x[j + span] of each pair
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int j = 0; j < kChunkElems; ++j) {
        const float other = __shfl_xor_sync(kFullMask, v[r][j], bit);
        v[r][j] = upper ? __fsub_rn(other, v[r][j]) : __fadd_rn(v[r][j], other);
      }
  }
  const float scale = hadamard_scale<float>(kLanes * kChunkElems);
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int j = 0; j < kChunkElems; ++j) v[r][j] = __fmul_rn(v[r][j], scale);
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
constexpr int kBitsPerByte = 8;
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
template <int kDim>
__device__ __forceinline__ void token_exponents(const KernelArgs& a, int opi, Smem<kDim>& sm,
                                                int64_t t0) {
  const OperandArgs& op = a.ops[opi];
  const int i = threadIdx.x;
  const int64_t t = t0 + i;
  uint8_t code = kPaddingExponentCode, nv_code = kPaddingExponentCode;
  if (t < a.tokens) {
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

// Byte permutes that transpose a 4 x 4 byte block held as 4 words (token-major to dim-major).
constexpr uint32_t kPermInterleaveLow = 0x5140;   // a0 b0 a1 b1
constexpr uint32_t kPermInterleaveHigh = 0x7362;  // a2 b2 a3 b3
constexpr uint32_t kPermLowHalves = 0x5410;       // a0 a1 b0 b1 (16-bit halves)
constexpr uint32_t kPermHighHalves = 0x7632;      // a2 a3 b2 b3

// Word column of codes_t's shared tile: the logical column XOR a per-chunk swizzle, so the 32
// lanes of a warp (kGroupsPerWarp row groups x kLanesPerRow chunks) write 32 different banks.
template <int kDim>
__device__ __forceinline__ int transposed_swizzle(int d) {
  return (d / kChunkElems) * Geometry<kDim>::kGroupsPerWarp;
}

// The thread's rows of one pass, quantized: one E4M3 exponent per row (e) or, for vgroup16's V,
// per element from shared memory; NVFP4 with the rows' token exponent codes (nv); codes to global
// memory, transposed words to shared memory.
template <int kDim>
__device__ __forceinline__ void emit_pass(const OperandArgs& op, Smem<kDim>& sm, int p,
                                          const float (&x)[kQuadTokens][kChunkElems],
                                          const int (&e)[kQuadTokens],
                                          const uint8_t (&nv)[kQuadTokens], int h, int t0,
                                          int t_end, int c, int group) {
  using G = Geometry<kDim>;
  const bool channel_scales = op.policy == ScalePolicy::kVGroup16;
  uint32_t codes[kQuadTokens][2];
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
    }
    if (valid)
      *reinterpret_cast<uint2*>(op.codes + (int64_t(t) * op.heads + h) * kDim + c * kChunkElems) =
          make_uint2(codes[r][0], codes[r][1]);
    if (op.nv_packed != nullptr) nvfp4_chunk<kDim>(op, nv[r], x[r], t, h, c, valid);
  }
  if (op.codes_t == nullptr) return;
  const int col = p * G::kRowGroups + group;  // tokens 4 col .. 4 col + 3 of the tile
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
      sm.transposed[d][col ^ transposed_swizzle<kDim>(d)] = dims[j];
    }
  }
}

// ---- codes_t ------------------------------------------------------------------------------------

constexpr int kGroup = kTransposedGroup;
constexpr uint32_t kBoundBits = 8, kBoundMask = 0xFF;

// A listed group's bytes, in group token indices j = 0..15 (token first + j of the tile): the tile
// writes tokens [lo, hi) and, when it holds the document's last token, the zero slots of j >= tail
// (tail = 16: none).
struct TransposedBounds {
  int lo, hi, tail;
  __device__ __forceinline__ static uint32_t pack(int lo, int hi, int tail) {
    return uint32_t(lo) | uint32_t(hi) << kBoundBits | uint32_t(tail) << (2 * kBoundBits);
  }
  __device__ __forceinline__ static TransposedBounds unpack(uint32_t b) {
    return {int(b & kBoundMask), int((b >> kBoundBits) & kBoundMask), int(b >> (2 * kBoundBits))};
  }
  // Every slot of the group is this tile's: one 16-byte store.
  __device__ __forceinline__ bool whole() const { return lo == 0 && (hi == kGroup || tail == hi); }
};
// A group of 16 tokens all in the tile (then first is in [0, tile - 16]).
constexpr uint32_t kFullGroupBounds = uint32_t(kGroup) << kBoundBits | uint32_t(kGroup)
                                                                           << (2 * kBoundBits);

// Stage E, threads 0 .. tile - 1 (whole warps): the groups of the tile into sm.tgroups, in any
// order (each group writes only its own slots), and the range of documents whose gaps the tile
// zeroes: those whose end offset cu[b + 1] is in (t0, t_end], and for the first tile those ending
// at 0 (leading empty documents), i.e. those whose last token, or token 0, is in the tile.
template <int kDim>
__device__ __noinline__ void list_transposed_groups(const KernelArgs& a, Smem<kDim>& sm, int t0,
                                                    int t_end) {
  const int i = threadIdx.x;
  const int t = t0 + i;
  bool head = false;
  int first = 0;
  uint32_t bounds = 0;
  int64_t pos = 0;
  if (t < t_end) {
    const int b = find_doc(a.cu_seqlens, a.num_docs, t);
    const int begin = __ldg(a.cu_seqlens + b), end = __ldg(a.cu_seqlens + b + 1);
    const int rel = (t - begin) & ~(kGroup - 1);
    const int g = begin + rel;  // the group's first token
    head = t == t0 || t == g;
    if (head) {
      first = g - t0;
      const int64_t g_end = int64_t(g) + kGroup;  // no int overflow near the int32 token limit
      const int hi = int(min(min(g_end, int64_t(end)), int64_t(t_end)) - g);
      const int tail = end <= t_end && end < g_end ? end - g : kGroup;
      bounds = TransposedBounds::pack(t - g, hi, tail);
      pos = transposed_doc_begin(begin, b) + rel;
    }
  }
  const unsigned heads = __ballot_sync(kFullMask, head);
  const int lane = i % kWarpLanes;
  int base = 0;
  if (lane == 0 && heads != 0) base = atomicAdd(&sm.num_tgroups, __popc(heads));
  base = __shfl_sync(kFullMask, base, 0);
  if (head) {
    const int slot = base + __popc(heads & ((1u << lane) - 1));
    sm.tgroups[slot] = {pos, first, bounds};
  }
  if (i == 0) sm.gap_doc_lo = t0 == 0 ? 0 : first_doc_ending_after(a.cu_seqlens, a.num_docs, t0);
  if (i == 1) sm.gap_doc_hi = first_doc_ending_after(a.cu_seqlens, a.num_docs, t_end);
}

// Bytes x .. 7 of a 64-bit half whose byte 0 is group token `base` (x relative to the group).
__device__ __forceinline__ uint64_t bytes_from(int x, int base) {
  const int k = x - base;
  return k <= 0 ? ~0ull : k >= 8 ? 0ull : ~0ull << (kBitsPerByte * k);
}

// Slot order (transposed_slot): tokens 0 1 8 9 | 2 3 10 11 | 4 5 12 13 | 6 7 14 15 of the group,
// from w[q] = tokens 4q .. 4q + 3.
__device__ __forceinline__ uint4 slot_order(const uint32_t (&w)[kQuadTokens]) {
  return make_uint4(
      __byte_perm(w[0], w[2], kPermLowHalves), __byte_perm(w[0], w[2], kPermHighHalves),
      __byte_perm(w[1], w[3], kPermLowHalves), __byte_perm(w[1], w[3], kPermHighHalves));
}

// Tokens first .. first + 15 of a row of the shared tile (logical word c at c ^ swizzle) start at
// byte first & 3 of word first >> 2 (floor: first >= -15).
__device__ __forceinline__ uint32_t byte_shift(int first) {
  constexpr uint32_t kIdentity = 0x3210, kShiftOne = 0x1111;
  return kIdentity + kShiftOne * uint32_t(first & (kBytesPerWord - 1));
}

// Stage S, a group at a tile edge or a document's last group (out of line: a few per tile and dim
// unless documents are short):
// words outside the tile read as 0, bytes of tokens outside [lo, hi) (other documents, other
// tiles) are cleared; one 16-byte store when the group is whole, else byte stores of the tile's
// tokens and, when the tile holds the document's end, of the zero tail.
template <int kDim>
__device__ __noinline__ void store_transposed_edge_group(const uint32_t* row, int swizzle,
                                                         int first, uint32_t packed_bounds,
                                                         uint8_t* dst) {
  using G = Geometry<kDim>;
  const TransposedBounds bounds = TransposedBounds::unpack(packed_bounds);
  const int word0 = first >> 2;
  uint32_t u[kQuadTokens + 1];
#pragma unroll
  for (int k = 0; k <= kQuadTokens; ++k) {
    const int col = word0 + k;
    u[k] = col >= 0 && col < G::kTileWords ? row[col ^ swizzle] : 0u;
  }
  const uint32_t shift = byte_shift(first);
  uint32_t w[kQuadTokens];
#pragma unroll
  for (int q = 0; q < kQuadTokens; ++q) w[q] = __byte_perm(u[q], u[q + 1], shift);
  constexpr int kHalfTokens = kGroup / 2;
  const uint64_t keep_lo = bytes_from(bounds.lo, 0) & ~bytes_from(bounds.hi, 0);
  const uint64_t keep_hi = bytes_from(bounds.lo, kHalfTokens) & ~bytes_from(bounds.hi, kHalfTokens);
  w[0] &= uint32_t(keep_lo);
  w[1] &= uint32_t(keep_lo >> 32);
  w[2] &= uint32_t(keep_hi);
  w[3] &= uint32_t(keep_hi >> 32);
  if (bounds.whole()) {
    *reinterpret_cast<uint4*>(dst) = slot_order(w);
    return;
  }
  constexpr uint32_t kAllTokens = (1u << kGroup) - 1;
  const uint32_t mine = (((1u << bounds.hi) - 1) & ~((1u << bounds.lo) - 1)) |
                        (kAllTokens & ~((1u << bounds.tail) - 1));
#pragma unroll
  for (int j = 0; j < kGroup; ++j)
    if (mine & (1u << j))
      dst[transposed_slot(j)] =
          uint8_t(w[j / kBytesPerWord] >> (kBitsPerByte * (j % kBytesPerWord)));
}

// Stage S: listed group `gi` of dim d. A group of 16 tokens inside the tile takes one 16-byte
// store: from one aligned vector of the shared tile when it starts at a multiple of 16 tokens
// (documents starting 16-aligned), else from five words.
template <int kDim>
__device__ __forceinline__ void store_transposed_group(const OperandArgs& op, const Smem<kDim>& sm,
                                                       int64_t tokens_t, int h, int d, int gi) {
  const auto group = sm.tgroups[gi];
  const int first = group.first;
  const int swizzle = transposed_swizzle<kDim>(d);
  const uint32_t* row = sm.transposed[d];
  uint8_t* dst = op.codes_t + (int64_t(h) * kDim + d) * tokens_t + group.pos;
  if (group.bounds != kFullGroupBounds) {
    store_transposed_edge_group<kDim>(row, swizzle, first, group.bounds, dst);
    return;
  }
  const int word0 = first >> 2;  // first is in [0, tile - 16]
  uint32_t w[kQuadTokens];
  if ((first & (kGroup - 1)) == 0) {
    // Logical word m of the aligned vector word0 / 4 sits at physical word m ^ (swizzle & 3) of
    // the aligned vector (word0 ^ (swizzle & ~3)) / 4.
    constexpr int kWordsPerVector = kVectorBytes / kBytesPerWord;
    uint4 v = *reinterpret_cast<const uint4*>(&row[word0 ^ (swizzle & ~(kWordsPerVector - 1))]);
    if (swizzle & 1) v = make_uint4(v.y, v.x, v.w, v.z);
    if (swizzle & 2) v = make_uint4(v.z, v.w, v.x, v.y);
    w[0] = v.x;
    w[1] = v.y;
    w[2] = v.z;
    w[3] = v.w;
  } else {
    // Word word0 + 4 is read only when first is not a multiple of 4 (it then holds token
    // first + 15 <= tile - 1), so every word read is inside the tile.
    uint32_t u[kQuadTokens + 1];
#pragma unroll
    for (int k = 0; k < kQuadTokens; ++k) u[k] = row[(word0 + k) ^ swizzle];
    u[kQuadTokens] = (first & (kBytesPerWord - 1)) != 0 ? row[(word0 + kQuadTokens) ^ swizzle] : 0u;
    const uint32_t shift = byte_shift(first);
#pragma unroll
    for (int q = 0; q < kQuadTokens; ++q) w[q] = __byte_perm(u[q], u[q + 1], shift);
  }
  *reinterpret_cast<uint4*>(dst) = slot_order(w);
}

// Stage S: the zero positions between the end of document b's last group and the next
// document's first position (0 or 16 of them), of dim d.
template <int kDim>
__device__ __forceinline__ void store_transposed_gap(const KernelArgs& a, const OperandArgs& op,
                                                     int h, int d, int b) {
  const int begin = __ldg(a.cu_seqlens + b), end = __ldg(a.cu_seqlens + b + 1);
  const int64_t from =
      transposed_doc_begin(begin, b) + (end - begin + kGroup - 1) / kGroup * kGroup;
  const int64_t to = transposed_doc_begin(end, b + 1);
  uint8_t* row = op.codes_t + (int64_t(h) * kDim + d) * a.tokens_t;
  for (int64_t p = from; p < to; p += kGroup)
    *reinterpret_cast<uint4*>(row + p) = make_uint4(0, 0, 0, 0);
}

// ---- the kernel -------------------------------------------------------------------------------

template <int kDim, bool kRotate>
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
  const int t0 = tile / op.heads * G::kTileTokens;
  const int t_end = int(min(int64_t(t0) + G::kTileTokens, a.tokens));
  const int c = threadIdx.x % kL;
  const int group = threadIdx.x / kL;
  if (threadIdx.x == 0) sm.num_tgroups = 0;  // read after stage P's barriers
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
  uint32_t any_bad = 0;
#pragma unroll
  for (int p = 0; p < G::kPasses; ++p)
#pragma unroll
    for (int r = 0; r < kQuadTokens; ++r) raw[p][r] = clean_chunk(raw[p][r], any_bad);
  if (any_bad != 0) {
    for (int p = 0; p < G::kPasses; ++p)
      for (int r = 0; r < kQuadTokens; ++r) {
        const int t = t0 + tile_token(p, r);
        if (t < t_end) report_non_finite<kDim>(op, a.non_finite + opi, t, h, c);
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

  // E: one exponent per token; codes_t's groups and gaps.
  if (threadIdx.x < G::kTileTokens) {
    token_exponents<kDim>(a, opi, sm, t0);
    if (op.codes_t != nullptr) list_transposed_groups<kDim>(a, sm, t0, t_end);
  }
  __syncthreads();

  // B: codes, NVFP4, transposed words.
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
    emit_pass<kDim>(op, sm, p, x, e, nv, h, t0, t_end, c, group);
  }
  __syncthreads();

  // S: codes_t's groups and gaps, then the exponent rows of the tile's span, padding included.
  if (op.codes_t != nullptr) {
    // Item idx = row * n + gi: group gi of dim row % kL * 8 + row / kL, so consecutive lanes take
    // consecutive groups of one dim, then dims whose swizzles differ. row = idx / n through a
    // float reciprocal: exact, as (idx + 1/2) / n is at least 1/(2n) >= 2^-9 away from an integer
    // and the float error is below 2^-16 (quotient < 2^8, two roundings).
    const int n = sm.num_tgroups;  // >= 1: the tile's first token starts a listed group
    const float inv_n = __frcp_rn(float(n));
    for (int idx = threadIdx.x; idx < n * kDim; idx += kThreads) {
      const int row = int(__fmul_rn(float(idx) + 0.5f, inv_n));
      const int gi = idx - row * n;
      store_transposed_group<kDim>(op, sm, a.tokens_t, h, (row % kL) * kChunkElems + row / kL, gi);
    }
    const int gap_lo = sm.gap_doc_lo;
    const int64_t gaps = int64_t(sm.gap_doc_hi - gap_lo) * kDim;
    for (int64_t idx = threadIdx.x; idx < gaps; idx += kThreads)
      store_transposed_gap<kDim>(a, op, h, int(idx % kDim), gap_lo + int(idx / kDim));
  }
  const int64_t tp = a.tokens_padded;
  const int span_chunks = int(min(int64_t(G::kTileTokens), tp - t0)) / kVectorBytes;
  if (int(threadIdx.x) < span_chunks) {
    const int k = threadIdx.x;
    *reinterpret_cast<uint4*>(op.exponents + h * tp + t0 + k * kVectorBytes) =
        *reinterpret_cast<const uint4*>(&sm.exps[k * kVectorBytes]);
    if (op.nv_packed != nullptr)
      *reinterpret_cast<uint4*>(op.nv_exponents + h * tp + t0 + k * kVectorBytes) =
          *reinterpret_cast<const uint4*>(&sm.nv_exps[k * kVectorBytes]);
  }
}

}  // namespace flamia::sm90::quant
