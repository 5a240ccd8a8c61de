// The forward attention's work list, built on the GPU once per call (DESIGN §6 "Scheduling").
//
// A work item is one (document, query head, query tile) of a packed batch; query tiles are
// document-relative and zero-length documents have none. With ScheduleGeometry::row_unit set, a
// document's tiles end at its last row_unit-rounded row and the first tile starts up to
// block_m - row_unit rows before the document: the partial tile is the first, which sees the fewest
// keys, instead of the last, which sees them all (the forward's 192-row tiles of three 64-row
// warpgroups; 4096 tokens leave one warpgroup's rows for a partial tile). An item's cost is its
// number of visible key blocks. build_schedule writes the items sorted by that cost, longest first
// (LPT), so persistent CTAs that take items in order through an atomic counter finish close
// together; or, with ScheduleGeometry::head_group, by document: documents sorted by their longest
// tile, longest first, each document's items contiguous, in groups of head_group heads, each
// group's tiles longest first. A tile's heads (of its group) are adjacent and in head order (the
// heads of a GQA group then share K/V in L2); the order of tiles (documents) of equal cost may
// differ from call to call.
//
// Plain C++: usable from .cc files; the inline helpers also compile as device code under nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "flamia/common.h"
#include "flamia/packed.h"

namespace flamia::sm90 {

struct alignas(16) WorkItem {  // 16 bytes, read by the kernel with one vector load
  int32_t doc;
  int32_t first_row;   // the tile's first document-relative row (schedule_first_row)
  int32_t head;        // query head
  int32_t key_blocks;  // the sort key (visible key blocks)
};
static_assert(sizeof(WorkItem) == 16, "one 16-byte vector load per item");

struct ScheduleGeometry {
  int block_m = 128, block_n = 128;
  bool causal = true;
  int row_unit = 0;  // 0: tiles start at the document's first row; else a divisor of block_m
  // 0: items longest first. Else by document, in groups of this many heads (a divisor of the
  // heads; document_head_group picks it): the CTAs running at one time then hold the tiles of a
  // few heads of a document or two, which share their K/V in L2, where longest-first items would
  // each stream a different (document, head)'s.
  int head_group = 0;
};

// Rows of query tile 0 before the document (0 without row_unit): block_m minus the document's
// length rounded up to row_unit, modulo block_m.
FLAMIA_HD int32_t schedule_lead_rows(int32_t doc_len, const ScheduleGeometry& g) {
  if (g.row_unit <= 0) return 0;
  const int64_t rounded = (int64_t(doc_len) + g.row_unit - 1) / g.row_unit * g.row_unit;
  return int32_t((g.block_m - rounded % g.block_m) % g.block_m);
}

// The document-relative first row of query tile `q_tile` (negative for a leading partial tile).
FLAMIA_HD int32_t schedule_first_row(int32_t doc_len, int32_t q_tile, const ScheduleGeometry& g) {
  return int32_t(int64_t(q_tile) * g.block_m - schedule_lead_rows(doc_len, g));
}

// Query tiles of a document of `doc_len` tokens: ceil(doc_len / block_m), with or without a lead
// (row_unit divides block_m, so the rounded length needs as many tiles).
FLAMIA_HD int32_t schedule_query_tiles(int32_t doc_len, int block_m) {
  return int32_t((int64_t(doc_len) + block_m - 1) / block_m);
}

// Visible key blocks of query tile `q_tile` of a document of `doc_len` tokens: causal, the keys up
// to the tile's last row (clamped to the document); otherwise the whole document.
FLAMIA_HD int32_t schedule_key_blocks(int32_t doc_len, int32_t q_tile, const ScheduleGeometry& g) {
  const int64_t tile_end = int64_t(schedule_first_row(doc_len, q_tile, g)) + g.block_m;
  const int64_t keys = g.causal && tile_end < doc_len ? tile_end : int64_t(doc_len);
  return int32_t((keys + g.block_n - 1) / g.block_n);
}

// Host, on a layout that validate() accepted (layout.cu_seqlens is host memory); each throws
// flamia::Error on a non-positive block size.
// Items of the layout: query tiles of every document times layout.heads_q.
int64_t count_work_items(const PackedLayout& layout, const ScheduleGeometry& g);
// The largest key_blocks of any item (0 without items): ScheduleArgs::max_key_blocks.
int max_key_blocks(const PackedLayout& layout, const ScheduleGeometry& g);
// The head_group for a layout on `ctas` persistent CTAs (at most the items): the fewest heads (a
// divisor of heads_q, and a multiple of a GQA group's query heads) whose by-document order keeps
// the CTAs' finishing times even, or 0 (longest first) if none does. A heuristic estimate: for
// each document's last group, how long its longest item, which starts the group, runs past the
// work queued after it on the other ctas - 1 CTAs (work already running on them is ignored), at
// most kDocumentOrderSlack of a CTA's share of all the work (or one key block, the granularity of
// any order). Long documents with few heads a group would otherwise end the list with one CTA
// running alone.
constexpr double kDocumentOrderSlack = 0.01;
int document_head_group(const PackedLayout& layout, const ScheduleGeometry& g, int ctas);
// Device workspace build_schedule needs (bytes; 0 for all but very long documents, and then
// ScheduleArgs::workspace may be null).
size_t schedule_workspace_bytes(const PackedLayout& layout, const ScheduleGeometry& g);

struct ScheduleArgs {
  const int32_t* cu_seqlens = nullptr;  // device
  int num_docs = 0, heads = 0;
  ScheduleGeometry geometry;
  int64_t num_items = 0;      // count_work_items; at most INT_MAX (the counter is an int)
  int max_key_blocks = 0;     // largest key_blocks of any item (host-computed)
  WorkItem* items = nullptr;  // device [num_items], written sorted; 16-byte aligned
  int* counter = nullptr;     // device, reset to 0 by build_schedule (the kernel's atomic)
  void* workspace = nullptr;  // device, schedule_workspace_bytes
};

// Enqueues the build on `stream` (no host synchronisation; validates args on the host, throws
// flamia::Error). Without items it only resets the counter. The device cu_seqlens must describe
// the layout num_items and max_key_blocks were computed from; if it does not, the kernel still
// writes nothing outside items[0, num_items) and the buckets, but the list is then incomplete.
void build_schedule(const ScheduleArgs& args, cudaStream_t stream);

}  // namespace flamia::sm90
