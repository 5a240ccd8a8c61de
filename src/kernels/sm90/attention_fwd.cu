// Host side of the GPU forward: argument checks, tensor maps, the GPU-built work list and the
// launch (flamia/attention_gpu.h).
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "attention_internal.h"

namespace flamia {
namespace {

using namespace gpu_attention;
using sm90::fwd::kBlockM;
using sm90::fwd::kBlockN;
using sm90::fwd::ScoreOperand;

static_assert(kKeyTileTokens == kBlockN, "K's and V's tile codes are the forward's key tiles");
static_assert(kGpuForwardTiles.block_m == kBlockM && kGpuForwardTiles.block_n == kBlockN,
              "the emulator's tiles must be the kernel's");

double forward_flops(const PackedLayout& pl, bool causal) {
  double pairs = 0;
  for (int d = 0; d < pl.num_docs; ++d) pairs += visible_pairs(pl.doc_length(d), causal);
  return attention_forward_flops(pairs, pl.head_dim, pl.heads_q);
}

// The forward's clear of the dQ accumulator is paced to end within about half of the kernel's
// shortest plausible duration (its FLOPs at kFastestForwardTflops): the pause between a clearing
// warp's stores.
constexpr double kFastestForwardTflops = 1000;
constexpr double kClearShare = 0.5;
constexpr double kMaxClearPauseNs = 10000;
uint32_t clear_pause_ns(double flops, int64_t vectors, int ctas) {
  const double warps = double(ctas) * sm90::fwd::kClearWarps;
  const double stores = std::ceil(double(vectors) / (warps * sm90::kWarpThreads));
  if (stores < 1) return 0;
  constexpr double kFlopsPerNs = kFastestForwardTflops * 1e3;
  return uint32_t(std::min(kClearShare * flops / kFlopsPerNs / stores, kMaxClearPauseNs));
}

}  // namespace

void check_gpu_support(const PackedLayout& layout, const GpuAttentionOptions& options) {
  validate(layout);
  if (options.recipe != Recipe::kMxfp8 && options.recipe != Recipe::kMxfp8Qk16)
    reject(std::string("recipe ") + to_string(options.recipe) +
           " runs on the CPU emulator only; the GPU kernels implement mxfp8 and mxfp8-qk16");
  if (options.policy == ScalePolicy::kVGroup16)
    reject(
        "policy vgroup16 (per-channel V scales) cannot be folded into P; it is an emulator "
        "baseline");
  if (options.hadamard && options.recipe != Recipe::kMxfp8)
    reject(std::string("Hadamard rotation is built for mxfp8: ") + to_string(options.recipe) +
           "'s score product reads the unrotated BF16 inputs");
  if (layout.head_dim != kHeadDim)
    reject("head dim " + std::to_string(layout.head_dim) + " is not built; the kernels use " +
           std::to_string(kHeadDim));
  if (options.deterministic && !options.diagnostics &&
      options.backward_form == BackwardForm::kFused)
    reject(
        "deterministic dQ needs the split backward: backward_form kFused adds dQ by unordered "
        "atomics (use kAuto or kSplit)");
}

GpuAttention::GpuAttention(const PackedLayout& layout, const GpuAttentionOptions& options)
    : impl_(std::make_unique<Impl>()) {
  check_gpu_support(layout, options);
  Impl& m = *impl_;
  m.cu_seqlens.assign(layout.cu_seqlens, layout.cu_seqlens + layout.num_docs + 1);
  m.layout = layout;
  m.layout.cu_seqlens = m.cu_seqlens.data();
  m.options = options;
  m.geometry = sm90::fwd::schedule_geometry(options.attention.causal);
  m.items = sm90::count_work_items(m.layout, m.geometry);
  if (m.items > INT32_MAX) reject("too many work items (" + std::to_string(m.items) + ")");
  m.max_key_blocks = sm90::max_key_blocks(m.layout, m.geometry);
  m.forward_flops = forward_flops(m.layout, options.attention.causal);
  m.item_buffer =
      cuda::DeviceBuffer(size_t(std::max<int64_t>(m.items, 1)) * sizeof(sm90::WorkItem));
  m.counter = cuda::DeviceBuffer(sizeof(int));
  m.workspace =
      cuda::DeviceBuffer(std::max<size_t>(sm90::schedule_workspace_bytes(m.layout, m.geometry), 1));
  m.ctas = int(std::min<int64_t>(m.items, multiprocessors()));
  // Measured (docs/PERF.md, items 140 and 141): the forward's DRAM reads near its compulsory
  // ~0.54 GB (16x4096 1.54 -> 0.71 GB, 1x65536 6.09 -> 0.69), and the kernel 1-8 % faster at the
  // power cap.
  m.geometry.head_group = sm90::document_head_group(m.layout, m.geometry, m.ctas);
}

GpuAttention::~GpuAttention() = default;

int GpuAttention::work_items() const {
  return int(impl_->items);
}
int GpuAttention::ctas() const {
  return impl_->ctas;
}

void GpuAttention::forward(const DeviceAttentionInputs& in, const DeviceQuantizedAttention& quant,
                           const DeviceAttentionOutputs& out, cudaStream_t stream) const {
  impl_->forward(in, quant, out, {}, stream);
}

void GpuAttention::Impl::forward(const DeviceAttentionInputs& in,
                                 const DeviceQuantizedAttention& quant,
                                 const DeviceAttentionOutputs& out, const sm90::DqClear& dq_clear,
                                 cudaStream_t stream) const {
  const Impl& m = *this;
  const PackedLayout& pl = m.layout;
  if (in.layout.cu_seqlens == nullptr || !same_layout(in.layout, pl))
    reject("the inputs' layout differs from the one this GpuAttention was built for");
  if (in.cu_seqlens == nullptr) reject("device cu_seqlens is null");
  const bool qk16 = m.options.recipe == Recipe::kMxfp8Qk16;
  constexpr size_t kAlign = kDeviceAlignment;
  if (qk16) {
    require_bf16_score_operands(in, pl);
  } else {
    require_device_pointer(quant.q.codes, kAlign, "Q codes");
    require_device_pointer(quant.k.codes, kAlign, "K codes");
    require_device_pointer(quant.k.codes_tiles, kAlign, "K codes_tiles");
    require_device_pointer(quant.q.exponents, 1, "Q exponents");
    require_device_pointer(quant.k.exponents, 1, "K exponents");
  }
  require_device_pointer(quant.v.codes_t, kAlign, "V codes_t");
  require_device_pointer(quant.v.codes_t_tiles, kAlign, "V codes_t_tiles");
  require_device_pointer(quant.v.exponents, 1, "V exponents");
  require_bf16_output(out.o, pl, pl.heads_q, "O");
  require_device_pointer(out.lse, sizeof(float), "LSE");
  if (m.items == 0) return;  // no tokens: no backward work either

  const QuantLayout lq = QuantLayout::make(pl.tokens, pl.heads_q, pl.head_dim, pl.num_docs);
  const QuantLayout lkv = QuantLayout::make(pl.tokens, pl.heads_kv, pl.head_dim, pl.num_docs);
  sm90::fwd::Params p;
  if (qk16) {
    p.map_q = bf16_map(in.q, pl.tokens, pl.heads_q, kBlockM);
    p.map_k = bf16_map(in.k, pl.tokens, pl.heads_kv, kBlockN);
  } else {
    p.map_q = codes_map(quant.q.codes, pl.tokens, pl.heads_q, kBlockM);
    p.map_k = codes_map(quant.k.codes, pl.tokens, pl.heads_kv, kBlockN);
    p.map_k_tiles = codes_map(quant.k.codes_tiles, pl.tokens, pl.heads_kv, kBlockN);
    p.q_exponents = quant.q.exponents;
    p.k_exponents = quant.k.exponents;
  }
  p.map_vt = codes_t_map(quant.v.codes_t, lkv, kBlockN);
  p.map_vt_tiles = codes_t_map(quant.v.codes_t_tiles, lkv, kBlockN);
  p.v_exponents = quant.v.exponents;
  p.tokens_padded = lq.tokens_padded;
  p.items = m.item_buffer.get<sm90::WorkItem>();
  p.num_items = int(m.items);
  p.counter = m.counter.get<int>();
  p.cu_seqlens = in.cu_seqlens;
  p.o = out.o.data;
  p.o_stride_token = out.o.stride_token;
  p.o_stride_head = out.o.stride_head;
  p.wide_stores = bf16_stores_of(out.o, sm90::kWideStoreElems);
  if (!qk16 && p.wide_stores) {  // mxfp8's epilogue stages O and stores it by TMA
    p.map_o = bf16_map(out.o, pl.tokens, pl.heads_q, sm90::fwd::kOBoxRows);
    p.map_o_row = bf16_map(out.o, pl.tokens, pl.heads_q, 1);
  }
  p.lse = out.lse;
  p.tokens = pl.tokens;
  p.group = pl.group();
  p.scale_log2 = m.options.attention.scale_log2_for(pl.head_dim);
  p.dq_clear = dq_clear;

  sm90::ScheduleArgs sched;
  sched.cu_seqlens = in.cu_seqlens;
  sched.num_docs = pl.num_docs;
  sched.heads = pl.heads_q;
  sched.geometry = m.geometry;
  sched.num_items = m.items;
  sched.max_key_blocks = m.max_key_blocks;
  sched.items = m.item_buffer.get<sm90::WorkItem>();
  sched.counter = p.counter;
  sched.workspace = m.workspace.get();
  sm90::build_schedule(sched, stream);

  const bool causal = m.options.attention.causal;
  if (qk16) {
    if (causal)
      sm90::fwd::launch_forward<ScoreOperand::kBf16, true>(p, m.ctas, stream);
    else
      sm90::fwd::launch_forward<ScoreOperand::kBf16, false>(p, m.ctas, stream);
  } else {
    if (causal)
      sm90::fwd::launch_forward<ScoreOperand::kE4m3, true>(p, m.ctas, stream);
    else
      sm90::fwd::launch_forward<ScoreOperand::kE4m3, false>(p, m.ctas, stream);
  }
}

void GpuAttention::forward(const DeviceAttentionInputs& in, const DeviceAttentionOutputs& out,
                           cudaStream_t stream) {
  Impl& m = *impl_;
  if (in.layout.cu_seqlens == nullptr || !same_layout(in.layout, m.layout))
    reject("the inputs' layout differs from the one this GpuAttention was built for");
  // quantize_gpu skips a null operand, which would leave the forward reading stale codes.
  for (const auto& [name, view] :
       {std::make_pair("Q", &in.q), std::make_pair("K", &in.k), std::make_pair("V", &in.v)})
    if (view->data == nullptr) reject(std::string(name) + " is null: the forward reads Q, K and V");
  const QuantizeOptions qo = m.quantize_options();
  if (!m.quant) m.quant = std::make_unique<cuda::QuantizeOutputs>(m.layout, qo, true);
  DeviceAttentionInputs forward_inputs = in;
  forward_inputs.dout = {};  // the forward quantizes Q, K, V only
  quantize_gpu(forward_inputs, qo, m.quant->view(), stream);
  // The training call's backward needs its dQ accumulator zeroed: the forward kernel's spare warps
  // do it beside the attention, where memory bandwidth is idle (from the second call on, once the
  // first backward has allocated the accumulator).
  sm90::DqClear clear;
  if (m.backward) {
    clear = m.backward->dq_clear();
    clear.pause_ns = clear_pause_ns(m.forward_flops, clear.vectors, m.ctas);
  }
  m.forward(forward_inputs, m.quant->view(), out, clear, stream);
}

const DeviceQuantizedAttention& GpuAttention::quantized() const {
  if (!impl_->quant) reject("no BF16 forward has run yet");
  return impl_->quant->view();
}

NonFiniteReport GpuAttention::quantizer_status() const {
  if (!impl_->quant) reject("no BF16 forward has run yet");
  FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
  return impl_->quant->non_finite();
}

AttentionOutputs<float> forward_gpu_to_host(const AttentionBatch& batch,
                                            const GpuAttentionOptions& options) {
  const PackedLayout pl = batch.layout();
  GpuAttention attention(pl, options);
  const DeviceBatch dev(batch, /*with_dout=*/false);
  const cuda::DeviceBuffer o(size_t(pl.tokens) * pl.heads_q * pl.head_dim * sizeof(uint16_t));
  const cuda::DeviceBuffer lse(size_t(pl.tokens) * pl.heads_q * sizeof(float));
  DeviceAttentionOutputs out;
  out.o = dense_view<uint16_t>(o.get<uint16_t>(), pl.heads_q, pl.head_dim);
  out.lse = lse.get<float>();
  attention.forward(dev.in, out, nullptr);
  attention.quantizer_status().throw_if_any();  // synchronises

  AttentionOutputs<float> result;
  result.o = download_bf16(o);
  result.lse = lse.download<float>();
  return result;
}

}  // namespace flamia
