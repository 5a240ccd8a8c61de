// The fused quantizer's tile geometry and codes_t's index arithmetic (quantize_tile.cuh), in
// host-and-device functions: stages A, E and S of the kernel call them with warp ballots, the
// cu_seqlens reads and the global stores of the device, and a host program can call them with
// emulated lanes and recording stores to check every byte of codes_t on any layout.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "flamia/common.h"
#include "flamia/quantize.h"

namespace flamia::sm90::quant {

constexpr int kThreads = 256;
constexpr int kTileElems = 16384;  // per CTA: 32 KB of BF16 in, codes_t rows of 128 or 256 bytes
constexpr int kQuadTokens = 4;     // tokens per thread per pass: one word of codes_t
constexpr int kChunkElems = 8;     // BF16 elements per 16-byte load
constexpr int kVectorBytes = 16;
constexpr int kBytesPerWord = 4;
constexpr int kWarpLanes = 32;
constexpr int kBitsPerByte = 8;
constexpr int kBlockHalo = kBlockTokens - 1;  // rows a 32-token block reaches past a tile edge
constexpr unsigned kFullMask = 0xFFFFFFFFu;

FLAMIA_HD constexpr int tile_tokens(int dim) {
  return kTileElems / dim;
}

constexpr int kGroup = kTransposedGroup;

// Whether every tile of the quantizer is one document-relative key tile (kKeyTileTokens) whose
// span of codes_t is aligned (find_span below), so that it can write K's and V's tile codes from
// its own codes: head dim 128 (128-token tiles), every document starting at a multiple of
// kKeyTileTokens, no empty one before a non-empty one (an empty document at a tile's start would
// hold its first token), whole 16-token groups to the end. Host: cu_seqlens in host memory.
inline bool tiles_are_key_tiles(const int32_t* cu_seqlens, int num_docs, int64_t tokens, int dim) {
  if (tile_tokens(dim) != kKeyTileTokens || tokens % kGroup != 0) return false;
  bool empty_seen = false;
  for (int b = 0; b < num_docs; ++b) {
    if (cu_seqlens[b] % kKeyTileTokens != 0) return false;
    if (cu_seqlens[b + 1] == cu_seqlens[b]) {
      empty_seen = true;
    } else if (empty_seen) {
      return false;
    }
  }
  return true;
}

// ---- document tiles ----------------------------------------------------------------------------
//
// The packed tiling cuts tiles at multiples of the tile size in the packed buffer. The document
// tiling cuts each document from its own start instead: tile j of document b is tokens
// [cu[b] + j tile, min(cu[b] + (j + 1) tile, cu[b + 1])). Every tile then lies in one document,
// its codes_t span is aligned (find_span), block32's and vgroup16's groups need no halo, and at
// head dim 128 the tiles are the key tiles. Document b's tiles take the slots from
// document_slot_base(b) = floor(cu[b] / tile) + b on: consecutive bases differ by
// floor(cu[b + 1] / tile) - floor(cu[b] / tile) + 1 >= floor(L_b / tile) + 1 >= ceil(L_b / tile),
// the document's tile count, and by at most one more, so document_slot_count slots hold every
// tile, with at most one idle slot per document.
FLAMIA_HD int64_t document_slot_base(int64_t doc_begin, int doc, int tile) {
  return doc_begin / tile + doc;
}
FLAMIA_HD int64_t document_slot_count(int64_t tokens, int num_docs, int tile) {
  return document_slot_base(tokens, num_docs, tile);
}

struct TileRange {
  int32_t t0, t_end;  // t0 < 0: an idle slot
};

// The kernel's two tilings, each its own instantiation: the packed one's code stays as it was
// before the document tiling existed (the quantizer's schedule moves with any change there).
enum class Tiles { kPacked, kDocument };

// The tile of a slot: its document is the last whose base is at or before it (the bases strictly
// increase; a binary search reading `cu(b)` = cu_seqlens[b]).
template <typename Cu>
FLAMIA_HD TileRange document_tile(const Cu& cu, int num_docs, int tile, int64_t slot) {
  int lo = 0, hi = num_docs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (document_slot_base(cu(mid), mid, tile) <= slot) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t begin = cu(lo), end = cu(lo + 1);
  const int64_t t0 = begin + (slot - document_slot_base(begin, lo, tile)) * tile;
  if (t0 >= end) return {-1, -1};
  return {int32_t(t0), int32_t(std::min<int64_t>(t0 + tile, end))};
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
  static constexpr int kTileChunks = kTileTokens / kGroup;  // codes_t chunks of a whole group
  // codes_t chunks of a tile's span when no document is empty (TransposedSpan): the span is at
  // most tile + 15 x (documents ending in the tile) + 45 positions, and at most `tile` documents
  // end in it, so it is at most 16 tile + 32 positions.
  static constexpr int kSpanChunks = kTileTokens + 2;
  static_assert(kPasses >= 1 && kTileTokens % kTokensPerPass == 0, "tile must be whole passes");
  static_assert(kTileWords % kWarpLanes == 0, "the swizzle spreads one warp over 32 banks");
  static_assert(kTileTokens <= kThreads, "one thread per token in stage E");
  static_assert(kTileTokens % kGroup == 0, "tiles are whole groups in the packed buffer");
};

// Word column of codes_t's shared tile: the logical column XOR a per-chunk swizzle, so the 32
// lanes of a warp (kGroupsPerWarp row groups x kLanesPerRow chunks) write 32 different banks.
template <int kDim>
FLAMIA_HD int transposed_swizzle(int d) {
  return (d / kChunkElems) * Geometry<kDim>::kGroupsPerWarp;
}

// Byte permutes that transpose a 4 x 4 byte block held as 4 words (token-major to dim-major).
constexpr uint32_t kPermInterleaveLow = 0x5140;   // a0 b0 a1 b1
constexpr uint32_t kPermInterleaveHigh = 0x7362;  // a2 b2 a3 b3
constexpr uint32_t kPermLowHalves = 0x5410;       // a0 a1 b0 b1 (16-bit halves)
constexpr uint32_t kPermHighHalves = 0x7632;      // a2 a3 b2 b3

// __byte_perm (default mode: byte i of the result is byte s_i of b:a, s_i = selector nibble i).
FLAMIA_HD uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, selector);
#else
  constexpr uint32_t kNibbleMask = 0x7, kByteMask = 0xFF;
  const uint64_t x = uint64_t(b) << 32 | a;
  uint32_t r = 0;
  for (int i = 0; i < kBytesPerWord; ++i)
    r |= uint32_t(x >> (kBitsPerByte * ((selector >> (4 * i)) & kNibbleMask)) & kByteMask)
         << (kBitsPerByte * i);
  return r;
#endif
}

// ---- codes_t: a tile's span -------------------------------------------------------------------
//
// codes_t's positions (flamia/quantize.h) are monotone in the token order at the granularity of
// the document-relative 16-token groups, every document starts 16-aligned, so every 16-aligned
// run of 16 positions (a chunk) is one group of one document (its tokens in slot order, zeros
// past the document's end) or 16 zero positions of a gap. A tile [t0, t_end) owns the positions
// of its tokens, the zero tail of the last group of each document ending in it, and the gaps
// after the documents ending in (t0, t_end] (tile 0: also those of the empty documents at 0);
// these are the chunks of the span [pos, pos + 16 chunks), all whole but the first when a group
// straddles t0 (the previous tile writes its tokens before t0) and the last when one straddles
// t_end. Neighbouring spans share only such a chunk: the span of a tile ends at the position of
// t_end's document plus round_up(t_end - its begin, 16), the next one starts at the same place
// rounded down.
struct TransposedSpan {
  int64_t pos;  // codes_t position of chunk 0, a multiple of kGroup
  int chunks;   // 16-position chunks of the span
  int doc_lo;   // documents with positions in the span: [doc_lo, doc_hi]
  int doc_hi;
  int first_shared;  // 1: chunk 0 straddles t0, the tile writes its tokens from t0 on
  int last_shared;   // 1: the last chunk straddles t_end, the tile writes those before it
  int aligned;       // 1: the tile's tokens are 16-aligned groups of one document (whole; under
                     // the document tiling the last may end with the document): chunk k <
                     // ceil((t_end - t0) / 16) is tile tokens 16k .. 16k + 15, the chunks after
                     // them are gaps (the document ends at t_end)
};

// Offsets cu[doc_lo + i], i < kWindowDocs, staged in shared memory by stage A.
constexpr int kWindowDocs = kWarpLanes;

// The number of documents ending at or before x (cu[b + 1] <= x), known to be in [lo, hi]; for x
// < tokens, the document holding x. A warp-wide search: each round reads kWarpLanes offsets and
// narrows the range 32-fold, so one round covers 32 documents and four cover 2^20; no read when
// lo == hi (one document). `lanes.count(f)` counts the lanes l with f(l); `cu(b)` reads cu[b].
template <typename Lanes, typename Cu>
FLAMIA_HD int docs_ending_by(const Lanes& lanes, const Cu& cu, int lo, int hi, int64_t x) {
  while (lo < hi) {
    const int step = (hi - lo + kWarpLanes - 1) / kWarpLanes;
    // Lane l tests whether the answer is at least lo + (l + 1) step; the true lanes come first.
    const int k = lanes.count([&](int lane) {
      const int j = lo + (lane + 1) * step;
      return j <= hi && cu(j) <= x;
    });
    lo += k * step;
    hi = std::min(hi, lo + step - 1);
  }
  return lo;
}

// Stage A, one warp: the tile's span, and the window cu[doc_lo ..] into `window` (every lane
// returns the same span). At most two searches of cu_seqlens, each no read for one document.
// `lanes.each(f)` runs f(l) for every lane l, `lanes.sync()` makes the lanes' writes visible.
template <Tiles kTiles, typename Lanes, typename Cu>
FLAMIA_HD TransposedSpan find_span(const Lanes& lanes, const Cu& cu, int32_t* window, int num_docs,
                                   int tokens, int64_t tokens_t, int t0, int t_end) {
  TransposedSpan s{};
  // The document holding t0 (its begin <= t0 < its end); tile 0 starts at document 0 to own the
  // gaps of leading empty documents.
  s.doc_lo = t0 == 0 ? 0 : docs_ending_by(lanes, cu, 0, num_docs - 1, t0);
  lanes.each([&](int lane) {
    const int b = s.doc_lo + lane;
    window[lane] = b <= num_docs ? cu(b) : tokens;
  });
  lanes.sync();
  auto at = [&](int b) { return b - s.doc_lo < kWindowDocs ? window[b - s.doc_lo] : cu(b); };
  const int begin_lo = at(s.doc_lo);
  int64_t end;
  if (t_end == tokens) {  // the last tile owns everything to the end, trailing empty documents
    s.doc_hi = num_docs - 1;
    end = int64_t(tokens_t);
  } else {
    // The document holding t_end: doc_lo plus those ending at or before t_end, counted in the
    // window, then searched past it when all of the window's do.
    const int k = lanes.count([&](int lane) { return lane > 0 && window[lane] <= t_end; });
    s.doc_hi = s.doc_lo + k;
    if (k == kWindowDocs - 1) s.doc_hi = docs_ending_by(lanes, cu, s.doc_hi, num_docs - 1, t_end);
    const int begin_hi = at(s.doc_hi);
    end = transposed_doc_begin(begin_hi, s.doc_hi) +
          (t_end - begin_hi + kGroup - 1) / kGroup * kGroup;
    s.last_shared = (t_end - begin_hi) % kGroup != 0;
  }
  s.pos =
      t0 == 0 ? 0 : transposed_doc_begin(begin_lo, s.doc_lo) + (t0 - begin_lo) / kGroup * kGroup;
  s.chunks = int((end - s.pos) / kGroup);
  s.first_shared = (t0 - begin_lo) % kGroup != 0;
  if constexpr (kTiles == Tiles::kDocument) {
    // One document's tokens in whole groups, the last one partial only where the document ends
    // (the shared tile holds code 0 past t_end). Not tile 0 after leading empty documents.
    s.aligned =
        !s.first_shared && window[1] >= t_end && ((t_end - t0) % kGroup == 0 || window[1] == t_end);
  } else {
    s.aligned = !s.first_shared && (t_end - t0) % kGroup == 0 && window[1] >= t_end;
  }
  return s;
}

// A chunk's bytes: tile tokens first + j for j in [lo, hi), in slot order; the other slots are
// zero (a document's tail, a gap: lo == hi == 0) or another tile's.
struct ChunkRecord {
  int first, lo, hi;
};
constexpr int kRecordFieldBits = 8;
constexpr uint32_t kRecordFieldMask = 0xFF, kRecordFirstMask = 0xFFFF;

FLAMIA_HD uint32_t pack_record(int first, int lo, int hi) {
  // first + kGroup is in [1, tile + 16): 16 bits.
  return uint32_t(first + kGroup) | uint32_t(lo) << (2 * kRecordFieldBits) |
         uint32_t(hi) << (3 * kRecordFieldBits);
}
FLAMIA_HD ChunkRecord unpack_record(uint32_t r) {
  return {int(r & kRecordFirstMask) - kGroup, int((r >> (2 * kRecordFieldBits)) & kRecordFieldMask),
          int(r >> (3 * kRecordFieldBits))};
}

// Stage E: the record of chunk c of the span. Its document is the last one of the span's whose
// first position is at or before the chunk's (a search over the window, none for one document);
// `at(b)` reads cu[b] for b in [doc_lo, doc_hi + 1].
template <typename Cu>
FLAMIA_HD uint32_t chunk_record(const TransposedSpan& s, const Cu& at, int t0, int t_end, int c) {
  const int64_t p = s.pos + int64_t(c) * kGroup;
  int lo = s.doc_lo, hi = s.doc_hi;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (transposed_doc_begin(at(mid), mid) <= p) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int begin = at(lo), end = at(lo + 1);
  const int64_t offset = p - transposed_doc_begin(begin, lo);
  if (offset >= end - begin) return pack_record(0, 0, 0);  // a gap
  const int g = begin + int(offset);                       // the group's first token
  return pack_record(g - t0, std::max(0, t0 - g), std::min(int(kGroup), std::min(end, t_end) - g));
}

// Stage E: records of chunks [base, base + kSpanChunks) of the span into table[0, ..). Item
// c goes to thread (c - tile) mod kThreads: with 128-token tiles the threads that compute no
// exponent take the first chunks.
template <int kDim, typename Cu>
FLAMIA_HD void build_chunk_table(const TransposedSpan& s, const Cu& at, int t0, int t_end, int base,
                                 int thread, uint32_t* table) {
  using G = Geometry<kDim>;
  const int count = std::min(s.chunks - base, int(G::kSpanChunks));
  for (int c = (thread + kThreads - G::kTileTokens) % kThreads; c < count; c += kThreads)
    table[c] = chunk_record(s, at, t0, t_end, base + c);
}

// ---- codes_t: chunk bytes ---------------------------------------------------------------------

// Bytes x .. 7 of a 64-bit half whose byte 0 is group token `base` (x relative to the group).
FLAMIA_HD uint64_t bytes_from(int x, int base) {
  const int k = x - base;
  return k <= 0 ? ~0ull : k >= 8 ? 0ull : ~0ull << (kBitsPerByte * k);
}

// Slot order (transposed_slot): tokens 0 1 8 9 | 2 3 10 11 | 4 5 12 13 | 6 7 14 15 of the group,
// from w[q] = tokens 4q .. 4q + 3.
FLAMIA_HD uint4 slot_order(const uint32_t (&w)[kQuadTokens]) {
  return make_uint4(byte_perm(w[0], w[2], kPermLowHalves), byte_perm(w[0], w[2], kPermHighHalves),
                    byte_perm(w[1], w[3], kPermLowHalves), byte_perm(w[1], w[3], kPermHighHalves));
}

// Tokens first .. first + 15 of a row of the shared tile (logical word c at c ^ swizzle) start at
// byte first & 3 of word first >> 2 (floor: first >= -15).
FLAMIA_HD uint32_t byte_shift(int first) {
  constexpr uint32_t kIdentity = 0x3210, kShiftOne = 0x1111;
  return kIdentity + kShiftOne * uint32_t(first & (kBytesPerWord - 1));
}

// Chunk k of a row of the shared tile when the chunk is tile tokens 16k .. 16k + 15: one aligned
// vector. Logical word m of the aligned vector k sits at physical word m ^ (swizzle & 3) of the
// aligned vector (4k ^ (swizzle & ~3)) / 4.
template <int kDim>
FLAMIA_HD uint4 aligned_chunk(const uint32_t* row, int swizzle, int k) {
  constexpr int kWordsPerVector = kVectorBytes / kBytesPerWord;
  uint4 v = *reinterpret_cast<const uint4*>(
      &row[(k * kWordsPerVector) ^ (swizzle & ~(kWordsPerVector - 1))]);
  if (swizzle & 1) v = make_uint4(v.y, v.x, v.w, v.z);
  if (swizzle & 2) v = make_uint4(v.z, v.w, v.x, v.y);
  const uint32_t w[kQuadTokens] = {v.x, v.y, v.z, v.w};
  return slot_order(w);
}

// A chunk of a row of the shared tile from its record: five words from word first >> 2, byte-
// shifted to token first, tokens outside [lo, hi) cleared, in slot order. Columns outside the
// tile (first < 0, or a group past the tile's last token) are clamped into the row: their bytes
// are cleared anyway.
template <int kDim>
FLAMIA_HD uint4 gathered_chunk(const uint32_t* row, int swizzle, ChunkRecord r) {
  constexpr unsigned kLastWord = Geometry<kDim>::kTileWords - 1;
  const int word0 = r.first >> 2;
  uint32_t u[kQuadTokens + 1];
#pragma unroll
  for (int k = 0; k <= kQuadTokens; ++k)
    u[k] = row[std::min(unsigned(word0 + k), kLastWord) ^ swizzle];
  const uint32_t shift = byte_shift(r.first);
  uint32_t w[kQuadTokens];
#pragma unroll
  for (int q = 0; q < kQuadTokens; ++q) w[q] = byte_perm(u[q], u[q + 1], shift);
  if (r.lo != 0 || r.hi != kGroup) {
    constexpr int kHalfTokens = kGroup / 2;
    const uint64_t keep_lo = bytes_from(r.lo, 0) & ~bytes_from(r.hi, 0);
    const uint64_t keep_hi = bytes_from(r.lo, kHalfTokens) & ~bytes_from(r.hi, kHalfTokens);
    w[0] &= uint32_t(keep_lo);
    w[1] &= uint32_t(keep_lo >> 32);
    w[2] &= uint32_t(keep_hi);
    w[3] &= uint32_t(keep_hi >> 32);
  }
  return slot_order(w);
}

// Two slots of tokens 2q, 2q + 1 (or 2q + 8, 2q + 9) in the low 16 bits of `pair`, at `p`:
// `which` bit i set writes the slot of the pair's token i.
template <typename Rows>
FLAMIA_HD void store_pair(Rows& rows, int d, int64_t p, uint32_t pair, uint32_t which) {
  constexpr uint32_t kBoth = 3, kFirst = 1;
  if (which == kBoth) {
    rows.store2(d, p, uint16_t(pair));
  } else if (which == kFirst) {
    rows.store1(d, p, uint8_t(pair));
  } else if (which != 0) {
    rows.store1(d, p + 1, uint8_t(pair >> kBitsPerByte));
  }
}

// The slots of tokens [lo, hi) of a chunk in slot order at position p: a word where all four
// of its slots are written (word q holds tokens 2q, 2q + 1, 2q + 8, 2q + 9), else 16-bit halves
// or bytes. A shared chunk is [lo, 16) or [0, hi): at most five stores.
template <typename Rows>
FLAMIA_HD void store_tokens(Rows& rows, int d, int64_t p, const uint4& v, int lo, int hi) {
  constexpr uint32_t kPair = 3, kAll = 0xF;
  constexpr int kHighPair = kGroup / 2;
  const uint32_t mine = ((1u << hi) - 1) & ~((1u << lo) - 1);
  const uint32_t words[kQuadTokens] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < kQuadTokens; ++q) {
    const uint32_t low = (mine >> (2 * q)) & kPair, high = (mine >> (2 * q + kHighPair)) & kPair;
    const int64_t at = p + q * kBytesPerWord;
    if ((low | high << 2) == kAll) {
      rows.store4(d, at, words[q]);
    } else {
      store_pair(rows, d, at, words[q], low);
      store_pair(rows, d, at + 2, words[q] >> (2 * kBitsPerByte), high);
    }
  }
}

// ---- codes_t: stage S ---------------------------------------------------------------------------

// row = idx / n for idx < 2^16 and n < 2^9 through a float reciprocal: exact, as (idx + 1/2) / n
// is at least 1/(2n) >= 2^-10 away from an integer and the float error is below 2^-15 (quotient
// < 2^8, two roundings).
FLAMIA_HD float item_reciprocal(int n) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(float(n));
#else
  return 1.0f / float(n);
#endif
}
FLAMIA_HD int item_row(int idx, float inv_n) {
#if defined(__CUDA_ARCH__)
  return int(__fmul_rn(float(idx) + 0.5f, inv_n));
#else
  return int((float(idx) + 0.5f) * inv_n);
#endif
}

// Row `row` of an item loop is dim (row % kL) * 8 + row / kL: consecutive lanes take consecutive
// chunks of one dim (contiguous stores), then dims whose swizzles differ. The word reads of a
// chunk sequence share their residue mod 4, which the swizzle (even) changes in one bit only, so a
// warp's read touches at most 16 banks: 2 to 3 wavefronts (4 for the aligned path's vectors).
template <int kDim>
FLAMIA_HD int item_dim(int row) {
  constexpr int kL = Geometry<kDim>::kLanesPerRow;
  return (row % kL) * kChunkElems + row / kL;
}

// Stage S, an aligned span: one 16-byte copy per group and dim, as before documents had their
// own positions, then zeros for the gaps after a document ending at t_end. Consecutive lanes take
// consecutive chunks of a dim: one warp stores four rows of the tile. `tile[d]` is dim d's row of
// the shared tile; rows.storeN(d, p, x) writes N bytes at position p of codes_t's row of dim d.
template <int kDim, Tiles kTiles, typename Rows>
FLAMIA_HD void store_aligned_span(const TransposedSpan& s,
                                  const uint32_t (*tile)[Geometry<kDim>::kTileWords],
                                  int tile_tokens, int thread, Rows& rows) {
  constexpr int kChunks = Geometry<kDim>::kTileChunks;
  // kChunks but in a short tile; a partial last group under the document tiling only.
  const int groups =
      kTiles == Tiles::kDocument ? (tile_tokens + kGroup - 1) / kGroup : tile_tokens / kGroup;
  for (int idx = thread; idx < kDim * kChunks; idx += kThreads) {
    const int d = idx / kChunks, k = idx % kChunks;
    if (k < groups)
      rows.store16(d, s.pos + k * kGroup,
                   aligned_chunk<kDim>(tile[d], transposed_swizzle<kDim>(d), k));
  }
  const int gaps = s.chunks - groups;
  for (int idx = thread; idx < gaps * kDim; idx += kThreads)
    rows.store16(idx % kDim, s.pos + int64_t(groups + idx / kDim) * kGroup, make_uint4(0, 0, 0, 0));
}

// Stage S, chunks [base, base + kSpanChunks) of a span with their records in table[0, ..): the
// whole chunks as 16-byte stores, then the shared ones (chunk 0 and the last) as narrow stores of
// the tile's tokens only.
template <int kDim, typename Rows>
FLAMIA_HD void store_span_chunks(const TransposedSpan& s, const uint32_t* table,
                                 const uint32_t (*tile)[Geometry<kDim>::kTileWords], int base,
                                 int thread, Rows& rows) {
  using G = Geometry<kDim>;
  const int count = std::min(s.chunks - base, int(G::kSpanChunks));
  const int c_lo = std::max(base, s.first_shared);
  const int c_hi = std::min(base + count, s.chunks - s.last_shared);
  if (c_hi > c_lo) {
    const int n = c_hi - c_lo;
    const float inv_n = item_reciprocal(n);
    for (int idx = thread; idx < n * kDim; idx += kThreads) {
      const int row = item_row(idx, inv_n);
      const int c = c_lo + idx - row * n;
      const int d = item_dim<kDim>(row);
      const uint4 v = gathered_chunk<kDim>(tile[d], transposed_swizzle<kDim>(d),
                                           unpack_record(table[c - base]));
      rows.store16(d, s.pos + int64_t(c) * kGroup, v);
    }
  }
  const bool first = s.first_shared && base == 0;
  const bool last = s.last_shared && s.chunks - 1 < base + count;
  const int ends = int(first) + int(last);
  for (int idx = thread; idx < ends * kDim; idx += kThreads) {
    const int d = item_dim<kDim>(idx / ends);
    const bool is_first = first && idx % ends == 0;
    const int c = is_first ? 0 : s.chunks - 1;
    const ChunkRecord r = unpack_record(table[c - base]);
    const uint4 v = gathered_chunk<kDim>(tile[d], transposed_swizzle<kDim>(d), r);
    // The first chunk's tokens before lo are the previous tile's; the last one's from hi on are
    // the next tile's (its document goes on past t_end, so it has no zero tail here).
    store_tokens(rows, d, s.pos + int64_t(c) * kGroup, v, is_first ? r.lo : 0,
                 is_first ? kGroup : r.hi);
  }
}

}  // namespace flamia::sm90::quant
