// The forward attention's work list: a counting sort of (document, query tile) by visible key
// blocks, or of documents by their longest tile's, longest first, in one launch of one CTA.
//
// Structure (1024 threads):
//   1. zero one bucket per key-block count (shared memory, or the workspace when too many) and
//      reset the persistent kernel's counter;
//   2. histogram: walk every query tile and add `heads` to its key's bucket (by document: walk
//      every document and add its items to its longest tile's bucket);
//   3. exclusive scan of the buckets in descending key order: each becomes its key's first slot;
//   4. scatter: walk the tiles again, take `heads` consecutive slots from the key's cursor and
//      write the tile's items there, heads in order (by document: each document of a chunk first
//      takes its items' slots from its bucket's cursor, then its tiles fill them, each head group
//      longest first).
// Tiles are walked in chunks of kChunkDocs documents: a block scan gives the chunk's tile offsets
// and each thread finds its tile's document by binary search in them, so a single 1M-token
// document and tens of thousands of short ones both spread evenly over the threads. Lanes of a
// warp whose tiles (documents) share a key combine their atomics (one per key per warp), which in
// the longest-first order also keeps a document's tiles of equal cost adjacent in the list.
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <climits>
#include <string>
#include <vector>

#include "check.h"
#include "scheduler.h"

namespace flamia::sm90 {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarpThreads = 32;
constexpr unsigned kFullWarp = 0xFFFFFFFFu;
constexpr int kChunkDocs = kThreads;  // one document a thread per chunk

// A kernel gets 48 KiB of shared memory without opting in; the chunk's tile offsets, its
// documents' first slots and the scan take about 8 KiB, the buckets get the rest. 9216 buckets
// cover a 1M-token document at block_n 128 (8192 key blocks); longer documents or smaller key
// blocks count in the workspace.
constexpr size_t kDefaultSharedBytes = 48 * 1024;
constexpr int kSharedKeyBuckets = 9216;

constexpr size_t kItemAlignment = alignof(WorkItem);  // the kernel stores items as int4

using BlockScan = cub::BlockScan<int, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;

struct SharedStorage {
  typename BlockScan::TempStorage scan;
  int tile_offset[kChunkDocs + 1];  // the chunk's exclusive prefix of query tiles, then its total
  int item_base[kChunkDocs];        // by document: the slot of each document's first item, or -1
};
static_assert(sizeof(SharedStorage) + kSharedKeyBuckets * sizeof(int) <= kDefaultSharedBytes,
              "static + dynamic shared memory must fit the default 48 KiB");

struct Params {
  const int32_t* cu_seqlens;
  int num_docs;
  int heads;
  ScheduleGeometry geometry;
  int num_items;
  int max_key_blocks;
  int4* items;
  int* counter;
  int* workspace_buckets;  // used when the buckets do not fit in shared memory
};

bool buckets_in_shared(int max_key_blocks) {
  return max_key_blocks < kSharedKeyBuckets;  // buckets 0..max_key_blocks
}

size_t bucket_workspace_bytes(int max_key_blocks) {
  return buckets_in_shared(max_key_blocks) ? 0 : (size_t(max_key_blocks) + 1) * sizeof(int);
}

// Per chunk of kChunkDocs documents, calls at_document(doc, length, tiles) once on each thread (doc
// = -1 past the last document), then visit(doc, chunk_doc, q_tile, key_blocks) once per query tile
// of the chunk, with doc = -1 on threads without a tile in a round; chunk_doc indexes
// SharedStorage::item_base. Every thread of the block makes the same calls, so both may use
// warp-collective intrinsics on the full mask, and what at_document writes to shared memory is
// visible to every visit. Without kVisitTiles only at_document is called.
template <bool kVisitTiles, typename AtDocument, typename Visit>
__device__ __forceinline__ void for_each_tile(const Params& p, SharedStorage& s,
                                              AtDocument&& at_document, Visit&& visit) {
  const int tid = int(threadIdx.x);
  for (int64_t chunk = 0; chunk < p.num_docs; chunk += kChunkDocs) {
    const int64_t doc = chunk + tid;
    const int32_t length = doc < p.num_docs ? p.cu_seqlens[doc + 1] - p.cu_seqlens[doc] : 0;
    const int tiles = schedule_query_tiles(length, p.geometry.block_m);
    at_document(doc < p.num_docs ? int(doc) : -1, length, tiles);
    if constexpr (!kVisitTiles) continue;
    int offset = 0, chunk_tiles = 0;
    BlockScan(s.scan).ExclusiveSum(tiles, offset, chunk_tiles);
    s.tile_offset[tid] = offset;
    if (tid == 0) s.tile_offset[kChunkDocs] = chunk_tiles;
    __syncthreads();

    for (int round = 0; round < chunk_tiles; round += kThreads) {
      const int tile = round + tid;
      int tile_doc = -1, lo = 0, q_tile = 0, key = 0;
      if (tile < chunk_tiles) {
        // The last document of the chunk whose first tile is <= `tile`; zero-tile documents share
        // their offset with the next one and are skipped. Invariant: offset[lo] <= tile <
        // offset[hi].
        int hi = kChunkDocs;
        while (hi - lo > 1) {
          const int mid = (lo + hi) / 2;
          if (s.tile_offset[mid] <= tile) {
            lo = mid;
          } else {
            hi = mid;
          }
        }
        tile_doc = int(chunk) + lo;
        q_tile = tile - s.tile_offset[lo];
        key = schedule_key_blocks(p.cu_seqlens[tile_doc + 1] - p.cu_seqlens[tile_doc], q_tile,
                                  p.geometry);
      }
      visit(tile_doc, lo, q_tile, key);
    }
    __syncthreads();  // the next chunk rewrites tile_offset, item_base and the scan's storage
  }
}

// Lanes of a warp whose `bucket` is equal (peers) share one atomic: each lane's `count` summed over
// its peers in lower lanes (`below`) and over all its peers (`total`). Called by the full warp.
__device__ __forceinline__ void peer_sums(unsigned peers, int count, int lane, int64_t& below,
                                          int64_t& total) {
  below = 0;
  total = 0;
  for (int l = 0; l < kWarpThreads; ++l) {
    const int c = __shfl_sync(kFullWarp, count, l);
    if ((peers >> l) & 1u) {
      total += c;
      if (l < lane) below += c;
    }
  }
}

template <bool kBucketsInShared>
__global__ void __launch_bounds__(kThreads, 1) build_schedule_kernel(const Params p) {
  __shared__ SharedStorage s;
  extern __shared__ int shared_buckets[];
  int* buckets = kBucketsInShared ? shared_buckets : p.workspace_buckets;
  const int tid = int(threadIdx.x);
  const int lane = tid % kWarpThreads;
  const unsigned lanes_above = ~((2u << lane) - 1u);  // 0 for lane 31 (2u << 31 wraps to 0)

  for (int64_t k = tid; k <= p.max_key_blocks; k += kThreads) buckets[k] = 0;
  // The persistent kernel runs after this one on the stream: no ordering beyond that is needed.
  if (tid == 0) *p.counter = 0;
  __syncthreads();

  // A key outside [1, max_key_blocks] only arises from a device cu_seqlens unlike the host layout
  // the arguments were computed from: such tiles are dropped rather than written out of bounds.
  auto bucket_of = [&](int doc, int key) {
    return doc >= 0 && key >= 1 && key <= p.max_key_blocks ? key : -1;
  };
  const int head_group = p.geometry.head_group;
  const bool by_document = head_group > 0;
  // By document: a document's bucket is its longest (last) tile's key, and its items take
  // consecutive slots, counted or claimed by one atomic per bucket per warp. Sums that pass
  // num_items (only from a device cu_seqlens unlike the host layout) are cut to INT_MAX, so the
  // slots past it are dropped and no int overflows.
  auto document_bucket = [&](int doc, int32_t length, int tiles) {
    if (tiles <= 0 || int64_t(tiles) * p.heads > p.num_items) return -1;
    return bucket_of(doc, schedule_key_blocks(length, tiles - 1, p.geometry));
  };
  auto document_items = [&](int bucket, int tiles) { return bucket >= 0 ? tiles * p.heads : 0; };
  auto clamp_int = [](int64_t x) { return int(x < INT_MAX ? x : INT_MAX); };
  auto no_document = [](int, int32_t, int) {};
  auto no_tile = [](int, int, int, int) {};

  // Histogram: items per bucket.
  auto count_tile = [&](int doc, int, int, int key) {
    const int bucket = bucket_of(doc, key);
    const unsigned peers = __match_any_sync(kFullWarp, bucket);
    if (bucket >= 0 && lane == __ffs(peers) - 1)
      atomicAdd(&buckets[bucket], __popc(peers) * p.heads);
  };
  auto count_document = [&](int doc, int32_t length, int tiles) {
    const int bucket = document_bucket(doc, length, tiles);
    const unsigned peers = __match_any_sync(kFullWarp, bucket);
    int64_t below, total;
    peer_sums(peers, document_items(bucket, tiles), lane, below, total);
    if (bucket >= 0 && lane == __ffs(peers) - 1) atomicAdd(&buckets[bucket], clamp_int(total));
  };
  if (by_document) {
    for_each_tile<false>(p, s, count_document, no_tile);
  } else {
    for_each_tile<true>(p, s, no_document, count_tile);
  }
  __syncthreads();

  // Descending exclusive scan: thread t owns a run of keys counted down from max_key_blocks.
  {
    const int64_t num_buckets = int64_t(p.max_key_blocks) + 1;
    const int64_t per_thread = (num_buckets + kThreads - 1) / kThreads;
    const int64_t first = tid * per_thread;
    const int64_t last = first + per_thread < num_buckets ? first + per_thread : num_buckets;
    int run = 0;
    for (int64_t r = first; r < last; ++r) run += buckets[p.max_key_blocks - r];
    int slot = 0;
    BlockScan(s.scan).ExclusiveSum(run, slot);
    for (int64_t r = first; r < last; ++r) {
      const int64_t key = p.max_key_blocks - r;
      const int count = buckets[key];
      buckets[key] = slot;
      slot += count;
    }
  }
  __syncthreads();

  // Scatter: a tile's heads h0 .. h0 + heads - 1 take `heads` consecutive slots from `first`.
  auto write_tile = [&](int64_t first, int heads, int h0, int doc, int q_tile, int key) {
    if (first < 0 || first + heads > p.num_items) return;
    const int first_row =
        schedule_first_row(p.cu_seqlens[doc + 1] - p.cu_seqlens[doc], q_tile, p.geometry);
    for (int h = 0; h < heads; ++h) p.items[first + h] = make_int4(doc, first_row, h0 + h, key);
  };
  auto place_tile = [&](int doc, int, int q_tile, int key) {
    const int bucket = bucket_of(doc, key);
    const unsigned peers = __match_any_sync(kFullWarp, bucket);
    const int leader = __ffs(peers) - 1;
    int base = 0;
    if (bucket >= 0 && lane == leader) base = atomicAdd(&buckets[bucket], __popc(peers) * p.heads);
    base = __shfl_sync(kFullWarp, base, leader);
    if (bucket < 0) return;
    // Lanes hold a document's tiles in ascending order, so the lanes above come first: a
    // bucket's tiles stay longest first within the warp.
    write_tile(int64_t(base) + int64_t(__popc(peers & lanes_above)) * p.heads, p.heads, 0, doc,
               q_tile, key);
  };
  auto place_document = [&](int doc, int32_t length, int tiles) {
    const int bucket = document_bucket(doc, length, tiles);
    const unsigned peers = __match_any_sync(kFullWarp, bucket);
    const int leader = __ffs(peers) - 1;
    int64_t below, total;
    peer_sums(peers, document_items(bucket, tiles), lane, below, total);
    int base = 0;
    if (bucket >= 0 && lane == leader) base = atomicAdd(&buckets[bucket], clamp_int(total));
    base = __shfl_sync(kFullWarp, base, leader);
    const int64_t first = int64_t(base) + below;
    s.item_base[threadIdx.x] = bucket >= 0 && base >= 0 && first < INT_MAX ? int(first) : -1;
  };
  // A document's head groups in order, each group's tiles longest (last) first, a tile's heads of
  // the group adjacent.
  auto place_document_tile = [&](int doc, int chunk_doc, int q_tile, int key) {
    if (doc < 0 || s.item_base[chunk_doc] < 0) return;
    // The chunk's tile offsets hold the document's tile count (the last one's: the chunk total).
    const int tiles = s.tile_offset[chunk_doc + 1] - s.tile_offset[chunk_doc];
    const int64_t group_items = int64_t(head_group) * tiles;
    const int64_t in_group = int64_t(tiles - 1 - q_tile) * head_group;
    for (int h0 = 0; h0 < p.heads; h0 += head_group)
      write_tile(s.item_base[chunk_doc] + h0 / head_group * group_items + in_group, head_group, h0,
                 doc, q_tile, key);
  };
  if (by_document) {
    for_each_tile<true>(p, s, place_document, place_document_tile);
  } else {
    for_each_tile<true>(p, s, no_document, place_tile);
  }
}

[[noreturn]] void fail(const std::string& what) {
  throw Error("build_schedule: " + what);
}

void validate_geometry(const ScheduleGeometry& g) {
  if (g.block_m <= 0 || g.block_n <= 0)
    throw Error("schedule geometry: block_m = " + std::to_string(g.block_m) +
                " and block_n = " + std::to_string(g.block_n) + " must be positive");
  if (g.row_unit < 0 || (g.row_unit > 0 && g.block_m % g.row_unit != 0))
    throw Error("schedule geometry: row_unit = " + std::to_string(g.row_unit) +
                " must be 0 or a positive divisor of block_m = " + std::to_string(g.block_m));
}

}  // namespace

int64_t count_work_items(const PackedLayout& layout, const ScheduleGeometry& g) {
  validate_geometry(g);
  int64_t tiles = 0;
  for (int b = 0; b < layout.num_docs; ++b)
    tiles += schedule_query_tiles(layout.doc_length(b), g.block_m);
  return tiles * layout.heads_q;
}

int max_key_blocks(const PackedLayout& layout, const ScheduleGeometry& g) {
  validate_geometry(g);
  int most = 0;
  for (int b = 0; b < layout.num_docs; ++b) {
    const int32_t len = layout.doc_length(b);
    if (len == 0) continue;
    // The last tile sees the most keys, causal or not.
    const int32_t last_tile = schedule_query_tiles(len, g.block_m) - 1;
    most = std::max(most, int(schedule_key_blocks(len, last_tile, g)));
  }
  return most;
}

int document_head_group(const PackedLayout& layout, const ScheduleGeometry& g, int ctas) {
  validate_geometry(g);
  if (ctas <= 1) return layout.group();  // one CTA (or none) finishes with the list in any order
  struct DocumentWork {
    int64_t longest;    // key blocks of its longest (last) tile
    int64_t head_work;  // key blocks of one head's items
  };
  std::vector<DocumentWork> docs;
  int64_t total = 0;
  for (int b = 0; b < layout.num_docs; ++b) {
    const int32_t len = layout.doc_length(b);
    const int32_t tiles = schedule_query_tiles(len, g.block_m);
    if (tiles == 0) continue;
    int64_t blocks = 0;
    for (int32_t t = 0; t < tiles; ++t) blocks += schedule_key_blocks(len, t, g);
    docs.push_back({schedule_key_blocks(len, tiles - 1, g), blocks});
    total += blocks * layout.heads_q;
  }
  // The list's document order; among equal longest tiles, the least work last (the worst case of
  // the builder's arbitrary order there).
  std::sort(docs.begin(), docs.end(), [](const DocumentWork& a, const DocumentWork& b) {
    return a.longest != b.longest ? a.longest > b.longest : a.head_work > b.head_work;
  });
  const double slack = std::max(kDocumentOrderSlack * double(total) / double(ctas), 1.0);
  // How far a document's last group's longest item runs past the other CTAs, which share the rest
  // of its group's items and the later documents' meanwhile.
  const auto balanced = [&](int group) {
    int64_t later = total;
    for (const DocumentWork& d : docs) {
      later -= d.head_work * layout.heads_q;
      const double others = double(d.head_work * group - d.longest + later) / double(ctas - 1);
      if (double(d.longest) - others > slack) return false;
    }
    return true;
  };
  for (int group = layout.group(); group <= layout.heads_q; group += layout.group())
    if (layout.heads_q % group == 0 && balanced(group)) return group;
  return 0;
}

size_t schedule_workspace_bytes(const PackedLayout& layout, const ScheduleGeometry& g) {
  return bucket_workspace_bytes(max_key_blocks(layout, g));
}

void build_schedule(const ScheduleArgs& a, cudaStream_t stream) {
  validate_geometry(a.geometry);
  if (a.num_docs < 0) fail("num_docs = " + std::to_string(a.num_docs) + " is negative");
  if (a.heads <= 0) fail("heads = " + std::to_string(a.heads) + " must be positive");
  if (a.geometry.head_group < 0 ||
      (a.geometry.head_group > 0 && a.heads % a.geometry.head_group != 0))
    fail("head_group = " + std::to_string(a.geometry.head_group) +
         " must be 0 or a positive divisor of heads = " + std::to_string(a.heads));
  if (a.num_items < 0 || a.num_items > INT_MAX)
    fail("num_items = " + std::to_string(a.num_items) +
         " is outside [0, INT_MAX] (the work counter is an int)");
  if (a.num_items % a.heads != 0)
    fail("num_items = " + std::to_string(a.num_items) + " is not a multiple of heads = " +
         std::to_string(a.heads) + " (count_work_items of the same layout and heads?)");
  if (a.counter == nullptr) fail("counter is null");
  if (!cuda::is_aligned(a.counter, alignof(int)))
    fail("counter is not " + std::to_string(alignof(int)) + "-byte aligned");
  if (a.num_items == 0) {
    FLAMIA_CUDA_CHECK(cudaMemsetAsync(a.counter, 0, sizeof(int), stream));
    return;
  }
  if (a.num_docs == 0) fail("num_items = " + std::to_string(a.num_items) + " without documents");
  if (a.cu_seqlens == nullptr) fail("device cu_seqlens is null");
  if (!cuda::is_aligned(a.cu_seqlens, alignof(int32_t)))
    fail("device cu_seqlens is not 4-byte aligned");
  if (a.max_key_blocks <= 0 || a.max_key_blocks == INT_MAX)
    fail("max_key_blocks = " + std::to_string(a.max_key_blocks) +
         " must be in [1, INT_MAX) when there are items");
  if (a.items == nullptr) fail("items is null");
  if (!cuda::is_aligned(a.items, kItemAlignment))
    fail("items is not " + std::to_string(kItemAlignment) + "-byte aligned");
  const bool in_shared = buckets_in_shared(a.max_key_blocks);
  if (!in_shared && a.workspace == nullptr)
    fail("workspace is null; max_key_blocks = " + std::to_string(a.max_key_blocks) + " needs " +
         std::to_string(bucket_workspace_bytes(a.max_key_blocks)) +
         " bytes (schedule_workspace_bytes)");
  if (!in_shared && !cuda::is_aligned(a.workspace, alignof(int)))
    fail("workspace is not " + std::to_string(alignof(int)) + "-byte aligned");

  Params p;
  p.cu_seqlens = a.cu_seqlens;
  p.num_docs = a.num_docs;
  p.heads = a.heads;
  p.geometry = a.geometry;
  p.num_items = int(a.num_items);
  p.max_key_blocks = a.max_key_blocks;
  p.items = reinterpret_cast<int4*>(a.items);
  p.counter = a.counter;
  p.workspace_buckets = static_cast<int*>(a.workspace);
  if (in_shared) {
    const size_t bucket_bytes = (size_t(a.max_key_blocks) + 1) * sizeof(int);
    build_schedule_kernel<true><<<1, kThreads, bucket_bytes, stream>>>(p);
  } else {
    build_schedule_kernel<false><<<1, kThreads, 0, stream>>>(p);
  }
  FLAMIA_CUDA_CHECK_LAUNCH();
}

}  // namespace flamia::sm90
