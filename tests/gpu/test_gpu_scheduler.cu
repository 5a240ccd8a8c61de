// The forward attention's work list built on the GPU, against an independent host enumeration of
// the (document, query tile, head) items: a permutation of them, correct key blocks, longest first
// with the heads of a tile adjacent and in order (or by document: documents by their longest tile,
// each item at its place in its document's head groups), the counter reset; on one document, many
// equal ones, hundreds of odd ones, tens of thousands, zero-length and one-token documents, a
// 1M-token document (with buckets in shared memory and in the workspace), causal and not, two tile
// heights. Outputs are poisoned first. Host tests cover the counts and the argument checks, the
// backward's work list and its dQ slot layout.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "../src/emulator_internal.h"
#include "bwd_params.h"
#include "check.h"
#include "dq_params.h"
#include "flamia/packed.h"
#include "fwd_params.h"
#include "gpu_test.h"
#include "scheduler.h"
#include "sm90_test_util.h"
#include "wgmma.cuh"

namespace flamia {
namespace {

using sm90::ScheduleArgs;
using sm90::ScheduleGeometry;
using sm90::WorkItem;
using test::DeviceBuffer;
using test::expect_error;

constexpr int kMillion = 1 << 20;
constexpr int32_t kPoisonWord = -1;  // every byte 0xFF

constexpr int kAnyHeadGroup = -1;  // forward_geometries: by document, in each head group size

// Tiles of 128 or 64 queries from the document's start, and the forward kernel's 192 aligned to
// its end in 64-row units; 128 keys, causal or not.
std::vector<ScheduleGeometry> forward_geometries() {
  std::vector<ScheduleGeometry> all;
  for (bool causal : {true, false}) {
    for (int block_m : {128, 64}) all.push_back({block_m, 128, causal});
    all.push_back({192, 128, causal, 64});
    // By document (check_all_geometries fills in head groups): the forward's geometry and two
    // others.
    ScheduleGeometry forward = sm90::fwd::schedule_geometry(causal);
    forward.head_group = kAnyHeadGroup;
    all.push_back(forward);
    all.push_back({128, 128, causal, 0, kAnyHeadGroup});
    all.push_back({64, 128, causal, 0, kAnyHeadGroup});
  }
  return all;
}

std::string describe(const ScheduleGeometry& g, int heads) {
  return "block_m " + std::to_string(g.block_m) + ", block_n " + std::to_string(g.block_n) +
         (g.causal ? ", causal" : ", non-causal") + ", row_unit " + std::to_string(g.row_unit) +
         ", head_group " + std::to_string(g.head_group) + ", heads " + std::to_string(heads);
}

PackedLayout layout_of(const std::vector<int32_t>& cu, int heads) {
  PackedLayout l;
  l.cu_seqlens = cu.data();
  l.num_docs = int(cu.size()) - 1;
  l.tokens = cu.back();
  l.heads_q = heads;
  l.heads_kv = 1;
  l.head_dim = 128;
  validate(l);
  return l;
}

// Written out independently of schedule_query_tiles / schedule_key_blocks.
int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}
// With a row unit the last tile ends at the length rounded up to it: tile q ends that many whole
// tiles earlier.
int64_t expected_tile_end(int64_t len, int64_t q_tile, const ScheduleGeometry& g) {
  if (g.row_unit == 0) return (q_tile + 1) * g.block_m;
  const int64_t tiles = ceil_div(len, g.block_m);
  return ceil_div(len, g.row_unit) * g.row_unit - (tiles - 1 - q_tile) * g.block_m;
}
int64_t expected_key_blocks(int64_t len, int64_t q_tile, const ScheduleGeometry& g) {
  const int64_t visible = g.causal ? std::min(len, expected_tile_end(len, q_tile, g)) : len;
  return ceil_div(visible, g.block_n);
}

// Builds the list on the GPU and checks it item by item.
void check_schedule(const std::vector<int64_t>& lengths, int heads, const ScheduleGeometry& g) {
  SCOPED_TRACE(describe(g, heads) + ", " + std::to_string(lengths.size()) + " documents");
  const std::vector<int32_t> cu = cu_seqlens_from_lengths(lengths);
  const PackedLayout layout = layout_of(cu, heads);
  const int num_docs = int(lengths.size());

  std::vector<int64_t> first_tile(size_t(num_docs) + 1, 0);
  int64_t most_keys = 0;
  for (int b = 0; b < num_docs; ++b) {
    first_tile[b + 1] = first_tile[b] + ceil_div(lengths[b], g.block_m);
    most_keys = std::max(most_keys, ceil_div(lengths[b], g.block_n));
  }
  const int64_t num_items = first_tile[num_docs] * heads;
  ASSERT_EQ(sm90::count_work_items(layout, g), num_items);
  ASSERT_EQ(sm90::max_key_blocks(layout, g), most_keys);

  const DeviceBuffer<int32_t> d_cu(cu);
  DeviceBuffer<WorkItem> items(size_t(std::max<int64_t>(num_items, 1)));
  DeviceBuffer<int> counter(1);
  DeviceBuffer<uint8_t> workspace(std::max<size_t>(sm90::schedule_workspace_bytes(layout, g), 1));
  items.poison();
  counter.poison();
  workspace.poison();

  ScheduleArgs args;
  args.cu_seqlens = d_cu.get();
  args.num_docs = num_docs;
  args.heads = heads;
  args.geometry = g;
  args.num_items = num_items;
  args.max_key_blocks = int(most_keys);
  args.items = items.get();
  args.counter = counter.get();
  args.workspace = workspace.get();
  cudaStream_t stream = nullptr;
  FLAMIA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // The uploads and poison fills ran in the legacy stream, which a non-blocking one does not wait
  // for.
  FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
  sm90::build_schedule(args, stream);
  FLAMIA_CUDA_CHECK(cudaGetLastError());
  FLAMIA_CUDA_CHECK(cudaStreamSynchronize(stream));
  FLAMIA_CUDA_CHECK(cudaStreamDestroy(stream));

  EXPECT_EQ(counter.download()[0], 0);
  const std::vector<WorkItem> got = items.download();
  if (num_items == 0) {  // nothing may be written
    EXPECT_EQ(got[0].doc, kPoisonWord);
    return;
  }
  // By document: documents sort by their last tile's key blocks.
  const auto document_key = [&](int doc) {
    const int64_t tiles = first_tile[doc + 1] - first_tile[doc];
    return expected_key_blocks(lengths[doc], tiles - 1, g);
  };
  // num_items distinct members of a set of num_items: a permutation.
  std::vector<bool> seen(size_t(num_items), false);
  std::vector<bool> doc_started(size_t(num_docs), false);
  int64_t doc_start = 0;  // by document: the list position of the current document's first item
  for (int64_t i = 0; i < num_items; ++i) {
    const WorkItem& w = got[size_t(i)];
    const std::string where = "item " + std::to_string(i) + " = (doc " + std::to_string(w.doc) +
                              ", first_row " + std::to_string(w.first_row) + ", head " +
                              std::to_string(w.head) + ", key_blocks " +
                              std::to_string(w.key_blocks) + ")";
    ASSERT_TRUE(w.doc >= 0 && w.doc < num_docs) << where;
    // The tile whose first row this is: tile ends are block_m apart, the last one known.
    const int64_t tiles = first_tile[w.doc + 1] - first_tile[w.doc];
    const int64_t last_end = expected_tile_end(lengths[w.doc], tiles - 1, g);
    const int64_t behind = last_end - (int64_t(w.first_row) + g.block_m);
    ASSERT_TRUE(behind >= 0 && behind % g.block_m == 0 && behind / g.block_m < tiles)
        << where << ": no tile of the document starts there";
    const int64_t q_tile = tiles - 1 - behind / g.block_m;
    ASSERT_TRUE(w.head >= 0 && w.head < heads) << where;
    ASSERT_EQ(w.key_blocks, expected_key_blocks(lengths[w.doc], q_tile, g)) << where;
    const size_t flat = size_t((first_tile[w.doc] + q_tile) * heads + w.head);
    ASSERT_FALSE(seen[flat]) << where << " appears twice";
    seen[flat] = true;
    const WorkItem* prev = i > 0 ? &got[size_t(i - 1)] : nullptr;
    if (g.head_group > 0) {
      if (prev == nullptr || prev->doc != w.doc) {
        // A document's items, once, after the whole previous document, whose last tile is as
        // long or longer.
        ASSERT_FALSE(doc_started[size_t(w.doc)]) << where << ": the document's items are split";
        doc_started[size_t(w.doc)] = true;
        if (prev != nullptr) {
          const int64_t prev_tiles = first_tile[prev->doc + 1] - first_tile[prev->doc];
          ASSERT_EQ(i - doc_start, prev_tiles * heads)
              << where << ": the previous document's items are not all done";
          ASSERT_LE(document_key(w.doc), document_key(prev->doc))
              << where << ": documents not longest first";
        }
        doc_start = i;
      }
      // Inside the document: head groups in order, a group's tiles longest first, a tile's heads
      // of the group adjacent.
      const int64_t gsize = g.head_group;
      const int64_t expected =
          w.head / gsize * gsize * tiles + (tiles - 1 - q_tile) * gsize + w.head % gsize;
      ASSERT_EQ(i - doc_start, expected) << where << ": not at its place in the document";
    } else if (prev != nullptr) {
      ASSERT_LE(w.key_blocks, prev->key_blocks) << where << ": not longest first";
      if (w.head > 0) {  // the tile's heads are adjacent and in order (K/V reuse in L2)
        ASSERT_TRUE(prev->doc == w.doc && prev->first_row == w.first_row &&
                    prev->head == w.head - 1)
            << where << " does not follow head " << w.head - 1 << " of its tile";
      }
    } else {
      ASSERT_EQ(w.head, 0) << where;
    }
  }
}

// The head group sizes to test with `heads` heads: 1, the smallest and the largest divisor
// between, and all.
std::vector<int> head_groups(int heads) {
  std::vector<int> groups = {1};
  for (int d = 2; d < heads; ++d)
    if (heads % d == 0) {
      groups.push_back(d);
      break;
    }
  for (int d = heads - 1; d > groups.back(); --d)
    if (heads % d == 0) {
      groups.push_back(d);
      break;
    }
  if (heads > 1) groups.push_back(heads);
  return groups;
}

// Each geometry, the by-document ones in each of head_groups(heads).
void check_all_geometries(const std::vector<int64_t>& lengths, int heads) {
  for (ScheduleGeometry g : forward_geometries()) {
    if (g.head_group != kAnyHeadGroup) {
      check_schedule(lengths, heads, g);
      continue;
    }
    for (int group : head_groups(heads)) {
      g.head_group = group;
      check_schedule(lengths, heads, g);
    }
  }
}

// Deterministic lengths in [lo, hi].
std::vector<int64_t> spread_lengths(int count, int64_t lo, int64_t hi) {
  std::vector<int64_t> lengths(static_cast<size_t>(count));
  uint32_t state = 12345u;
  for (int64_t& len : lengths) {
    state = state * 1664525u + 1013904223u;  // LCG
    len = lo + int64_t((state >> 8) % uint32_t(hi - lo + 1));
  }
  return lengths;
}

TEST(GpuScheduler, OneDocument) {
  FLAMIA_REQUIRE_GPU();
  check_all_geometries({1000}, 8);
}

TEST(GpuScheduler, SixteenDocumentsOf4096) {
  FLAMIA_REQUIRE_GPU();
  check_all_geometries(std::vector<int64_t>(16, 4096), 32);
}

TEST(GpuScheduler, HundredsOfOddLengths) {
  FLAMIA_REQUIRE_GPU();
  check_all_geometries(spread_lengths(257, 17, 496), 4);
}

TEST(GpuScheduler, ZeroLengthDocumentsAtStartMiddleAndEnd) {
  FLAMIA_REQUIRE_GPU();
  check_all_geometries({0, 0, 300, 0, 129, 0, 0, 1, 128, 0}, 3);
}

TEST(GpuScheduler, OneTokenDocuments) {
  FLAMIA_REQUIRE_GPU();
  check_all_geometries(std::vector<int64_t>(500, 1), 2);
}

TEST(GpuScheduler, TensOfThousandsOfDocumentsSpanManyChunks) {
  FLAMIA_REQUIRE_GPU();
  check_all_geometries(spread_lengths(30000, 0, 300), 2);
}

TEST(GpuScheduler, OneHundredTwentyEightHeads) {
  FLAMIA_REQUIRE_GPU();
  check_all_geometries({5000, 3000, 129, 0, 64}, 128);
}

TEST(GpuScheduler, OneMillionTokenDocument) {
  FLAMIA_REQUIRE_GPU();
  const std::vector<int64_t> lengths = {kMillion};
  const std::vector<int32_t> cu = cu_seqlens_from_lengths(lengths);
  EXPECT_EQ(sm90::max_key_blocks(layout_of(cu, 2), ScheduleGeometry{}), 8192);
  check_all_geometries(lengths, 2);
}

TEST(GpuScheduler, KeyBucketsInTheWorkspace) {
  FLAMIA_REQUIRE_GPU();
  // 16384 key blocks of 64: more buckets than shared memory holds.
  const std::vector<int64_t> lengths = {300, kMillion, 0, 4097};
  const std::vector<int32_t> cu = cu_seqlens_from_lengths(lengths);
  for (bool causal : {true, false}) {
    for (int head_group : {0, 1}) {
      const ScheduleGeometry g{128, 64, causal, 0, head_group};
      ASSERT_GT(sm90::schedule_workspace_bytes(layout_of(cu, 1), g), 0u);
      check_schedule(lengths, 1, g);
    }
  }
}

// A device cu_seqlens unlike the host layout the arguments came from (here: documents longer than
// counted) may leave the list incomplete but must not write past it.
TEST(GpuScheduler, DeviceLayoutUnlikeTheHostsWritesNothingPastTheList) {
  FLAMIA_REQUIRE_GPU();
  constexpr int kHeads = 3;
  constexpr size_t kGuard = 4096;  // items past the list, poisoned
  const std::vector<int32_t> host_cu = cu_seqlens_from_lengths({300, 129, 40});
  const std::vector<int32_t> device_cu = cu_seqlens_from_lengths({3000, 5000, 40});
  const PackedLayout layout = layout_of(host_cu, kHeads);
  for (int head_group : {0, 1, kHeads}) {
    SCOPED_TRACE("head_group " + std::to_string(head_group));
    const ScheduleGeometry g{128, 128, true, 0, head_group};
    const int64_t num_items = sm90::count_work_items(layout, g);
    const DeviceBuffer<int32_t> d_cu(device_cu);
    DeviceBuffer<WorkItem> items(size_t(num_items) + kGuard);
    DeviceBuffer<int> counter(1);
    items.poison();
    ScheduleArgs args;
    args.cu_seqlens = d_cu.get();
    args.num_docs = layout.num_docs;
    args.heads = kHeads;
    args.geometry = g;
    args.num_items = num_items;
    args.max_key_blocks = sm90::max_key_blocks(layout, g);
    args.items = items.get();
    args.counter = counter.get();
    FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
    sm90::build_schedule(args, nullptr);
    FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<WorkItem> got = items.download();
    for (size_t i = size_t(num_items); i < got.size(); ++i)
      ASSERT_EQ(got[i].doc, kPoisonWord) << "item " << i << " past the list was written";
  }
}

TEST(GpuScheduler, NoItemsOnlyResetsTheCounter) {
  FLAMIA_REQUIRE_GPU();
  check_all_geometries({}, 4);
  check_all_geometries({0, 0, 0}, 4);
}

// ---- host: counts and argument checks (no GPU needed) ----

TEST(GpuSchedulerHost, CountsTilesAndKeyBlocks) {
  const std::vector<int32_t> cu = cu_seqlens_from_lengths({0, 1, 128, 129, 300});
  const PackedLayout l = layout_of(cu, 2);
  // Tiles of 128: 0 + 1 + 1 + 2 + 3; of 64: 0 + 1 + 2 + 3 + 5.
  EXPECT_EQ(sm90::count_work_items(l, {128, 128, true}), 14);
  EXPECT_EQ(sm90::count_work_items(l, {64, 128, false}), 22);
  EXPECT_EQ(sm90::max_key_blocks(l, {128, 128, true}), 3);
  EXPECT_EQ(sm90::max_key_blocks(l, {64, 64, false}), 5);
  EXPECT_EQ(sm90::schedule_workspace_bytes(l, {}), 0u);

  // A 300-token document: causal tiles see 64, 128, 192, 256, 300 keys (tiles of 64) or 128, 256,
  // 300 (tiles of 128); non-causal tiles all see 300.
  const int expect_64[] = {1, 1, 2, 2, 3};
  for (int t = 0; t < 5; ++t)
    EXPECT_EQ(sm90::schedule_key_blocks(300, t, {64, 128, true}), expect_64[t]) << t;
  for (int t = 0; t < 3; ++t) {
    EXPECT_EQ(sm90::schedule_key_blocks(300, t, {128, 128, true}), t + 1) << t;
    EXPECT_EQ(sm90::schedule_key_blocks(300, t, {128, 128, false}), 3) << t;
  }
  EXPECT_EQ(sm90::schedule_query_tiles(0, 128), 0);
  EXPECT_EQ(sm90::schedule_query_tiles(INT32_MAX, 64), (int64_t(INT32_MAX) + 63) / 64);

  const std::vector<int32_t> none = cu_seqlens_from_lengths({});
  EXPECT_EQ(sm90::count_work_items(layout_of(none, 1), {}), 0);
  EXPECT_EQ(sm90::max_key_blocks(layout_of(none, 1), {}), 0);
}

TEST(GpuSchedulerHost, WorkspaceOnlyForVeryManyKeyBlocks) {
  const std::vector<int32_t> cu = cu_seqlens_from_lengths({kMillion});
  const PackedLayout l = layout_of(cu, 4);
  EXPECT_EQ(sm90::schedule_workspace_bytes(l, {128, 128, true}), 0u);
  EXPECT_GE(sm90::schedule_workspace_bytes(l, {128, 64, true}), (16384u + 1) * sizeof(int));
}

TEST(GpuSchedulerHost, RejectsBadArguments) {
  // Host stand-ins for device pointers: every case below throws before anything is enqueued.
  alignas(16) static WorkItem items[2];
  static int counter;
  static int32_t cu[2] = {0, 100};
  ScheduleArgs good;
  good.cu_seqlens = cu;
  good.num_docs = 1;
  good.heads = 2;
  good.num_items = 2;
  good.max_key_blocks = 1;
  good.items = items;
  good.counter = &counter;
  auto run = [](ScheduleArgs a) { return [=] { sm90::build_schedule(a, nullptr); }; };

  ScheduleArgs a = good;
  a.geometry.block_m = 0;
  expect_error(run(a), "must be positive");
  a = good;
  a.geometry.block_n = -128;
  expect_error(run(a), "must be positive");
  a = good;
  a.geometry.row_unit = 48;  // does not divide block_m 128
  expect_error(run(a), "row_unit = 48");
  a = good;
  a.heads = 0;
  expect_error(run(a), "heads = 0");
  a = good;
  a.num_docs = -1;
  expect_error(run(a), "num_docs = -1");
  a = good;
  a.num_items = -2;
  expect_error(run(a), "num_items = -2");
  a = good;
  a.num_items = int64_t(INT_MAX) + 1;
  expect_error(run(a), "INT_MAX");
  a = good;
  a.num_items = 3;
  expect_error(run(a), "multiple of heads");
  a = good;
  a.counter = nullptr;
  expect_error(run(a), "counter is null");
  a = good;
  a.num_docs = 0;
  expect_error(run(a), "without documents");
  a = good;
  a.cu_seqlens = nullptr;
  expect_error(run(a), "cu_seqlens is null");
  a = good;
  a.max_key_blocks = 0;
  expect_error(run(a), "max_key_blocks = 0");
  a = good;
  a.items = nullptr;
  expect_error(run(a), "items is null");
  a = good;
  a.items = reinterpret_cast<WorkItem*>(reinterpret_cast<char*>(items) + 4);
  expect_error(run(a), "items is not 16-byte aligned");
  a = good;
  a.max_key_blocks = 20000;
  expect_error(run(a), "workspace is null");
  a = good;
  a.geometry.head_group = 3;  // does not divide heads 2
  expect_error(run(a), "head_group = 3");
  a = good;
  a.geometry.head_group = -1;
  expect_error(run(a), "head_group = -1");

  const std::vector<int32_t> one = cu_seqlens_from_lengths({10});
  expect_error(
      [&] {
        sm90::count_work_items(layout_of(one, 1), {0, 128, true});
      },
      "must be positive");
  expect_error(
      [&] {
        sm90::max_key_blocks(layout_of(one, 1), {128, 0, true});
      },
      "must be positive");
}

// The forward's head groups: the fewest heads (whole GQA groups) whose last group's longest item
// does not run alone at the list's end by more than 1 % of a CTA's share (or one key block), or 0
// (longest first).
TEST(ScheduleOrder, FewestHeadsAGroupThatKeepTheCtasTogether) {
  const ScheduleGeometry g = sm90::fwd::schedule_geometry(true);
  constexpr int kCtas = 132;
  const auto group = [&](const std::vector<int64_t>& lengths, int heads, int heads_kv) {
    const std::vector<int32_t> cu = cu_seqlens_from_lengths(lengths);
    PackedLayout l = layout_of(cu, heads);
    l.heads_kv = heads_kv;
    return sm90::document_head_group(l, g, kCtas);
  };
  // The bench's equal-length workloads (16 heads): the longer the documents, the fewer heads a
  // group, down to one on one 65,536-token document (a head's longest item, 512 key blocks,
  // starts with ~87,000 blocks of the head's other items queued for the other CTAs).
  EXPECT_EQ(group(std::vector<int64_t>(16, 4096), 16, 16), 16);
  EXPECT_EQ(group(std::vector<int64_t>(8, 8192), 16, 16), 8);
  EXPECT_EQ(group(std::vector<int64_t>(4, 16384), 16, 16), 4);
  EXPECT_EQ(group(std::vector<int64_t>(2, 32768), 16, 16), 2);
  EXPECT_EQ(group({65536}, 16, 16), 1);
  EXPECT_EQ(group({65536}, 1, 1), 1);
  // GQA: groups of whole key/value heads.
  EXPECT_EQ(group(std::vector<int64_t>(4, 16384), 16, 4), 4);
  EXPECT_EQ(group({65536}, 16, 2), 8);
  // One head: the last 8192-token document's longest item (64 key blocks) starts with only that
  // document's other 42 items left (1,344 blocks, 10.3 a CTA): it ends ~54 blocks after the rest,
  // where the slack is one block.
  EXPECT_EQ(group(std::vector<int64_t>(8, 8192), 1, 1), 0);
  // ... which one CTA (any order) does not mind.
  {
    const std::vector<int32_t> cu = cu_seqlens_from_lengths(std::vector<int64_t>(8, 8192));
    EXPECT_EQ(sm90::document_head_group(layout_of(cu, 1), g, 1), 1);
  }
  // A long document sorts before many short ones.
  std::vector<int64_t> mixed(64, 256);
  mixed.push_back(16384);
  EXPECT_EQ(group(mixed, 16, 16), 4);
  // Short documents: no item is long, so one head a group.
  EXPECT_EQ(group(spread_lengths(257, 17, 496), 16, 16), 1);
  EXPECT_EQ(group({}, 16, 16), 1);
  EXPECT_EQ(group({0, 0}, 16, 16), 1);
}

// The backward's work list (host-built, bwd_params.h): every (document, key/value head, key block)
// exactly once with its count of visited query tiles, and within a document and head the key
// blocks in ascending order — the ordered dQ reduction's turns wait only on earlier items, so a
// persistent kernel that takes items in list order cannot deadlock.
void check_backward_work_list(const std::vector<int64_t>& lengths, int heads_kv, bool causal,
                              bool ordered) {
  const std::vector<int32_t> cu = cu_seqlens_from_lengths(lengths);
  const PackedLayout layout{cu.data(), int(lengths.size()), int64_t(cu.back()), heads_kv, heads_kv,
                            128};
  constexpr int kCtas = 5;
  const std::vector<sm90::bwd::WorkItem> items =
      sm90::bwd::backward_work_list(layout, causal, ordered, kCtas);
  std::vector<std::vector<int>> last_block(lengths.size(), std::vector<int>(heads_kv, -1));
  size_t expected = 0;
  for (int64_t l : lengths)
    expected += size_t((l + sm90::bwd::kBlockN - 1) / sm90::bwd::kBlockN) * heads_kv;
  ASSERT_EQ(items.size(), expected);
  for (const sm90::bwd::WorkItem& it : items) {
    ASSERT_GE(it.doc, 0);
    ASSERT_LT(it.doc, int(lengths.size()));
    const int64_t length = lengths[size_t(it.doc)];
    const int tiles = int((length + sm90::bwd::kBlockM - 1) / sm90::bwd::kBlockM);
    EXPECT_EQ(it.query_tiles, tiles - sm90::bwd::first_query_tile(it.key_block, causal));
    EXPECT_GT(it.query_tiles, 0);
    int& last = last_block[size_t(it.doc)][size_t(it.kv_head)];
    EXPECT_EQ(it.key_block, last + 1) << "document " << it.doc << ", head " << it.kv_head;
    last = it.key_block;
  }
  // The last kTailWaves waves of the CTAs, or all of an ordered list, longest first.
  const size_t tail =
      ordered ? items.size() : std::min(items.size(), size_t(sm90::bwd::kTailWaves * kCtas));
  for (size_t i = items.size() - tail + 1; i < items.size(); ++i)
    EXPECT_GE(items[i - 1].query_tiles, items[i].query_tiles) << "item " << i;
}

TEST(BackwardWorkList, EveryKeyBlockOnceInAscendingOrderPerDocumentAndHead) {
  for (bool ordered : {false, true}) {
    check_backward_work_list({4096, 4096, 4096}, 2, true, ordered);
    check_backward_work_list({5, 0, 1, 31, 33, 127, 129, 300, 1000}, 3, true, ordered);
    check_backward_work_list({5, 0, 1, 31, 33, 127, 129, 300, 1000}, 3, false, ordered);
    check_backward_work_list({0, 0}, 1, true, ordered);
  }
}

// The split backward's dQ pass list (dq_params.h): every (document, query head, 128-row query
// block) exactly once with the key blocks it visits (causal: up to the one holding its last row);
// before the tail, each (document, key/value head) contiguous, documents longest first and a
// group's items longest first; the last kTailWaves * ctas items longest first.
void check_dq_work_list(const std::vector<int64_t>& lengths, int heads_q, int heads_kv,
                        bool causal) {
  namespace dq = sm90::bwd::dqpass;
  const std::vector<int32_t> cu = cu_seqlens_from_lengths(lengths);
  const PackedLayout layout{cu.data(), int(lengths.size()), int64_t(cu.back()), heads_q, heads_kv,
                            128};
  constexpr int kCtas = 3;
  const std::vector<dq::DqWorkItem> items = dq::dq_work_list(layout, causal, kCtas);
  std::vector<std::vector<std::vector<int>>> seen(lengths.size());
  size_t expected = 0;
  for (size_t d = 0; d < lengths.size(); ++d) {
    const int blocks = int((lengths[d] + dq::kItemRows - 1) / dq::kItemRows);
    seen[d].assign(size_t(heads_q), std::vector<int>(size_t(blocks), 0));
    expected += size_t(blocks) * size_t(heads_q);
  }
  ASSERT_EQ(items.size(), expected);
  const int group = heads_q / heads_kv;
  for (const dq::DqWorkItem& it : items) {
    ASSERT_GE(it.doc, 0);
    ASSERT_LT(it.doc, int(lengths.size()));
    ASSERT_GE(it.head, 0);
    ASSERT_LT(it.head, heads_q);
    const int64_t length = lengths[size_t(it.doc)];
    ASSERT_GE(it.query_block, 0);
    ASSERT_LT(int64_t(it.query_block) * dq::kItemRows, length);
    ++seen[size_t(it.doc)][size_t(it.head)][size_t(it.query_block)];
    const int64_t last_row = std::min<int64_t>(length, (it.query_block + 1) * dq::kItemRows) - 1;
    const int64_t blocks = (length + sm90::bwd::kBlockN - 1) / sm90::bwd::kBlockN;
    EXPECT_EQ(it.key_blocks, causal ? last_row / sm90::bwd::kBlockN + 1 : blocks);
  }
  for (const auto& doc : seen)
    for (const auto& head : doc)
      for (int n : head) EXPECT_EQ(n, 1);
  const size_t tail = std::min(items.size(), size_t(sm90::bwd::kTailWaves * kCtas));
  const size_t body = items.size() - tail;
  std::vector<std::pair<int, int>> closed;  // (document, key/value head) groups already left
  for (size_t i = 1; i < body; ++i) {
    const dq::DqWorkItem &a = items[i - 1], &b = items[i];
    const std::pair<int, int> ga{a.doc, a.head / group}, gb{b.doc, b.head / group};
    if (ga == gb) {
      EXPECT_GE(a.key_blocks, b.key_blocks) << "item " << i;
      continue;
    }
    closed.push_back(ga);
    EXPECT_EQ(std::count(closed.begin(), closed.end(), gb), 0)
        << "item " << i << " reopens a group";
    EXPECT_GE(lengths[size_t(a.doc)], lengths[size_t(b.doc)]) << "item " << i;
  }
  for (size_t i = body + 1; i < items.size(); ++i)
    EXPECT_GE(items[i - 1].key_blocks, items[i].key_blocks) << "item " << i;
}

TEST(BackwardDqPassWorkList, EveryQueryBlockOnceGroupedByDocumentAndKeyValueHead) {
  check_dq_work_list({4096, 4096, 4096}, 4, 2, true);
  check_dq_work_list({4096, 4096, 4096}, 4, 4, false);
  check_dq_work_list({5, 0, 1, 31, 33, 127, 129, 300, 1000}, 6, 3, true);
  check_dq_work_list({5, 0, 1, 31, 33, 127, 129, 300, 1000}, 3, 3, false);
  check_dq_work_list({100000}, 2, 1, true);
  check_dq_work_list({0, 0}, 1, 1, true);
}

// Consumer warpgroup w stages its m64n64 dQ fragment (head-dim columns 64w..) at half w of the
// slot, dq_fragment_offset, each warp's part contiguous; the postprocess reads element (row, col)
// at dq_slot_offset: the two must be one layout, every offset written once.
TEST(BackwardDqSlot, StagedFragmentsAreTheSlotLayout) {
  constexpr int kRegs = sm90::wgmma::acc_regs(sm90::bwd::kHeadDim / 2);
  std::vector<int> hits(sm90::bwd::kDqSlotFloats, 0);
  for (int w = 0; w < 2; ++w)
    for (int t = 0; t < sm90::bwd::kDqFragThreads; ++t)
      for (int i = 0; i < kRegs; ++i) {
        const int at = w * sm90::bwd::kDqHalfFloats + sm90::bwd::dq_fragment_offset(t, i);
        const int col = w * sm90::bwd::kHeadDim / 2 + sm90::wgmma::acc_col(t, i);
        ASSERT_EQ(at, sm90::bwd::dq_slot_offset(sm90::wgmma::acc_row(t, i), col))
            << "warpgroup " << w << ", thread " << t << ", register " << i;
        // Each warp's bulk reduction covers its own contiguous kDqWarpFloats.
        ASSERT_EQ((at - w * sm90::bwd::kDqHalfFloats) / sm90::bwd::kDqWarpFloats,
                  t / sm90::bwd::kDqLanes)
            << "warpgroup " << w << ", thread " << t << ", register " << i;
        ++hits[size_t(at)];
      }
  EXPECT_TRUE(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }));
  // The postprocess walks the slot by float4: dq_slot_quad inverts dq_slot_offset.
  for (int at = 0; at < sm90::bwd::kDqSlotFloats; at += 4) {
    const sm90::bwd::DqQuad quad = sm90::bwd::dq_slot_quad(at);
    for (int e = 0; e < 4; ++e)
      ASSERT_EQ(sm90::bwd::dq_slot_offset(quad.row + 8 * (e / 2), quad.col + e % 2), at + e)
          << "offset " << at << ", element " << e;
  }
}

// Host only: the tiles an item sees whole (fwd::item_sees_tile_whole), where both kernels read K's
// and V's tile codes. Against a brute-force check of the item's rows: every row of the item sees
// every key of such a tile (causal safety); the forward kernel's rule (all but the first
// masked_tiles from the item's last) and the emulator's (emu::ForwardItems) agree with it; and the
// backward's query tiles of a key block go from token to tile codes once (the consumer's m_whole).
TEST(ForwardTiles, ItemsSeeTheirWholeTilesAsBothKernelsAndTheEmulatorAssume) {
  using sm90::fwd::kBlockM;
  using sm90::fwd::kBlockN;
  for (const bool causal : {true, false}) {
    const sm90::ScheduleGeometry g = sm90::fwd::schedule_geometry(causal);
    const TileShape shape{kBlockM, kBlockN};
    for (int32_t length = 1; length <= 1300; length += length < 400 ? 1 : 37) {
      SCOPED_TRACE(std::string(causal ? "causal" : "non-causal") + ", length " +
                   std::to_string(length));
      const emu::ForwardItems items(length, shape, causal);
      int64_t whole_pairs = 0;
      for (int32_t q = 0; q < sm90::schedule_query_tiles(length, kBlockM); ++q) {
        const int32_t first = sm90::schedule_first_row(length, q, g);
        ASSERT_EQ(items.item_of(std::max(first, 0)), first);
        const int32_t last = sm90::schedule_key_blocks(length, q, g) - 1;
        ASSERT_EQ(items.last_tile(first), last);
        for (int32_t kb = 0; kb <= last; ++kb) {
          const bool kernel_rule = kb <= last - sm90::fwd::masked_tiles(causal);
          bool sees_all = true;
          for (int32_t row = std::max(first, 0); row < std::min(first + kBlockM, length); ++row) {
            ASSERT_EQ(sm90::fwd::item_sees_tile_whole(length, row, kb, causal), kernel_rule)
                << "row " << row << ", tile " << kb;
            for (int32_t key = kb * kBlockN; key < (kb + 1) * kBlockN; ++key)
              sees_all = sees_all && key < length && (!causal || key <= row);
          }
          if (kernel_rule) ASSERT_TRUE(sees_all) << "item " << q << ", tile " << kb;
          ASSERT_EQ(items.visible(first, kb), kernel_rule) << "item " << q << ", tile " << kb;
          whole_pairs += kernel_rule;
        }
      }
      if (length >= 4 * kBlockN) EXPECT_GT(whole_pairs, 0);
      // The backward: from the first query tile of a key block on, token codes then tile codes.
      const int32_t tiles = (length + sm90::bwd::kBlockM - 1) / sm90::bwd::kBlockM;
      for (int32_t kb = 0; kb * kBlockN < length; ++kb) {
        bool seen = false;
        for (int32_t m = sm90::bwd::first_query_tile(kb, causal); m < tiles; ++m) {
          const bool whole =
              sm90::fwd::item_sees_tile_whole(length, m * sm90::bwd::kBlockM, kb, causal);
          ASSERT_TRUE(whole || !seen) << "key block " << kb << ", query tile " << m;
          seen = seen || whole;
        }
      }
    }
  }
}

}  // namespace
}  // namespace flamia
