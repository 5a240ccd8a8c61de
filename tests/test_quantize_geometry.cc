// Host simulation of the GPU quantizer's codes_t stores (src/kernels/sm90/quantize_geometry.h):
// stages A, E and S of every tile run here as the kernel runs them, with the 32 lanes of warp 0
// and the 256 threads of a CTA emulated one after the other and codes_t's stores recorded, for the
// packed and the document tiling. On layouts with unaligned documents, runs of empty documents and
// documents ending at and across tile edges, every codes_t byte must be written exactly once, by
// naturally aligned stores inside the row, and equal flamia/quantize.h's definition. No GPU
// needed: it checks the index arithmetic; GpuQuantize.TransposedLayoutOnUnalignedAndEmptyDocuments
// and GpuQuantize.DocumentTilingWritesThePackedTilingsBytes check the device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "edge_layouts.h"
#include "flamia/packed.h"
#include "flamia/quantize.h"
#include "quantize_geometry.h"

namespace flamia::sm90::quant {
namespace {

// Warp 0's lanes one after the other: a ballot counts the lanes whose predicate holds.
struct SerialLanes {
  template <typename F>
  int count(F f) const {
    int n = 0;
    for (int lane = 0; lane < kWarpLanes; ++lane) n += f(lane) ? 1 : 0;
    return n;
  }
  template <typename F>
  void each(F f) const {
    for (int lane = 0; lane < kWarpLanes; ++lane) f(lane);
  }
  void sync() const {}
};

// What the simulation saw, over every tile of a layout.
struct Tally {
  int64_t bad_reads = 0;   // cu_seqlens indices outside [0, num_docs]
  int64_t bad_stores = 0;  // misaligned or outside the row
  std::string first_bad_store;
  int aligned_tiles = 0, gathered_tiles = 0, batched_tiles = 0;  // the paths taken
  int gathered_past_start = 0;                                   // gathered tiles other than tile 0
};

// cu_seqlens reads, checked against its num_docs + 1 entries.
struct CheckedOffsets {
  const std::vector<int32_t>* cu;
  Tally* tally;
  int operator()(int b) const {
    if (b < 0 || b >= int(cu->size())) {
      ++tally->bad_reads;
      return 0;
    }
    return (*cu)[size_t(b)];
  }
};

// One operand's codes_t [H][D][Tt] and a write count per byte; storeN(d, p, x) is the kernel's
// N-byte store at position p of dim d's row of head `head`.
struct RecordingRows {
  std::vector<uint8_t>* bytes;
  std::vector<int>* writes;
  Tally* tally;
  int64_t tokens_t = 0;
  int dim = 0, head = 0;

  void store(int d, int64_t p, uint64_t lo, uint64_t hi, int n) {
    if (p < 0 || p + n > tokens_t || p % n != 0 || d < 0 || d >= dim) {
      if (tally->bad_stores++ == 0) {
        std::ostringstream os;
        os << n << "-byte store at head " << head << ", dim " << d << ", position " << p
           << " (row of " << tokens_t << ")";
        tally->first_bad_store = os.str();
      }
      return;
    }
    const int64_t row = (int64_t(head) * dim + d) * tokens_t + p;
    for (int i = 0; i < n; ++i) {
      const uint64_t half = i < 8 ? lo : hi;
      (*bytes)[size_t(row + i)] = uint8_t(half >> (kBitsPerByte * (i % 8)));
      ++(*writes)[size_t(row + i)];
    }
  }
  void store16(int d, int64_t p, const uint4& v) {
    store(d, p, uint64_t(v.y) << 32 | v.x, uint64_t(v.w) << 32 | v.z, kVectorBytes);
  }
  void store4(int d, int64_t p, uint32_t v) { store(d, p, v, 0, 4); }
  void store2(int d, int64_t p, uint16_t v) { store(d, p, v, 0, 2); }
  void store1(int d, int64_t p, uint8_t v) { store(d, p, v, 0, 1); }
};

// A distinct non-zero code per (token, head, dim): a misplaced token or a missing zero shows.
uint8_t token_code(int64_t t, int h, int d) {
  constexpr int kCodes = 255;
  return uint8_t(1 + (t * 37 + h * 101 + d * 11) % kCodes);
}

// codes_t by its definition (quantize.h): each token's code at its document's start plus its
// slot, zero elsewhere.
std::vector<uint8_t> expected_codes_t(const std::vector<int32_t>& cu, int heads, int dim,
                                      int64_t tokens_t) {
  std::vector<uint8_t> want(size_t(int64_t(heads) * dim * tokens_t), 0);
  for (int b = 0; b + 1 < int(cu.size()); ++b)
    for (int64_t t = cu[b]; t < cu[b + 1]; ++t) {
      const int64_t pos = transposed_doc_begin(cu[b], b) + transposed_slot(int(t - cu[b]));
      for (int h = 0; h < heads; ++h)
        for (int d = 0; d < dim; ++d)
          want[size_t((int64_t(h) * dim + d) * tokens_t + pos)] = token_code(t, h, d);
    }
  return want;
}

// One tile (head h, tokens [t0, t_end)) as the kernel runs it: stage B's swizzled shared tile
// (word c of a row holds tile tokens 4c .. 4c + 3; code 0 past t_end, as the kernel's rows past the
// tile are zeros), stage A's span, stage E's records and stage S's stores, thread by thread.
template <int kDim, Tiles kTiles>
void simulate_tile(const std::vector<int32_t>& cu, int h, int t0, int t_end, int64_t tokens_t,
                   RecordingRows& rows, Tally& tally) {
  using G = Geometry<kDim>;
  const int num_docs = int(cu.size()) - 1, tokens = cu.back();
  constexpr uint8_t kPastTile = 0;
  alignas(kVectorBytes) static uint32_t tile[kDim][G::kTileWords];
  for (int d = 0; d < kDim; ++d)
    for (int c = 0; c < G::kTileWords; ++c) {
      uint32_t w = 0;
      for (int r = 0; r < kQuadTokens; ++r) {
        const int t = t0 + kQuadTokens * c + r;
        w |= uint32_t(t < t_end ? token_code(t, h, d) : kPastTile) << (kBitsPerByte * r);
      }
      tile[d][c ^ transposed_swizzle<kDim>(d)] = w;
    }

  const CheckedOffsets global{&cu, &tally};
  int32_t window[kWindowDocs];
  const TransposedSpan s =
      find_span<kTiles>(SerialLanes{}, global, window, num_docs, tokens, tokens_t, t0, t_end);
  if (s.aligned) {
    ++tally.aligned_tiles;
    for (int thread = 0; thread < kThreads; ++thread)
      store_aligned_span<kDim, kTiles>(s, tile, t_end - t0, thread, rows);
    return;
  }
  ++tally.gathered_tiles;
  if (t0 > 0) ++tally.gathered_past_start;
  if (s.chunks > G::kSpanChunks) ++tally.batched_tiles;
  auto at = [&](int b) {
    const int i = b - s.doc_lo;
    return i < kWindowDocs ? window[i] : global(b);
  };
  // Records never built for a batch read as an impossible chunk (first far past the tile).
  constexpr uint32_t kUnbuilt = 0xFFFFFFFFu;
  std::vector<uint32_t> table(G::kSpanChunks);
  int base = 0;
  do {  // stage E builds batch 0; stage S stores each batch, then builds the next
    std::fill(table.begin(), table.end(), kUnbuilt);
    for (int thread = 0; thread < kThreads; ++thread)
      build_chunk_table<kDim>(s, at, t0, t_end, base, thread, table.data());
    for (int thread = 0; thread < kThreads; ++thread)
      store_span_chunks<kDim>(s, table.data(), tile, base, thread, rows);
    base += G::kSpanChunks;
  } while (base < s.chunks);
}

// The tiles [t0, t_end) of a layout: packed, or the document tiling's (idle slots skipped), whose
// slots must each hold at most one tile and together every token once.
template <int kDim>
std::vector<TileRange> layout_tiles(const std::vector<int32_t>& cu, bool document_tiling) {
  using G = Geometry<kDim>;
  const int num_docs = int(cu.size()) - 1, tokens = cu.back();
  std::vector<TileRange> tiles;
  if (!document_tiling) {
    for (int t0 = 0; t0 < tokens; t0 += G::kTileTokens)
      tiles.push_back({t0, std::min(t0 + G::kTileTokens, tokens)});
    return tiles;
  }
  auto at = [&](int b) { return cu[size_t(b)]; };
  const int64_t slots = document_slot_count(tokens, num_docs, G::kTileTokens);
  std::vector<int> covered(size_t(tokens), 0);
  for (int64_t slot = 0; slot < slots; ++slot) {
    const TileRange r = document_tile(at, num_docs, G::kTileTokens, slot);
    if (r.t0 < 0) continue;
    tiles.push_back(r);
    // Inside one document, from its start in whole tiles.
    const int b = int(std::upper_bound(cu.begin(), cu.end(), r.t0) - cu.begin()) - 1;
    EXPECT_EQ((r.t0 - cu[size_t(b)]) % G::kTileTokens, 0) << "slot " << slot;
    EXPECT_TRUE(r.t_end == std::min(r.t0 + G::kTileTokens, cu[size_t(b) + 1])) << "slot " << slot;
    for (int t = r.t0; t < r.t_end; ++t) ++covered[size_t(t)];
  }
  EXPECT_EQ(std::count(covered.begin(), covered.end(), 1), tokens) << "tokens in one tile each";
  EXPECT_LE(slots, tokens / G::kTileTokens + num_docs);
  return tiles;
}

// Every tile of every head of one operand with `heads` heads; checks codes_t and returns what
// the tiles did.
template <int kDim>
Tally simulate_layout(const std::vector<int64_t>& lengths, int heads, bool document_tiling) {
  const std::vector<int32_t> cu = cu_seqlens_from_lengths(lengths);
  const int num_docs = int(lengths.size()), tokens = cu.back();
  const int64_t tokens_t = transposed_tokens(tokens, num_docs);
  std::vector<uint8_t> got(size_t(int64_t(heads) * kDim * tokens_t), 0);
  std::vector<int> writes(got.size(), 0);
  Tally tally;
  const std::vector<TileRange> tiles = layout_tiles<kDim>(cu, document_tiling);
  for (int h = 0; h < heads; ++h) {
    RecordingRows rows{&got, &writes, &tally, tokens_t, kDim, h};
    for (const TileRange& t : tiles) {
      if (document_tiling) {
        simulate_tile<kDim, Tiles::kDocument>(cu, h, t.t0, t.t_end, tokens_t, rows, tally);
      } else {
        simulate_tile<kDim, Tiles::kPacked>(cu, h, t.t0, t.t_end, tokens_t, rows, tally);
      }
    }
  }
  EXPECT_EQ(tally.bad_reads, 0) << "cu_seqlens read outside its " << num_docs + 1 << " entries";
  EXPECT_EQ(tally.bad_stores, 0) << "first: " << tally.first_bad_store;
  const std::vector<uint8_t> want = expected_codes_t(cu, heads, kDim, tokens_t);
  size_t unwritten = 0, rewritten = 0, wrong = 0, first_wrong = got.size();
  for (size_t i = 0; i < got.size(); ++i) {
    unwritten += writes[i] == 0;
    rewritten += writes[i] > 1;
    if (got[i] != want[i] && wrong++ == 0) first_wrong = i;
  }
  EXPECT_EQ(unwritten, 0u) << "of " << got.size() << " bytes";
  EXPECT_EQ(rewritten, 0u) << "of " << got.size() << " bytes";
  EXPECT_EQ(wrong, 0u) << "of " << got.size() << " bytes; first at head "
                       << int64_t(first_wrong) / (kDim * tokens_t) << ", dim "
                       << int64_t(first_wrong) / tokens_t % kDim << ", position "
                       << int64_t(first_wrong) % tokens_t;
  return tally;
}

std::string describe(const std::vector<int64_t>& lengths) {
  std::string s;
  for (size_t i = 0; i < lengths.size() && i < 40; ++i) s += std::to_string(lengths[i]) + ",";
  return lengths.size() > 40 ? s + "... (" + std::to_string(lengths.size()) + " documents)" : s;
}

// GpuQuantize.TransposedLayoutOnUnalignedAndEmptyDocuments' layouts and the bit tests' documents,
// plus runs of empty documents long enough for several record batches and window searches.
std::vector<std::vector<int64_t>> edge_layouts() {
  std::vector<std::vector<int64_t>> layouts = testlayouts::unaligned_and_empty_documents();
  layouts.insert(
      layouts.end(),
      {{5, 0, 1, 31, 32, 33, 127, 0, 129, 77, 300}, {4096}, {256, 32, 480, 16, 16, 1024}});
  std::vector<int64_t> runs = {3};
  runs.insert(runs.end(), 200, 0);
  runs.push_back(5);
  runs.insert(runs.end(), 300, 0);
  runs.push_back(250);
  layouts.push_back(runs);
  std::vector<int64_t> leading(500, 0);
  leading.push_back(1);
  layouts.push_back(leading);
  std::vector<int64_t> trailing = {1};
  trailing.insert(trailing.end(), 500, 0);
  layouts.push_back(trailing);
  return layouts;
}

// Random layouts: documents of 0..300 tokens, a quarter empty, some in runs of up to 40.
std::vector<std::vector<int64_t>> random_layouts(int count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> docs(1, 24), length(0, 300), kind(0, 15), run(2, 40);
  std::vector<std::vector<int64_t>> layouts;
  while (int(layouts.size()) < count) {
    std::vector<int64_t> l;
    const int n = docs(rng);
    for (int i = 0; i < n; ++i) {
      const int k = kind(rng);
      if (k < 3) {
        l.push_back(0);
      } else if (k == 3) {
        l.insert(l.end(), size_t(run(rng)), 0);
      } else {
        l.push_back(length(rng));
      }
    }
    int64_t tokens = 0;
    for (int64_t x : l) tokens += x;
    if (tokens > 0) layouts.push_back(l);  // no tokens: the kernel does not run
  }
  return layouts;
}

template <int kDim>
void check_layouts(const std::vector<std::vector<int64_t>>& layouts, bool document_tiling,
                   Tally* total) {
  for (size_t i = 0; i < layouts.size(); ++i) {
    SCOPED_TRACE("dim " + std::to_string(kDim) + (document_tiling ? ", document" : ", packed") +
                 " tiling, documents " + describe(layouts[i]));
    const int heads = 1 + int(i % 3);
    const Tally t = simulate_layout<kDim>(layouts[i], heads, document_tiling);
    total->aligned_tiles += t.aligned_tiles;
    total->gathered_tiles += t.gathered_tiles;
    total->batched_tiles += t.batched_tiles;
    total->gathered_past_start += t.gathered_past_start;
    if (::testing::Test::HasFailure()) return;  // one layout's report is enough
  }
}

TEST(QuantizeGeometry, EdgeLayoutsWriteEveryTransposedByteOnceAndRight) {
  Tally total;
  check_layouts<64>(edge_layouts(), false, &total);
  check_layouts<128>(edge_layouts(), false, &total);
  // The three paths of stage S all ran: else this test checks less than it says.
  EXPECT_GT(total.aligned_tiles, 0);
  EXPECT_GT(total.gathered_tiles, 0);
  EXPECT_GT(total.batched_tiles, 0);
}

TEST(QuantizeGeometry, RandomLayoutsWriteEveryTransposedByteOnceAndRight) {
  constexpr int kLayouts = 300;
  Tally total;
  check_layouts<64>(random_layouts(kLayouts, 64), false, &total);
  check_layouts<128>(random_layouts(kLayouts, 128), false, &total);
  EXPECT_GT(total.gathered_tiles, 0);
}

// The document tiling: every tile lies in one document, from its start, so every span is aligned
// but tile 0's after leading empty documents (their gaps come first), and every byte is still
// written once and right.
TEST(QuantizeGeometry, DocumentTilesWriteEveryTransposedByteOnceByAlignedSpans) {
  constexpr int kLayouts = 300;
  std::vector<std::vector<int64_t>> layouts = edge_layouts();
  for (const uint32_t seed : {64u, 128u}) {
    const std::vector<std::vector<int64_t>> random = random_layouts(kLayouts, seed);
    layouts.insert(layouts.end(), random.begin(), random.end());
  }
  Tally total;
  check_layouts<64>(layouts, true, &total);
  check_layouts<128>(layouts, true, &total);
  EXPECT_GT(total.aligned_tiles, 0);
  EXPECT_EQ(total.gathered_past_start, 0);
}

// tiles_are_key_tiles (the quantizer then writes the tile codes from its own packed tiles): where
// it holds, every tile's span is aligned and the tile is one document's key tile; on layouts built
// to hold it, it does; one empty document before a non-empty one, a start off the key tiles, a
// partial last group or head dim 64 each turn it off.
TEST(QuantizeGeometry, KeyTileLayoutsGiveEveryTileOneKeyTile) {
  using G = Geometry<128>;
  static_assert(G::kTileTokens == kKeyTileTokens, "a 128-dim tile is a key tile");
  auto holds = [](const std::vector<int64_t>& lengths, int dim) {
    const std::vector<int32_t> cu = cu_seqlens_from_lengths(lengths);
    return tiles_are_key_tiles(cu.data(), int(lengths.size()), cu.back(), dim);
  };
  const std::vector<std::vector<int64_t>> key_tile_layouts = {
      {1024}, {128, 256, 384, 48}, {256, 128, 0, 0}, {128, 128, 16}, {0}};
  for (const auto& lengths : key_tile_layouts)
    EXPECT_TRUE(holds(lengths, 128)) << describe(lengths);
  EXPECT_FALSE(holds({128, 0, 256}, 128));
  EXPECT_FALSE(holds({0, 128}, 128));
  EXPECT_FALSE(holds({64, 128}, 128));
  EXPECT_FALSE(holds({128, 40}, 128));
  EXPECT_FALSE(holds({1024}, 64));

  std::vector<std::vector<int64_t>> layouts = edge_layouts();
  const std::vector<std::vector<int64_t>> random = random_layouts(300, 128);
  layouts.insert(layouts.end(), random.begin(), random.end());
  layouts.insert(layouts.end(), key_tile_layouts.begin(), key_tile_layouts.end());
  int checked = 0;
  for (const auto& lengths : layouts) {
    if (!holds(lengths, 128)) continue;
    SCOPED_TRACE(describe(lengths));
    const std::vector<int32_t> cu = cu_seqlens_from_lengths(lengths);
    const int num_docs = int(lengths.size()), tokens = cu.back();
    Tally tally;
    const CheckedOffsets global{&cu, &tally};
    for (int t0 = 0; t0 < tokens; t0 += G::kTileTokens) {
      const int t_end = std::min(t0 + G::kTileTokens, tokens);
      int32_t window[kWindowDocs];
      const TransposedSpan s =
          find_span<Tiles::kPacked>(SerialLanes{}, global, window, num_docs, tokens,
                                    transposed_tokens(tokens, num_docs), t0, t_end);
      EXPECT_TRUE(s.aligned) << "tile at " << t0;
      EXPECT_EQ((t0 - cu[size_t(s.doc_lo)]) % kKeyTileTokens, 0) << "tile at " << t0;
      EXPECT_GE(cu[size_t(s.doc_lo) + 1], t_end) << "tile at " << t0;
      ++checked;
    }
    EXPECT_EQ(tally.bad_reads, 0);
  }
  EXPECT_GT(checked, 20);
}

// The warp-wide search against a plain count, for documents around its 32-ary rounds.
TEST(QuantizeGeometry, WarpSearchCountsTheDocumentsEndingByAToken) {
  for (int num_docs : {1, 2, 31, 32, 33, 1023, 1024, 1025, 40000}) {
    std::vector<int64_t> lengths(static_cast<size_t>(num_docs));
    for (int i = 0; i < num_docs; ++i) lengths[size_t(i)] = (i * 7) % 5;  // empty ones too
    const std::vector<int32_t> cu = cu_seqlens_from_lengths(lengths);
    Tally tally;
    const CheckedOffsets offsets{&cu, &tally};
    for (int64_t x = 0; x < cu.back(); x += 1 + cu.back() / 500) {
      const int want = int(std::upper_bound(cu.begin() + 1, cu.end(), int32_t(x)) - cu.begin()) - 1;
      ASSERT_EQ(docs_ending_by(SerialLanes{}, offsets, 0, num_docs - 1, x), want)
          << num_docs << " documents, token " << x;
    }
    EXPECT_EQ(tally.bad_reads, 0);
  }
}

}  // namespace
}  // namespace flamia::sm90::quant
