// Host-side pieces shared by the GPU forward and backward (attention_fwd.cu, attention_bwd.cu):
// argument checks, tensor maps of the operand layouts, and GpuAttention's state.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "bf16_rows.cuh"
#include "bwd_params.h"
#include "check.h"
#include "device_buffer.h"
#include "flamia/attention_gpu.h"
#include "flamia/formats.h"
#include "flamia/inputs.h"
#include "flamia/quantize_gpu.h"
#include "quantize_outputs.h"
#include "scheduler.h"
#include "tma.cuh"
#include "wgmma.cuh"

namespace flamia {
namespace gpu_attention {

constexpr int kHeadDim = sm90::fwd::kHeadDim;
static_assert(sm90::bwd::kHeadDim == kHeadDim, "one head dimension for both passes");

[[noreturn]] inline void reject(const std::string& what) {
  throw Error("GPU attention: " + what);
}

using cuda::is_aligned;

// Whether a BF16 view's base and strides allow stores of `elems` elements at a time.
inline bool bf16_stores_of(const TokenTensor<uint16_t>& v, int elems) {
  return is_aligned(v.data, size_t(elems) * sizeof(uint16_t)) && v.stride_token % elems == 0 &&
         v.stride_head % elems == 0;
}

inline void require_device_pointer(const void* p, size_t alignment, const std::string& name) {
  if (p == nullptr) reject(name + " is null");
  if (!is_aligned(p, alignment))
    reject(name + " is not " + std::to_string(alignment) + "-byte aligned");
}

inline bool same_layout(const PackedLayout& a, const PackedLayout& b) {
  if (a.num_docs != b.num_docs || a.tokens != b.tokens || a.heads_q != b.heads_q ||
      a.heads_kv != b.heads_kv || a.head_dim != b.head_dim)
    return false;
  return std::equal(a.cu_seqlens, a.cu_seqlens + a.num_docs + 1, b.cu_seqlens);
}

// BF16 output views: pairs of elements go out as one 4-byte store.
inline void require_bf16_output(const TokenTensor<uint16_t>& v, const PackedLayout& pl, int heads,
                                const std::string& name) {
  require_device_pointer(v.data, sizeof(uint32_t), name);
  validate_view(name.c_str(), v, pl.tokens, heads, pl.head_dim);
  if (v.stride_token % 2 != 0 || v.stride_head % 2 != 0)
    reject(name + "'s token and head strides must be even (pairs of BF16 go out as one store)");
}

// mxfp8-qk16's score operands: the BF16 Q and K views, read by TMA (16-byte aligned base and
// strides).
inline void require_bf16_score_operands(const DeviceAttentionInputs& in, const PackedLayout& pl) {
  require_device_pointer(in.q.data, kDeviceAlignment, "Q (BF16)");
  require_device_pointer(in.k.data, kDeviceAlignment, "K (BF16)");
  validate_view("Q", in.q, pl.tokens, pl.heads_q, pl.head_dim);
  validate_view("K", in.k, pl.tokens, pl.heads_kv, pl.head_dim);
  for (const auto* v : {&in.q, &in.k})
    if ((v->stride_token * sizeof(uint16_t)) % kDeviceAlignment != 0 ||
        (v->stride_head * sizeof(uint16_t)) % kDeviceAlignment != 0)
      reject("BF16 Q/K token and head strides must be multiples of 16 bytes");
}

// E4M3 codes [T][H][D]: one 128-byte row per token and head, boxes of `rows` tokens.
inline CUtensorMap codes_map(const uint8_t* codes, int64_t tokens, int heads, int rows) {
  return sm90::make_tensor_map_3d(
      codes, CU_TENSOR_MAP_DATA_TYPE_UINT8, {uint64_t(kHeadDim), uint64_t(heads), uint64_t(tokens)},
      {uint64_t(kHeadDim), uint64_t(heads) * kHeadDim}, {uint32_t(kHeadDim), 1, uint32_t(rows)},
      CU_TENSOR_MAP_SWIZZLE_128B);
}

// A strided BF16 view [T][H][D] (Q and K read by mxfp8-qk16, O written by mxfp8's epilogue; 16-byte
// aligned, strides of whole 16-byte groups) in boxes of one 128-byte swizzle span by `rows`
// tokens. An axis of extent 1 takes a row's stride: its coordinate is always 0, and TMA wants a
// positive stride where the view may have 0.
template <typename T>
inline CUtensorMap bf16_map(const TokenTensor<T>& v, int64_t tokens, int heads, uint32_t rows) {
  constexpr uint32_t kSpanElems = sm90::fwd::ScoreSpans<sm90::fwd::ScoreOperand::kBf16>::kSpanElems;
  static_assert(kSpanElems == sm90::fwd::kOBoxCols, "O's boxes are one span wide");
  const auto stride_bytes = [](int64_t stride, int64_t extent) {
    return uint64_t(extent > 1 ? stride : kHeadDim) * sizeof(uint16_t);
  };
  return sm90::make_tensor_map_3d(
      v.data, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
      {uint64_t(kHeadDim), uint64_t(heads), uint64_t(tokens)},
      {stride_bytes(v.stride_head, heads), stride_bytes(v.stride_token, tokens)},
      {kSpanElems, 1, rows}, CU_TENSOR_MAP_SWIZZLE_128B);
}

// codes_t [H * D][Tt]: boxes of `positions` (64 or 128 bytes, the matching swizzle) by D rows.
inline CUtensorMap codes_t_map(const uint8_t* codes_t, const QuantLayout& l, int positions) {
  const CUtensorMapSwizzle swizzle = positions == int(sm90::wgmma::kSw64RowBytes)
                                         ? CU_TENSOR_MAP_SWIZZLE_64B
                                         : CU_TENSOR_MAP_SWIZZLE_128B;
  return sm90::make_tensor_map_2d(codes_t, CU_TENSOR_MAP_DATA_TYPE_UINT8, uint64_t(l.tokens_t),
                                  uint64_t(l.heads) * kHeadDim, uint64_t(l.tokens_t),
                                  uint32_t(positions), uint32_t(kHeadDim), swizzle);
}

// A host batch copied to dense device buffers (dO only when asked for) and the inputs view over
// them: the *_to_host tools' uploads, in the legacy stream their launches use too.
struct DeviceBatch {
  cuda::DeviceBuffer cu, q, k, v, dout;
  DeviceAttentionInputs in;
  DeviceBatch(const AttentionBatch& batch, bool with_dout)
      : cu(cuda::DeviceBuffer::upload(batch.cu_seqlens)),
        q(cuda::DeviceBuffer::upload(batch.q)),
        k(cuda::DeviceBuffer::upload(batch.k)),
        v(cuda::DeviceBuffer::upload(batch.v)),
        dout(with_dout ? cuda::DeviceBuffer::upload(batch.dout) : cuda::DeviceBuffer()),
        in(dense_device_inputs(batch.layout(), cu.get<int32_t>(), q.get<uint16_t>(),
                               k.get<uint16_t>(), v.get<uint16_t>(), dout.get<uint16_t>())) {}
};

// A device buffer of BF16 bits, downloaded as floats.
inline std::vector<float> download_bf16(const cuda::DeviceBuffer& b) {
  const std::vector<uint16_t> bits = b.download<uint16_t>();
  std::vector<float> values(bits.size());
  std::transform(bits.begin(), bits.end(), values.begin(),
                 [](uint16_t x) { return bf16::decode(x); });
  return values;
}

inline int multiprocessors() {
  int device = 0, sms = 0;
  FLAMIA_CUDA_CHECK(cudaGetDevice(&device));
  FLAMIA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

// The backward's work list (uploaded once) and workspaces (allocated at the first backward).
struct BackwardState {
  int num_items = 0;
  int ctas = 0;
  cuda::DeviceBuffer items, counter, delta, dq_accum, dq_turns;
  int64_t dq_slots = 0;
  cuda::DeviceBuffer diagnostics, row_sum, row_abs;  // with GpuAttentionOptions::diagnostics
  cuda::DeviceBuffer dq_zeroed;                      // int: DqClear::zeroed
  cuda::DeviceBuffer dk_rotated;                     // [T][Hkv][D] FP32, with Hadamard rotation
  // The split backward (the deterministic mode): the dQ pass's work list and counter; no dQ
  // accumulator, turns or postprocess then.
  bool split = false;
  int dq_pass_items = 0;
  cuda::DeviceBuffer dq_pass_list, dq_pass_counter;
  sm90::DqClear dq_clear() const {
    return {dq_accum.get<uint4>(), int64_t(dq_accum.bytes() / sizeof(uint4)), dq_zeroed.get<int>()};
  }
};

}  // namespace gpu_attention

struct GpuAttention::Impl {
  PackedLayout layout;
  std::vector<int32_t> cu_seqlens;  // host copy; layout.cu_seqlens points here
  GpuAttentionOptions options;
  sm90::ScheduleGeometry geometry;
  int64_t items = 0;
  double forward_flops = 0;  // QK^T and PV over the visible pairs
  int max_key_blocks = 0;
  int ctas = 0;
  cuda::DeviceBuffer item_buffer, counter, workspace;
  // The BF16 entries' quantizer outputs (dO's arrays included, for the training call's backward).
  std::unique_ptr<cuda::QuantizeOutputs> quant;
  std::unique_ptr<gpu_attention::BackwardState> backward;

  // Both forward entries' checks and launch (attention_fwd.cu); the kernel also zeroes the
  // backward's dQ accumulator if `dq_clear` names one.
  void forward(const DeviceAttentionInputs& in, const DeviceQuantizedAttention& quant,
               const DeviceAttentionOutputs& out, const sm90::DqClear& dq_clear,
               cudaStream_t stream) const;

  QuantizeOptions quantize_options() const {
    QuantizeOptions q;
    q.policy = options.policy;
    q.hadamard = options.hadamard;
    q.transposed = true;
    q.score_codes = options.recipe != Recipe::kMxfp8Qk16;
    return q;
  }
};

}  // namespace flamia
