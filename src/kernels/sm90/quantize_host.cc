// Host-side companions of quantize_gpu: owning output buffers and quantize_gpu_to_host.
#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "check.h"
#include "device_buffer.h"
#include "flamia/quantize_gpu.h"
#include "quantize_outputs.h"

namespace flamia {
namespace cuda {

QuantizeOutputs::E4M3 QuantizeOutputs::make_e4m3(const QuantLayout& l, bool codes, bool transposed,
                                                 bool channel, bool tiles_t, bool tiles) {
  return {l,
          DeviceBuffer(codes ? size_t(l.num_codes()) : 0),
          DeviceBuffer(transposed ? size_t(l.num_codes_t()) : 0),
          DeviceBuffer(size_t(l.num_exponents())),
          DeviceBuffer(channel ? size_t(l.num_codes()) : 0),
          DeviceBuffer(tiles_t ? size_t(l.num_codes_t()) : 0),
          DeviceBuffer(tiles ? size_t(l.num_codes()) : 0)};
}

QuantizeOutputs::Nvfp4 QuantizeOutputs::make_nvfp4(const QuantLayout& l) {
  return {l, DeviceBuffer(size_t(l.num_codes() / 2)),
          DeviceBuffer(size_t(l.num_codes() / kNvfp4GroupSize)),
          DeviceBuffer(size_t(l.num_exponents()))};
}

QuantizeOutputs::QuantizeOutputs(const PackedLayout& pl, const QuantizeOptions& options,
                                 bool backward)
    : backward_(backward), nvfp4_(options.nvfp4_qk) {
  const QuantLayout lq = QuantLayout::make(pl.tokens, pl.heads_q, pl.head_dim, pl.num_docs);
  const QuantLayout lkv = QuantLayout::make(pl.tokens, pl.heads_kv, pl.head_dim, pl.num_docs);
  const bool tr = options.transposed;
  q_ = make_e4m3(lq, writes_codes(options, Operand::kQ), tr, false, false, false);
  k_ = make_e4m3(lkv, writes_codes(options, Operand::kK), tr, false, false,
                 writes_codes_tiles(options, Operand::kK));
  v_ = make_e4m3(lkv, writes_codes(options, Operand::kV), tr,
                 options.policy == ScalePolicy::kVGroup16,
                 writes_codes_t_tiles(options, Operand::kV), false);
  dout_ = make_e4m3(backward ? lq : QuantLayout{}, writes_codes(options, Operand::kDO), tr, false,
                    false, false);
  q4_ = make_nvfp4(nvfp4_ ? lq : QuantLayout{});
  k4_ = make_nvfp4(nvfp4_ ? lkv : QuantLayout{});
  status_ = DeviceBuffer(kNumOperands * sizeof(int64_t));
  auto e4m3_view = [](const E4M3& o) {
    return DeviceE4M3Operand{o.codes.get<uint8_t>(),         o.codes_t.get<uint8_t>(),
                             o.exponents.get<uint8_t>(),     o.channel_exponents.get<uint8_t>(),
                             o.codes_t_tiles.get<uint8_t>(), o.codes_tiles.get<uint8_t>()};
  };
  auto nvfp4_view = [](const Nvfp4& o) {
    return DeviceNvfp4Operand{o.packed.get<uint8_t>(), o.local_scales.get<uint8_t>(),
                              o.exponents.get<uint8_t>()};
  };
  view_.q = e4m3_view(q_);
  view_.k = e4m3_view(k_);
  view_.v = e4m3_view(v_);
  view_.dout = e4m3_view(dout_);
  view_.q4 = nvfp4_view(q4_);
  view_.k4 = nvfp4_view(k4_);
  view_.non_finite_first = status_.get<int64_t>();
}

std::vector<const DeviceBuffer*> QuantizeOutputs::arrays() const {
  std::vector<const DeviceBuffer*> all;
  for (const E4M3* o : {&q_, &k_, &v_, &dout_})
    for (const DeviceBuffer* b : {&o->codes, &o->codes_t, &o->exponents, &o->channel_exponents,
                                  &o->codes_t_tiles, &o->codes_tiles})
      all.push_back(b);
  for (const Nvfp4* o : {&q4_, &k4_})
    for (const DeviceBuffer* b : {&o->packed, &o->local_scales, &o->exponents}) all.push_back(b);
  return all;
}

void QuantizeOutputs::fill(uint8_t byte) const {
  std::vector<const DeviceBuffer*> all = arrays();
  all.push_back(&status_);
  for (const DeviceBuffer* b : all)
    if (b->bytes() > 0) FLAMIA_CUDA_CHECK(cudaMemset(b->get(), byte, b->bytes()));
  FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
}

int64_t QuantizeOutputs::array_bytes() const {
  int64_t total = 0;
  for (const DeviceBuffer* b : arrays()) total += int64_t(b->bytes());
  return total;
}

QuantizedAttention QuantizeOutputs::download() const {
  auto e4m3 = [](const E4M3& b) {
    E4M3Operand o;
    o.layout = b.layout;
    o.codes = b.codes.download<uint8_t>();
    o.codes_t = b.codes_t.download<uint8_t>();
    o.exponents = b.exponents.download<uint8_t>();
    o.channel_exponents = b.channel_exponents.download<uint8_t>();
    o.codes_t_tiles = b.codes_t_tiles.download<uint8_t>();
    o.codes_tiles = b.codes_tiles.download<uint8_t>();
    return o;
  };
  auto nvfp4 = [](const Nvfp4& b) {
    Nvfp4Operand o;
    o.layout = b.layout;
    o.packed = b.packed.download<uint8_t>();
    o.local_scales = b.local_scales.download<uint8_t>();
    o.exponents = b.exponents.download<uint8_t>();
    return o;
  };
  QuantizedAttention r;
  r.q = e4m3(q_);
  r.k = e4m3(k_);
  r.v = e4m3(v_);
  if (backward_) r.dout = e4m3(dout_);
  if (nvfp4_) {
    r.q4 = nvfp4(q4_);
    r.k4 = nvfp4(k4_);
  }
  r.non_finite = non_finite();
  return r;
}

NonFiniteReport QuantizeOutputs::non_finite() const {
  NonFiniteReport report;
  const std::vector<int64_t> first = status_.download<int64_t>();
  const E4M3* ops[kNumOperands] = {&q_, &k_, &v_, &dout_};
  for (int op = 0; op < kNumOperands; ++op) {
    if (op == int(Operand::kDO) && !backward_) continue;
    report.first_index[op] = first[op];
    report.layouts[op] = ops[op]->layout;
  }
  return report;
}

}  // namespace cuda

namespace {

// A dense [tokens][heads][dim] device copy of a host view; none (a null pointer, the operand
// skipped) for a null view. Never empty otherwise: with no tokens a present operand still needs a
// non-null pointer.
cuda::DeviceBuffer upload_dense(const TokenTensor<const uint16_t>& v, int64_t tokens, int heads,
                                int dim, cudaStream_t stream) {
  if (v.data == nullptr) return cuda::DeviceBuffer();
  constexpr int64_t kMinElems = kDeviceAlignment / int64_t(sizeof(uint16_t));
  std::vector<uint16_t> dense(size_t(std::max(tokens * heads * dim, kMinElems)));
  for (int64_t t = 0; t < tokens; ++t)
    for (int h = 0; h < heads; ++h)
      std::memcpy(&dense[size_t((t * heads + h) * dim)], &v.at(t, h, 0), dim * sizeof(uint16_t));
  return cuda::DeviceBuffer::upload(dense, stream);
}

}  // namespace

QuantizedAttention quantize_gpu_to_host(const AttentionInputs& host,
                                        const QuantizeOptions& options) {
  const PackedLayout& pl = host.layout;
  validate(pl);
  const std::array<bool, kNumOperands> present = present_operands(host);
  for (Operand op : {Operand::kQ, Operand::kK, Operand::kV, Operand::kDO})
    if (present[int(op)])
      validate_view(to_string(op), operand_input(host, op), pl.tokens, operand_heads(pl, op),
                    pl.head_dim);
  const bool backward = present[int(Operand::kDO)];

  const int dim = pl.head_dim;
  const cuda::QuantizeOutputs out(pl, options, backward);
  cudaStream_t stream = nullptr;
  FLAMIA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  try {
    // Uploads in the stream, which does not wait for the legacy default stream's copies.
    const cuda::DeviceBuffer cu = cuda::DeviceBuffer::upload(
        std::vector<int32_t>(pl.cu_seqlens, pl.cu_seqlens + pl.num_docs + 1), stream);
    const cuda::DeviceBuffer q = upload_dense(host.q, pl.tokens, pl.heads_q, dim, stream);
    const cuda::DeviceBuffer k = upload_dense(host.k, pl.tokens, pl.heads_kv, dim, stream);
    const cuda::DeviceBuffer v = upload_dense(host.v, pl.tokens, pl.heads_kv, dim, stream);
    const cuda::DeviceBuffer g = upload_dense(host.dout, pl.tokens, pl.heads_q, dim, stream);
    const DeviceAttentionInputs in =
        dense_device_inputs(pl, cu.get<int32_t>(), q.get<uint16_t>(), k.get<uint16_t>(),
                            v.get<uint16_t>(), g.get<uint16_t>());
    quantize_gpu(in, options, out.view(), stream);
    FLAMIA_CUDA_CHECK(cudaStreamSynchronize(stream));
  } catch (...) {
    cudaStreamDestroy(stream);
    throw;
  }
  FLAMIA_CUDA_CHECK(cudaStreamDestroy(stream));
  QuantizedAttention r = out.download();
  // QuantizeOutputs holds Q's, K's and V's arrays whether or not they were quantized; quantize_cpu
  // leaves a skipped operand empty.
  E4M3Operand* const e4m3[kNumOperands] = {&r.q, &r.k, &r.v, &r.dout};
  for (int op = 0; op < kNumOperands; ++op)
    if (!present[op]) {
      *e4m3[op] = E4M3Operand{};
      r.non_finite.layouts[op] = QuantLayout{};
    }
  if (!present[int(Operand::kQ)]) r.q4 = Nvfp4Operand{};
  if (!present[int(Operand::kK)]) r.k4 = Nvfp4Operand{};
  return r;
}

}  // namespace flamia
