// Host side of the GPU backward: the work list, argument checks, tensor maps, workspaces and the
// three launches (preprocess, main kernel, postprocess); and the training call's host helper.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "attention_internal.h"
#include "dq_params.h"

namespace flamia {
namespace sm90::bwd {

namespace {

// The last kTailWaves * ctas items of `items`, longest first by `length` (stable): the CTAs take
// the last items one at a time, and the longest of them would otherwise end alone.
template <typename Item, typename Length>
void sort_tail(std::vector<Item>& items, int ctas, Length length) {
  const size_t tail = std::min(items.size(), size_t(kTailWaves) * size_t(std::max(ctas, 1)));
  std::stable_sort(items.end() - std::ptrdiff_t(tail), items.end(),
                   [&](const Item& a, const Item& b) { return length(a) > length(b); });
}

}  // namespace

std::vector<WorkItem> backward_work_list(const PackedLayout& layout, bool causal, bool ordered,
                                         int ctas) {
  std::vector<WorkItem> items;
  for (int doc = 0; doc < layout.num_docs; ++doc) {
    const int length = int(layout.doc_length(doc));
    const int tiles = (length + kBlockM - 1) / kBlockM;
    const int blocks = (length + kBlockN - 1) / kBlockN;
    for (int head = 0; head < layout.heads_kv; ++head)
      for (int block = 0; block < blocks; ++block)
        items.push_back({doc, block, head, tiles - first_query_tile(block, causal)});
  }
  if (ordered) {
    // Longest items first: the CTAs running at one time hold the same key blocks of different
    // (document, head) pairs, so none waits for another's ordered dQ turn.
    std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) {
      return a.query_tiles > b.query_tiles;
    });
    return items;
  }
  // Longest documents first, each document's (head, key block) items together: the CTAs running
  // at one time then share a few documents' query tiles in L2 instead of streaming one each.
  const auto doc_tiles = [&](const WorkItem& w) {
    return (layout.doc_length(w.doc) + kBlockM - 1) / kBlockM;
  };
  std::stable_sort(items.begin(), items.end(), [&](const WorkItem& a, const WorkItem& b) {
    return doc_tiles(a) > doc_tiles(b);
  });
  // Each (document, head) starts with its longest item, so in that order the last group's
  // longest would start among the last few and end alone. The tail, longest first, still holds
  // only a few groups' items; stable, so a group's key blocks stay in ascending order.
  sort_tail(items, ctas, [](const WorkItem& w) { return w.query_tiles; });
  return items;
}

namespace dqpass {

std::vector<DqWorkItem> dq_work_list(const PackedLayout& layout, bool causal, int ctas) {
  const auto longer = [](const DqWorkItem& a, const DqWorkItem& b) {
    return a.key_blocks > b.key_blocks;
  };
  std::vector<DqWorkItem> items;
  for (int doc = 0; doc < layout.num_docs; ++doc) {
    const int length = int(layout.doc_length(doc));
    const int blocks = (length + kBlockN - 1) / kBlockN;
    for (int kv_head = 0; kv_head < layout.heads_kv; ++kv_head) {
      const size_t first = items.size();
      for (int head = kv_head * layout.group(); head < (kv_head + 1) * layout.group(); ++head)
        for (int qb = 0; qb * kItemRows < length; ++qb) {
          // Causal: the key blocks up to the one holding the item's last row.
          const int last_row = std::min(length - 1, (qb + 1) * kItemRows - 1);
          items.push_back({doc, qb, head, causal ? last_row / kBlockN + 1 : blocks});
        }
      std::stable_sort(items.begin() + std::ptrdiff_t(first), items.end(), longer);
    }
  }
  // Documents longest first; stable, so each (document, key/value head) stays together.
  const auto doc_length = [&](const DqWorkItem& w) { return layout.doc_length(w.doc); };
  std::stable_sort(items.begin(), items.end(), [&](const DqWorkItem& a, const DqWorkItem& b) {
    return doc_length(a) > doc_length(b);
  });
  sort_tail(items, ctas, [](const DqWorkItem& w) { return w.key_blocks; });
  return items;
}

}  // namespace dqpass
}  // namespace sm90::bwd

// kAuto's crossovers in backward steps per query tile (docs/PERF.md item 228: 65,536 tokens of
// equal causal documents, 16 heads, where a document of L tokens has (L / 128 + 1) / 2). mxfp8:
// the split read 0.78-0.97x the fused backward's time up to 1,024-token documents (4.5) and 1.03x
// at 2,048 (8.5); mxfp8-qk16: 0.82-0.94x up to 512 (2.5), 1.01x at 1,024.
constexpr double kSplitStepsPerTileMxfp8 = 5.5;
constexpr double kSplitStepsPerTileQk16 = 3.5;

bool backward_runs_split(const PackedLayout& layout, const GpuAttentionOptions& options) {
  if (options.diagnostics) return false;  // the statistics build: fused
  if (options.deterministic || options.backward_form == BackwardForm::kSplit) return true;
  if (options.backward_form == BackwardForm::kFused) return false;
  using sm90::bwd::kBlockM;
  using sm90::bwd::kBlockN;
  const bool causal = options.attention.causal;
  double steps = 0, tiles = 0;  // per query head
  for (int doc = 0; doc < layout.num_docs; ++doc) {
    const int64_t length = layout.doc_length(doc);
    const int64_t doc_tiles = (length + kBlockM - 1) / kBlockM;
    for (int64_t block = 0; block * kBlockN < length; ++block)
      steps += double(doc_tiles - sm90::bwd::first_query_tile(int32_t(block), causal));
    tiles += double(doc_tiles);
  }
  const double crossover =
      options.recipe == Recipe::kMxfp8Qk16 ? kSplitStepsPerTileQk16 : kSplitStepsPerTileMxfp8;
  return tiles > 0 && steps <= crossover * tiles;
}

namespace {

using namespace gpu_attention;
using sm90::bwd::kBlockM;
using sm90::bwd::kBlockN;
using sm90::fwd::ScoreOperand;

static_assert(kGpuBackwardTiles.block_m == kBlockM && kGpuBackwardTiles.block_n == kBlockN,
              "the emulator's tiles must be the kernel's");

// The main kernel's instantiation for the mask, the dQ addition, diagnostics and the rotation
// (mxfp8 only: check_gpu_support); `split`: the split backward's dK/dV pass.
template <ScoreOperand kScore, bool kCausal>
void launch_main_kernel(const sm90::bwd::Params& p, int ctas, bool split, cudaStream_t stream) {
  using namespace sm90::bwd;
  if (p.diagnostics != nullptr) {
    launch_backward_diagnostics<kScore, kCausal>(p, ctas, stream);
  } else if (p.dq_turns != nullptr) {
    reject("the deterministic mode runs the split backward");
  } else if (p.dk_rotated != nullptr) {
    if constexpr (kScore == ScoreOperand::kE4m3) {
      (split ? launch_backward_rotated<kCausal, DqAddition::kNone>
             : launch_backward_rotated<kCausal, DqAddition::kBulk>)(p, ctas, stream);
    } else {
      reject("Hadamard rotation is built for mxfp8 only");
    }
  } else {
    (split ? launch_backward<kScore, kCausal, DqAddition::kNone>
           : launch_backward<kScore, kCausal, DqAddition::kBulk>)(p, ctas, stream);
  }
}

// ... and for the recipe.
void launch_main_kernel(const sm90::bwd::Params& p, int ctas, bool qk16, bool causal, bool split,
                        cudaStream_t stream) {
  if (qk16) {
    (causal ? launch_main_kernel<ScoreOperand::kBf16, true>
            : launch_main_kernel<ScoreOperand::kBf16, false>)(p, ctas, split, stream);
  } else {
    (causal ? launch_main_kernel<ScoreOperand::kE4m3, true>
            : launch_main_kernel<ScoreOperand::kE4m3, false>)(p, ctas, split, stream);
  }
}

// A BF16 output for the postprocess and the dK rotation, which store four elements at a time.
sm90::bwd::Bf16Rows bf16_rows(const TokenTensor<uint16_t>& t) {
  constexpr int kQuad = 4;  // BF16 elements of one 8-byte store
  return {t.data, t.stride_token, t.stride_head, bf16_stores_of(t, kQuad)};
}

// `codes`: whether the kernels read the operand's codes (not Q's and K's for mxfp8-qk16, whose
// score products read the BF16 inputs).
void require_codes(const DeviceE4M3Operand& op, const std::string& name, bool codes = true) {
  if (codes) require_device_pointer(op.codes, kDeviceAlignment, name + " codes");
  require_device_pointer(op.codes_t, kDeviceAlignment, name + " codes_t");
  require_device_pointer(op.exponents, 1, name + " exponents");
}

}  // namespace

void GpuAttention::backward(const DeviceAttentionInputs& in, const DeviceQuantizedAttention& quant,
                            TokenTensor<const uint16_t> o, const float* lse,
                            const DeviceAttentionGradients& grads, cudaStream_t stream) {
  Impl& m = *impl_;
  const PackedLayout& pl = m.layout;
  if (in.layout.cu_seqlens == nullptr || !same_layout(in.layout, pl))
    reject("the inputs' layout differs from the one this GpuAttention was built for");
  if (in.cu_seqlens == nullptr) reject("device cu_seqlens is null");
  const bool qk16 = m.options.recipe == Recipe::kMxfp8Qk16;
  if (qk16) require_bf16_score_operands(in, pl);
  require_codes(quant.q, "Q", !qk16);
  require_codes(quant.k, "K", !qk16);
  if (!qk16) require_device_pointer(quant.k.codes_tiles, kDeviceAlignment, "K codes_tiles");
  require_codes(quant.dout, "dO");
  require_device_pointer(quant.v.codes, kDeviceAlignment, "V codes");
  require_device_pointer(quant.v.exponents, 1, "V exponents");
  require_device_pointer(o.data, sizeof(uint64_t), "O");
  validate_view("O", o, pl.tokens, pl.heads_q, pl.head_dim);
  if (o.stride_token % 4 != 0 || o.stride_head % 4 != 0)
    reject("O's token and head strides must be multiples of 4 elements (8-byte loads)");
  require_device_pointer(lse, sizeof(float), "LSE");
  require_bf16_output(grads.dq, pl, pl.heads_q, "dQ");
  require_bf16_output(grads.dk, pl, pl.heads_kv, "dK");
  require_bf16_output(grads.dv, pl, pl.heads_kv, "dV");

  if (!m.backward) {
    auto b = std::make_unique<BackwardState>();
    // The split backward (BackwardForm): its dQ pass sums dQ in registers in the ordered mode's
    // order (dq_params.h), so it serves the deterministic mode. The statistics build keeps the
    // ordered dQ additions for it, whose turns need the ordered work list.
    const bool split = backward_runs_split(pl, m.options);
    const bool ordered = m.options.deterministic && m.options.diagnostics;
    const std::vector<sm90::bwd::WorkItem> items =
        sm90::bwd::backward_work_list(pl, m.options.attention.causal, ordered, multiprocessors());
    if (items.size() > size_t(INT32_MAX)) reject("too many backward work items");
    b->num_items = int(items.size());
    b->ctas = std::min(b->num_items, multiprocessors());
    b->items = cuda::DeviceBuffer::upload(items, stream);
    b->counter = cuda::DeviceBuffer(sizeof(int));
    const int64_t rows = pl.tokens * pl.heads_q;
    b->delta = cuda::DeviceBuffer(size_t(std::max<int64_t>(rows, 1)) * sizeof(float));
    b->split = split;
    b->dq_slots = sm90::bwd::dq_tile_slots(pl.tokens, pl.num_docs);
    const size_t slots = size_t(b->dq_slots) * pl.heads_q;
    // The kernel indexes the slots with 32 bits (StepItem::dq_slot0).
    if (slots > size_t(INT32_MAX)) reject("too many dQ accumulator slots (heads x query tiles)");
    b->dq_zeroed = cuda::DeviceBuffer(sizeof(int));
    FLAMIA_CUDA_CHECK(cudaMemsetAsync(b->dq_zeroed.get(), 0, sizeof(int), stream));
    if (b->split) {
      const std::vector<sm90::bwd::dqpass::DqWorkItem> list =
          sm90::bwd::dqpass::dq_work_list(pl, m.options.attention.causal, multiprocessors());
      if (list.size() > size_t(INT32_MAX)) reject("too many dQ pass work items");
      b->dq_pass_items = int(list.size());
      b->dq_pass_list = cuda::DeviceBuffer::upload(list, stream);
      b->dq_pass_counter = cuda::DeviceBuffer(sizeof(int));
    } else {
      b->dq_accum = cuda::DeviceBuffer(slots * sm90::bwd::kDqSlotFloats * sizeof(float));
      if (m.options.deterministic) b->dq_turns = cuda::DeviceBuffer(slots * sizeof(int));
    }
    if (m.options.hadamard)
      b->dk_rotated = cuda::DeviceBuffer(size_t(std::max<int64_t>(pl.tokens, 1)) * pl.heads_kv *
                                         pl.head_dim * sizeof(float));
    if (m.options.diagnostics) {
      b->diagnostics = cuda::DeviceBuffer(sizeof(sm90::bwd::DiagnosticCounters));
      b->row_sum = cuda::DeviceBuffer(size_t(std::max<int64_t>(rows, 1)) * sizeof(float));
      b->row_abs = cuda::DeviceBuffer(size_t(std::max<int64_t>(rows, 1)) * sizeof(float));
    }
    m.backward = std::move(b);
  }
  BackwardState& b = *m.backward;
  if (pl.tokens == 0) return;

  const QuantLayout lq = QuantLayout::make(pl.tokens, pl.heads_q, pl.head_dim, pl.num_docs);
  const QuantLayout lkv = QuantLayout::make(pl.tokens, pl.heads_kv, pl.head_dim, pl.num_docs);
  sm90::bwd::PreprocessParams pre;
  pre.dout_codes = quant.dout.codes;
  pre.dout_exponents = quant.dout.exponents;
  pre.tokens_padded = lq.tokens_padded;
  pre.o = o.data;
  pre.o_stride_token = o.stride_token;
  pre.o_stride_head = o.stride_head;
  pre.delta = b.delta.get<float>();
  pre.tokens = pl.tokens;
  pre.heads_q = pl.heads_q;
  pre.dq_clear = b.dq_clear();
  sm90::bwd::launch_preprocess(pre, stream);

  sm90::bwd::Params p{};  // zeroed: the maps a recipe does not use (K's tile codes for qk16)
  if (qk16) {
    p.map_q = bf16_map(in.q, pl.tokens, pl.heads_q, kBlockM);
    p.map_k = bf16_map(in.k, pl.tokens, pl.heads_kv, kBlockN);
  } else {
    p.map_q = codes_map(quant.q.codes, pl.tokens, pl.heads_q, kBlockM);
    p.map_k = codes_map(quant.k.codes, pl.tokens, pl.heads_kv, kBlockN);
    p.map_k_tiles = codes_map(quant.k.codes_tiles, pl.tokens, pl.heads_kv, kBlockN);
  }
  p.map_v = codes_map(quant.v.codes, pl.tokens, pl.heads_kv, kBlockN);
  p.map_dout = codes_map(quant.dout.codes, pl.tokens, pl.heads_q, kBlockM);
  p.map_qt = codes_t_map(quant.q.codes_t, lq, kBlockM);
  p.map_doutt = codes_t_map(quant.dout.codes_t, lq, kBlockM);
  p.map_kt = codes_t_map(quant.k.codes_t, lkv, kBlockN);
  p.items = b.items.get<sm90::bwd::WorkItem>();
  p.num_items = b.num_items;
  p.counter = b.counter.get<int>();
  p.cu_seqlens = in.cu_seqlens;
  p.q_exponents = quant.q.exponents;
  p.k_exponents = quant.k.exponents;
  p.v_exponents = quant.v.exponents;
  p.dout_exponents = quant.dout.exponents;
  p.tokens_padded = lq.tokens_padded;
  p.lse = lse;
  p.delta = b.delta.get<float>();
  p.dq_accum = b.dq_accum.get<float>();
  p.dq_slots = b.dq_slots;
  if (m.options.deterministic && !b.split) {
    p.dq_turns = b.dq_turns.get<int>();
    FLAMIA_CUDA_CHECK(cudaMemsetAsync(p.dq_turns, 0, b.dq_turns.bytes(), stream));
  }
  if (m.options.diagnostics) {
    p.diagnostics = b.diagnostics.get<sm90::bwd::DiagnosticCounters>();
    p.row_sum = b.row_sum.get<float>();
    p.row_abs = b.row_abs.get<float>();
    for (const cuda::DeviceBuffer* d : {&b.diagnostics, &b.row_sum, &b.row_abs})
      FLAMIA_CUDA_CHECK(cudaMemsetAsync(d->get(), 0, d->bytes(), stream));
  }
  p.dk = grads.dk.data;
  p.dv = grads.dv.data;
  p.dk_stride_token = grads.dk.stride_token;
  p.dk_stride_head = grads.dk.stride_head;
  p.dv_stride_token = grads.dv.stride_token;
  p.dv_stride_head = grads.dv.stride_head;
  // With rotation the main kernel writes dV alone (dK: the rotation pass).
  p.wide_stores = (m.options.hadamard || bf16_stores_of(grads.dk, sm90::kWideStoreElems)) &&
                  bf16_stores_of(grads.dv, sm90::kWideStoreElems);
  p.tokens = pl.tokens;
  p.heads_q = pl.heads_q;
  p.group = pl.group();
  p.scale_log2 = m.options.attention.scale_log2_for(pl.head_dim);
  p.scale = float(m.options.attention.scale_for(pl.head_dim));
  if (m.options.hadamard) p.dk_rotated = b.dk_rotated.get<float>();
  if (b.num_items > 0) {
    FLAMIA_CUDA_CHECK(cudaMemsetAsync(p.counter, 0, sizeof(int), stream));
    launch_main_kernel(p, b.ctas, qk16, m.options.attention.causal, b.split, stream);
  }

  if (b.split) {
    sm90::bwd::dqpass::DqParams d{};
    d.map_q = p.map_q;
    d.map_dout = p.map_dout;
    d.map_k = p.map_k;
    d.map_k_tiles = p.map_k_tiles;
    d.map_v = p.map_v;
    d.map_kt = p.map_kt;
    d.items = b.dq_pass_list.get<sm90::bwd::dqpass::DqWorkItem>();
    d.num_items = b.dq_pass_items;
    d.counter = b.dq_pass_counter.get<int>();
    // The main kernel's operands, and dQ's output view.
    d.cu_seqlens = p.cu_seqlens;
    d.q_exponents = p.q_exponents;
    d.k_exponents = p.k_exponents;
    d.v_exponents = p.v_exponents;
    d.dout_exponents = p.dout_exponents;
    d.tokens_padded = p.tokens_padded;
    d.lse = p.lse;
    d.delta = p.delta;
    d.tokens = p.tokens;
    d.group = p.group;
    d.scale_log2 = p.scale_log2;
    d.scale = p.scale;
    d.rotate = m.options.hadamard;
    d.dq = grads.dq.data;
    d.dq_stride_token = grads.dq.stride_token;
    d.dq_stride_head = grads.dq.stride_head;
    if (d.num_items > 0) {
      FLAMIA_CUDA_CHECK(cudaMemsetAsync(d.counter, 0, sizeof(int), stream));
      using sm90::bwd::dqpass::launch_dq_pass;
      const bool causal = m.options.attention.causal;
      const auto launch = qk16 ? (causal ? launch_dq_pass<ScoreOperand::kBf16, true>
                                         : launch_dq_pass<ScoreOperand::kBf16, false>)
                               : (causal ? launch_dq_pass<ScoreOperand::kE4m3, true>
                                         : launch_dq_pass<ScoreOperand::kE4m3, false>);
      launch(d, std::min(d.num_items, multiprocessors()), stream);
    }
  } else {
    sm90::bwd::PostprocessParams post;
    post.dq_accum = b.dq_accum.get<float>();
    post.dq_slots = b.dq_slots;
    post.cu_seqlens = in.cu_seqlens;
    post.num_docs = pl.num_docs;
    post.dq = bf16_rows(grads.dq);
    post.tokens = pl.tokens;
    post.heads_q = pl.heads_q;
    post.scale = p.scale;
    post.rotate = m.options.hadamard;
    post.dq_zeroed = b.dq_zeroed.get<int>();
    sm90::bwd::launch_postprocess(post, stream);
  }
  if (m.options.hadamard) {
    sm90::bwd::RotateDkParams rot;
    rot.dk_rotated = p.dk_rotated;
    rot.dk = bf16_rows(grads.dk);
    rot.tokens = pl.tokens;
    rot.heads_kv = pl.heads_kv;
    sm90::bwd::launch_rotate_dk(rot, stream);
  }
}

void GpuAttention::backward(const DeviceAttentionInputs& in, TokenTensor<const uint16_t> o,
                            const float* lse, const DeviceAttentionGradients& grads,
                            cudaStream_t stream) {
  Impl& m = *impl_;
  if (!m.quant) reject("the training call's backward needs a BF16 forward on this object first");
  if (in.layout.cu_seqlens == nullptr || !same_layout(in.layout, m.layout))
    reject("the inputs' layout differs from the one this GpuAttention was built for");
  if (in.dout.data == nullptr) reject("dO is null");
  DeviceAttentionInputs dout_only = in;  // Q, K, V: the forward's codes
  dout_only.q = dout_only.k = dout_only.v = {};
  quantize_gpu(dout_only, m.quantize_options(), m.quant->view(), stream);
  backward(in, m.quant->view(), o, lse, grads, stream);
}

EmulatorStats GpuAttention::backward_diagnostics() const {
  const Impl& m = *impl_;
  if (!m.options.diagnostics) reject("backward_diagnostics needs GpuAttentionOptions::diagnostics");
  if (!m.backward) reject("no backward has run yet");
  FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
  const BackwardState& b = *m.backward;
  EmulatorStats st;
  if (b.diagnostics.bytes() == 0) return st;
  const auto c = b.diagnostics.download<sm90::bwd::DiagnosticCounters>().front();
  st.ds_entries = int64_t(c.ds_entries);
  st.ds_nonzero = int64_t(c.ds_nonzero);
  st.ds_zero_dq = int64_t(c.ds_zero_dq);
  st.ds_zero_dk = int64_t(c.ds_zero_dk);
  st.pt_underflow = int64_t(c.pt_underflow);
  const std::vector<float> sum = b.row_sum.download<float>(), abs = b.row_abs.download<float>();
  for (int h = 0; h < m.layout.heads_q; ++h)
    for (int64_t t = 0; t < m.layout.tokens; ++t) {
      const size_t i = size_t(h * m.layout.tokens + t);
      if (abs[i] > 0.0f) st.row_residual.push_back(std::fabs(double(sum[i])) / abs[i]);
    }
  return st;
}

AttentionOutputs<float> training_gpu_to_host(const AttentionBatch& batch,
                                             const GpuAttentionOptions& options,
                                             EmulatorStats* diagnostics) {
  const PackedLayout pl = batch.layout();
  if (batch.dout.size() != batch.q.size()) throw Error("training_gpu_to_host: the batch has no dO");
  GpuAttentionOptions run_options = options;
  run_options.diagnostics |= diagnostics != nullptr;
  GpuAttention attention(pl, run_options);
  const int dim = pl.head_dim;
  const DeviceBatch dev(batch, /*with_dout=*/true);
  const DeviceAttentionInputs& in = dev.in;
  const size_t q_elems = size_t(pl.tokens) * pl.heads_q * dim;
  const size_t kv_elems = size_t(pl.tokens) * pl.heads_kv * dim;
  const cuda::DeviceBuffer o(q_elems * sizeof(uint16_t)), dq(q_elems * sizeof(uint16_t));
  const cuda::DeviceBuffer dk(kv_elems * sizeof(uint16_t)), dv(kv_elems * sizeof(uint16_t));
  const cuda::DeviceBuffer lse(size_t(pl.tokens) * pl.heads_q * sizeof(float));

  DeviceAttentionOutputs out;
  out.o = dense_view<uint16_t>(o.get<uint16_t>(), pl.heads_q, dim);
  out.lse = lse.get<float>();
  attention.forward(in, out, nullptr);
  attention.quantizer_status().throw_if_any();  // Q, K, V (synchronises)
  DeviceAttentionGradients grads;
  grads.dq = dense_view<uint16_t>(dq.get<uint16_t>(), pl.heads_q, dim);
  grads.dk = dense_view<uint16_t>(dk.get<uint16_t>(), pl.heads_kv, dim);
  grads.dv = dense_view<uint16_t>(dv.get<uint16_t>(), pl.heads_kv, dim);
  attention.backward(in, dense_view<const uint16_t>(o.get<uint16_t>(), pl.heads_q, dim),
                     lse.get<float>(), grads, nullptr);
  attention.quantizer_status().throw_if_any();  // dO (synchronises)
  if (diagnostics != nullptr) *diagnostics = attention.backward_diagnostics();

  AttentionOutputs<float> result;
  result.o = download_bf16(o);
  result.lse = lse.download<float>();
  result.dq = download_bf16(dq);
  result.dk = download_bf16(dk);
  result.dv = download_bf16(dv);
  return result;
}

}  // namespace flamia
