// The fused GPU quantizer against its oracle, quantize_cpu: every output byte, the padding and the
// non-finite report, on packed documents at unaligned offsets, for every policy, rotation, head
// dim and NVFP4, with poisoned outputs and strided inputs, and with operands skipped (null inputs);
// plus the hardware E4M3 conversion against e4m3::encode on every float, and the argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "check.h"
#include "device_buffer.h"
#include "edge_layouts.h"
#include "flamia/formats.h"
#include "flamia/inputs.h"
#include "flamia/quantize.h"
#include "flamia/quantize_gpu.h"
#include "fp8_convert.cuh"
#include "gpu_test.h"
#include "quantize_outputs.h"
#include "quantize_tile.cuh"

namespace flamia {
namespace {

using cuda::DeviceBuffer;
using cuda::QuantizeOutputs;
using test::expect_error;

// Documents of 0, 1, 31, 32, 33, 127 and 129 tokens at unaligned offsets; 735 tokens, so six
// 128-token tiles that block32 blocks and vgroup16 groups straddle.
const std::vector<int64_t> kOddDocs = {5, 0, 1, 31, 32, 33, 127, 0, 129, 77, 300};
constexpr int kHeadsQ = 4, kHeadsKV = 2;  // GQA, group 2
constexpr uint8_t kPoison = 0xA5;
constexpr uint16_t kBf16NaN = 0x7FC0, kBf16Inf = 0x7F80, kBf16NegInf = 0xFF80;

uint16_t bf(double x) {
  return bf16::encode(float(x));
}

std::vector<uint16_t>& tensor(AttentionBatch& b, Operand op) {
  return op == Operand::kQ ? b.q : op == Operand::kK ? b.k : op == Operand::kV ? b.v : b.dout;
}
int heads_of(const AttentionBatch& b, Operand op) {
  return op == Operand::kQ || op == Operand::kDO ? b.heads_q : b.heads_kv;
}
uint16_t* row(AttentionBatch& b, Operand op, int64_t t, int h) {
  return &tensor(b, op)[size_t((t * heads_of(b, op) + h) * b.head_dim)];
}

// The adversarial cases of tests/test_quantize.cc, placed for kOddDocs: exact powers of two,
// maxima at and just above 448 * 2^e, BF16 subnormals, E4M3 rounding ties (normal and subnormal),
// all-zero rows, wide mixed signs, a whole all-zero document (31 tokens at offset 6), and large
// values at the edges of tiles and documents.
void plant_adversarial(AttentionBatch& b) {
  const int D = b.head_dim;
  constexpr int64_t kZeroDocBegin = 6, kZeroDocEnd = 37;
  for (Operand op : {Operand::kQ, Operand::kK, Operand::kV, Operand::kDO}) {
    const int heads = heads_of(b, op);
    for (int d = 0; d < D; ++d) {
      row(b, op, 40, 0)[d] = bf(std::ldexp(d % 2 ? -1.0 : 1.0, d % 20 - 10));
      row(b, op, 41, 0)[d] = bf(d == 5 ? 448.0 * 8 : 0.01 * d);
      row(b, op, 42, 0)[d] = bf(d == 9 ? -450.0 / 64 : 0.3);
      row(b, op, 43, 0)[d] = bf(std::ldexp(1.0, -133 + d % 7));
      row(b, op, 44, 0)[d] = 0;
      row(b, op, 45, 1 % heads)[d] = bf(d % 3 ? 1e-30 : -3e4);
      // Row maximum 448 (exponent 0), the rest on E4M3 ties: subnormal (k + 1/2) 2^-9 and
      // normal 1 + (2k + 1) / 16.
      row(b, op, 46, 0)[d] = bf(d == 0  ? 448.0
                                : d % 2 ? std::ldexp(d % 8 + 0.5, -9)
                                        : (d % 4 ? -1.0 : 1.0) * (1.0 + (2 * (d % 8) + 1) / 16.0));
      row(b, op, 127, 0)[d] = bf(d == 3 ? 9000.0 : 0.5);         // last token of the first tile
      row(b, op, 128, 1 % heads)[d] = bf(d == 7 ? -7e3 : 0.25);  // first of the second
      row(b, op, 434, 0)[d] = bf(d == 1 ? 3e5 : -0.125);         // last token of a document
    }
    for (int64_t t = kZeroDocBegin; t < kZeroDocEnd; ++t)
      for (int h = 0; h < heads; ++h) std::fill_n(row(b, op, t, h), D, uint16_t(0));
  }
}

AttentionBatch make_batch(const std::vector<int64_t>& docs, int dim, uint64_t seed,
                          bool adversarial = true) {
  InputSpec spec;
  spec.kind = InputKind::kHeavyTail;
  spec.sigma = 2.0;
  spec.seed = seed;
  AttentionBatch b = generate_batch(docs, kHeadsQ, kHeadsKV, dim, spec);
  if (adversarial) plant_adversarial(b);
  return b;
}

// ---- comparison -------------------------------------------------------------------------------

void expect_bytes(const std::vector<uint8_t>& want, const std::vector<uint8_t>& got,
                  const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  size_t first = want.size(), count = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (want[i] != got[i]) {
      if (count++ == 0) first = i;
    }
  EXPECT_EQ(count, 0u) << what << ": " << count << " of " << want.size()
                       << " bytes differ, first at " << first << " (cpu " << int(want[first])
                       << ", gpu " << int(got[first]) << ")";
}

void expect_layout(const QuantLayout& want, const QuantLayout& got, const std::string& what) {
  EXPECT_EQ(want.tokens, got.tokens) << what;
  EXPECT_EQ(want.tokens_padded, got.tokens_padded) << what;
  EXPECT_EQ(want.tokens_t, got.tokens_t) << what;
  EXPECT_EQ(want.heads, got.heads) << what;
  EXPECT_EQ(want.dim, got.dim) << what;
}

void expect_same(const QuantizedAttention& cpu, const QuantizedAttention& gpu) {
  for (Operand op : {Operand::kQ, Operand::kK, Operand::kV, Operand::kDO}) {
    const std::string name = to_string(op);
    const E4M3Operand &w = cpu.operand(op), &g = gpu.operand(op);
    expect_layout(w.layout, g.layout, name);
    expect_bytes(w.codes, g.codes, name + " codes");
    expect_bytes(w.codes_t, g.codes_t, name + " codes_t");
    expect_bytes(w.exponents, g.exponents, name + " exponents");
    expect_bytes(w.channel_exponents, g.channel_exponents, name + " channel_exponents");
    expect_bytes(w.codes_t_tiles, g.codes_t_tiles, name + " codes_t_tiles");
    expect_bytes(w.codes_tiles, g.codes_tiles, name + " codes_tiles");
    EXPECT_EQ(cpu.non_finite.first_index[int(op)], gpu.non_finite.first_index[int(op)]) << name;
    expect_layout(cpu.non_finite.layouts[int(op)], gpu.non_finite.layouts[int(op)],
                  name + " report");
  }
  for (const auto& [name, w, g] :
       {std::make_tuple("Q4", &cpu.q4, &gpu.q4), std::make_tuple("K4", &cpu.k4, &gpu.k4)}) {
    const std::string n = name;
    expect_layout(w->layout, g->layout, n);
    expect_bytes(w->packed, g->packed, n + " packed");
    expect_bytes(w->local_scales, g->local_scales, n + " local_scales");
    expect_bytes(w->exponents, g->exponents, n + " exponents");
  }
  EXPECT_EQ(cpu.non_finite.message(), gpu.non_finite.message());
}

// ---- running on the GPU -----------------------------------------------------------------------

enum class Arrangement {
  kDense,       // [T][H][D]
  kHeadMajor,   // [H][T][D]
  kPaddedRows,  // [T][H][D] with gaps after every row and token (holding NaNs)
};

constexpr int64_t kRowGap = 8, kTokenGap = 24;  // elements; multiples of 8 keep 16-byte rows

// Device copies of the batch's inputs in an arrangement; gaps hold NaN so that any read outside
// the rows would show up in the non-finite report.
struct DeviceInputs {
  DeviceBuffer cu, q, k, v, dout;
  DeviceAttentionInputs in;

  DeviceInputs(const AttentionBatch& b, Arrangement arr, bool backward) {
    cu = DeviceBuffer::upload(b.cu_seqlens);
    in.layout = b.layout();
    in.cu_seqlens = cu.get<int32_t>();
    const int D = b.head_dim;
    auto place = [&](const std::vector<uint16_t>& src, int heads, DeviceBuffer* dst) {
      int64_t st = int64_t(heads) * D, sh = D;
      if (arr == Arrangement::kHeadMajor) {
        st = D;
        sh = b.tokens * D;
      } else if (arr == Arrangement::kPaddedRows) {
        sh = D + kRowGap;
        st = heads * sh + kTokenGap;
      }
      std::vector<uint16_t> host(
          size_t(std::max<int64_t>(b.tokens * heads * (D + kRowGap) + b.tokens * kTokenGap, 1)),
          kBf16NaN);
      for (int64_t t = 0; t < b.tokens; ++t)
        for (int h = 0; h < heads; ++h)
          std::memcpy(&host[size_t(t * st + h * sh)], &src[size_t((t * heads + h) * D)],
                      D * sizeof(uint16_t));
      *dst = DeviceBuffer::upload(host);
      return TokenTensor<const uint16_t>{dst->get<const uint16_t>(), st, sh};
    };
    in.q = place(b.q, b.heads_q, &q);
    in.k = place(b.k, b.heads_kv, &k);
    in.v = place(b.v, b.heads_kv, &v);
    if (backward) in.dout = place(b.dout, b.heads_q, &dout);
  }
};

// `backward`: quantize dO too, when the batch has one (an empty batch's dO view is null, which
// skips dO).
QuantizedAttention run_gpu(const AttentionBatch& b, const QuantizeOptions& opt,
                           Arrangement arr = Arrangement::kDense, bool with_dout = true,
                           uint8_t poison = kPoison) {
  const bool backward = with_dout && b.inputs().dout.data != nullptr;
  const DeviceInputs inputs(b, arr, backward);
  const QuantizeOutputs out(b.layout(), opt, backward);
  out.fill(poison);  // every byte, padding included, must be written
  quantize_gpu(inputs.in, opt, out.view(), nullptr);
  FLAMIA_CUDA_CHECK(cudaGetLastError());
  FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
  return out.download();
}

AttentionInputs forward_only(const AttentionBatch& b) {
  AttentionInputs in = b.inputs();
  in.dout.data = nullptr;
  return in;
}

// ---- the hardware conversion ------------------------------------------------------------------

constexpr uint64_t kAllFloats = 1ull << 32;

// A sweep kernel's counters: how many cases mismatch, and the first one.
__device__ void record_mismatch(unsigned long long* mismatches, unsigned long long* first,
                                uint64_t i) {
  atomicAdd(mismatches, 1ull);
  atomicMin(first, static_cast<unsigned long long>(i));
}

__global__ void compare_e4m3_conversion(unsigned long long* mismatches, unsigned long long* first) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < kAllFloats;
       i += uint64_t(gridDim.x) * blockDim.x) {
    const float x = __uint_as_float(uint32_t(i));
    if (!is_finite_float(x)) continue;  // the quantizer converts finite values only
    const uint32_t hw = sm90::e4m3x2_rn_satfinite(x, -x);
    const uint32_t sw = e4m3::encode(x) | uint32_t(e4m3::encode(-x)) << 8;
    if (hw != sw) record_mismatch(mismatches, first, i);
  }
}

// Runs an exhaustive grid-stride comparison kernel on the counters {mismatches, first mismatching
// case} and returns them.
using SweepKernel = void (*)(unsigned long long*, unsigned long long*);
std::vector<unsigned long long> run_sweep(SweepKernel kernel) {
  DeviceBuffer counters(2 * sizeof(unsigned long long));
  const std::vector<unsigned long long> init = {0, ~0ull};
  FLAMIA_CUDA_CHECK(
      cudaMemcpy(counters.get(), init.data(), counters.bytes(), cudaMemcpyHostToDevice));
  constexpr int kBlocks = 2048, kBlockThreads = 256;  // a grid-stride loop: any size works
  auto* c = counters.get<unsigned long long>();
  kernel<<<kBlocks, kBlockThreads>>>(c, c + 1);
  FLAMIA_CUDA_CHECK(cudaGetLastError());
  return counters.download<unsigned long long>();
}

TEST(GpuQuantizeFormats, HardwareE4M3ConversionEqualsEncodeOnEveryFiniteFloat) {
  FLAMIA_REQUIRE_GPU();
  const std::vector<unsigned long long> got = run_sweep(compare_e4m3_conversion);
  EXPECT_EQ(got[0], 0u) << "first mismatch at float bits 0x" << std::hex << got[1];
}

// The backward preprocess decodes dO's codes in hardware: every pair of codes (NaN codes as NaN)
// against formats.h.
constexpr uint64_t kAllCodePairs = 1u << 16;
__global__ void compare_e4m3_decode(unsigned long long* mismatches, unsigned long long* first) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < kAllCodePairs;
       i += uint64_t(gridDim.x) * blockDim.x) {
    const float2 hw = sm90::e4m3x2_to_float2(uint16_t(i));
    const float sw[2] = {e4m3::decode(uint8_t(i)), e4m3::decode(uint8_t(i >> 8))};
    const float got[2] = {hw.x, hw.y};
    bool same = true;
    for (int h = 0; h < 2; ++h)
      same &= sw[h] != sw[h] ? got[h] != got[h] : __float_as_uint(got[h]) == __float_as_uint(sw[h]);
    if (!same) record_mismatch(mismatches, first, i);
  }
}

TEST(GpuQuantizeFormats, HardwareE4M3DecodeEqualsDecodeOnEveryCodePair) {
  FLAMIA_REQUIRE_GPU();
  const std::vector<unsigned long long> got = run_sweep(compare_e4m3_decode);
  EXPECT_EQ(got[0], 0u) << "first mismatch at code pair 0x" << std::hex << got[1];
}

// The quantizer's E2M1 encoders (three comparisons instead of seven) against formats.h: every
// finite BF16 value (every tie of an E2M1 midpoint with these scales is one) times every scale
// exponent, for vgroup16's 2^e scales (s == 0 below) and every NVFP4 local scale s * 2^e.
constexpr int64_t kBf16Patterns = 1 << 16;
constexpr int kScaleExponents = ue8m0::kMaxExponent - ue8m0::kMinExponent + 1;
constexpr int64_t kE2m1Cases = int64_t(e4m3::kMaxCode + 1) * kScaleExponents * kBf16Patterns;

__global__ void compare_e2m1_encoders(unsigned long long* mismatches, unsigned long long* first) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < kE2m1Cases;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float x = bf16::decode(uint16_t(i % kBf16Patterns));
    if (!is_finite_float(x)) continue;
    const int e = int(i / kBf16Patterns % kScaleExponents) + ue8m0::kMinExponent;
    const uint8_t s = uint8_t(i / kBf16Patterns / kScaleExponents);
    bool same;
    if (s == 0) {
      same = sm90::quant::e2m1_grid_as_e4m3(x, e) ==
             e4m3::encode(e2m1::decode(e2m1::encode_scaled(x, exp2i(e))));
    } else {
      const float scale = __fmul_rn(e4m3::decode(s), exp2i(e));
      same = sm90::quant::e2m1_encode(x, scale) == e2m1::encode_scaled(x, scale);
    }
    if (!same) record_mismatch(mismatches, first, i);
  }
}

TEST(GpuQuantizeFormats, FastE2M1EncodersEqualFormatsOnEveryBf16AndScale) {
  FLAMIA_REQUIRE_GPU();
  const std::vector<unsigned long long> got = run_sweep(compare_e2m1_encoders);
  EXPECT_EQ(got[0], 0u) << "first mismatch: case " << got[1] << " (scale code "
                        << got[1] / kBf16Patterns / kScaleExponents << ", exponent "
                        << int64_t(got[1] / kBf16Patterns % kScaleExponents) + ue8m0::kMinExponent
                        << ", bf16 bits " << got[1] % kBf16Patterns << ")";
}

// ---- bit identity -----------------------------------------------------------------------------

using Params = std::tuple<ScalePolicy, bool, int, bool>;  // policy, hadamard, dim, nvfp4

class GpuQuantizeBits : public ::testing::TestWithParam<Params> {};

TEST_P(GpuQuantizeBits, EqualsTheCpuQuantizer) {
  FLAMIA_REQUIRE_GPU();
  const auto [policy, hadamard, dim, nvfp4] = GetParam();
  const AttentionBatch b = make_batch(kOddDocs, dim, 17 + dim + int(policy));
  QuantizeOptions opt;
  opt.policy = policy;
  opt.hadamard = hadamard;
  opt.nvfp4_qk = nvfp4;
  const QuantizedAttention cpu = quantize_cpu(b.inputs(), opt);
  ASSERT_FALSE(cpu.non_finite.any());
  expect_same(cpu, run_gpu(b, opt));
}

INSTANTIATE_TEST_SUITE_P(All, GpuQuantizeBits,
                         ::testing::Combine(::testing::ValuesIn(kAllScalePolicies),
                                            ::testing::Bool(), ::testing::Values(64, 128),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(to_string(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_rotated" : "") + "_d" +
                                  std::to_string(std::get<2>(info.param)) +
                                  (std::get<3>(info.param) ? "_nvfp4" : "");
                         });

TEST(GpuQuantize, ManyRandomDocumentsAcrossTiles) {
  FLAMIA_REQUIRE_GPU();
  // ~4000 tokens in documents of 0..180 tokens: every alignment of blocks to tiles occurs.
  std::vector<int64_t> docs;
  constexpr int kDocs = 44, kMaxLength = 180;
  for (int i = 0; i < kDocs; ++i)
    docs.push_back(int64_t(std::fabs(normal_deviate(5, 0, uint64_t(i))) * kMaxLength / 2) %
                   (kMaxLength + 1));
  const AttentionBatch b = make_batch(docs, 128, 99, false);
  for (ScalePolicy p : kAllScalePolicies) {
    SCOPED_TRACE(to_string(p));
    QuantizeOptions opt;
    opt.policy = p;
    opt.hadamard = true;
    opt.nvfp4_qk = true;
    expect_same(quantize_cpu(b.inputs(), opt), run_gpu(b, opt));
  }
}

TEST(GpuQuantize, NonFiniteInputsMatchTheCpuReport) {
  FLAMIA_REQUIRE_GPU();
  AttentionBatch b = make_batch(kOddDocs, 64, 3);
  const int D = 64;
  row(b, Operand::kK, 127, 1)[9] = kBf16Inf;    // last token of a tile
  row(b, Operand::kK, 40, 1)[63] = kBf16NaN;    // earlier: the one reported
  row(b, Operand::kK, 40, 1)[7] = kBf16NegInf;  // same chunk, smaller index
  row(b, Operand::kQ, 734, 3)[0] = kBf16NaN;    // last token
  row(b, Operand::kDO, 129, 0)[D - 1] = kBf16Inf;
  row(b, Operand::kV, 200, 1)[31] = kBf16NaN;  // inside a block and a 16-key group
  for (ScalePolicy p : kAllScalePolicies) {
    SCOPED_TRACE(to_string(p));
    QuantizeOptions opt;
    opt.policy = p;
    opt.nvfp4_qk = true;
    opt.hadamard = p == ScalePolicy::kBlock32;
    const QuantizedAttention cpu = quantize_cpu(b.inputs(), opt), gpu = run_gpu(b, opt);
    EXPECT_EQ(gpu.non_finite.first_index[int(Operand::kK)], (40 * kHeadsKV + 1) * D + 7);
    EXPECT_EQ(gpu.non_finite.first_index[int(Operand::kQ)], (734 * kHeadsQ + 3) * D + 0);
    EXPECT_EQ(gpu.non_finite.message(), "non-finite input in Q at token 734, head 3, dim 0");
    expect_same(cpu, gpu);
  }
}

TEST(GpuQuantize, StatusIsResetByEveryCall) {
  FLAMIA_REQUIRE_GPU();
  AttentionBatch bad = make_batch(kOddDocs, 128, 4, false);
  const AttentionBatch clean = bad;
  row(bad, Operand::kV, 300, 0)[1] = kBf16NaN;
  const QuantizeOptions opt;
  const DeviceInputs bad_in(bad, Arrangement::kDense, true),
      clean_in(clean, Arrangement::kDense, true);
  const QuantizeOutputs out(bad.layout(), opt, true);
  quantize_gpu(bad_in.in, opt, out.view(), nullptr);
  EXPECT_EQ(out.download().non_finite.first_index[int(Operand::kV)], (300 * kHeadsKV) * 128 + 1);
  quantize_gpu(clean_in.in, opt, out.view(), nullptr);
  const QuantizedAttention again = out.download();
  EXPECT_FALSE(again.non_finite.any()) << again.non_finite.message();
  expect_same(quantize_cpu(clean.inputs(), opt), again);
}

TEST(GpuQuantize, StridedViewsMatchTheCpuOnDenseOnes) {
  FLAMIA_REQUIRE_GPU();
  const AttentionBatch b = make_batch(kOddDocs, 128, 5);
  for (ScalePolicy p : {ScalePolicy::kToken, ScalePolicy::kBlock32, ScalePolicy::kVGroup16}) {
    for (Arrangement arr : {Arrangement::kHeadMajor, Arrangement::kPaddedRows}) {
      SCOPED_TRACE(std::string(to_string(p)) +
                   (arr == Arrangement::kHeadMajor ? " head-major" : " padded"));
      QuantizeOptions opt;
      opt.policy = p;
      opt.hadamard = true;
      opt.nvfp4_qk = true;
      const QuantizedAttention gpu = run_gpu(b, opt, arr);
      EXPECT_FALSE(gpu.non_finite.any()) << "read outside the rows: " << gpu.non_finite.message();
      expect_same(quantize_cpu(b.inputs(), opt), gpu);
    }
  }
}

TEST(GpuQuantize, HostConvenienceForwardOnlyAndNoTransposedCopies) {
  FLAMIA_REQUIRE_GPU();
  const AttentionBatch b = make_batch(kOddDocs, 64, 6);
  QuantizeOptions opt;
  opt.policy = ScalePolicy::kFloor;
  expect_same(quantize_cpu(b.inputs(), opt), quantize_gpu_to_host(b.inputs(), opt));
  const QuantizedAttention fwd = quantize_gpu_to_host(forward_only(b), opt);
  EXPECT_TRUE(fwd.dout.codes.empty());
  expect_same(quantize_cpu(forward_only(b), opt), fwd);
  AttentionInputs dout_only;  // the backward's call: skipped operands come back empty
  dout_only.layout = b.layout();
  dout_only.dout = b.inputs().dout;
  const QuantizedAttention bwd = quantize_gpu_to_host(dout_only, opt);
  EXPECT_TRUE(bwd.q.codes.empty() && bwd.v.codes_t.empty());
  expect_same(quantize_cpu(dout_only, opt), bwd);
  opt.transposed = false;
  const QuantizedAttention no_t = run_gpu(b, opt, Arrangement::kDense, false);
  EXPECT_TRUE(no_t.q.codes_t.empty());
  expect_same(quantize_cpu(forward_only(b), opt), no_t);
  opt.transposed = true;  // mxfp8-qk16's: no score-product codes for Q and K
  opt.score_codes = false;
  const QuantizedAttention no_score = run_gpu(b, opt, Arrangement::kDense, false);
  EXPECT_TRUE(no_score.q.codes.empty() && no_score.k.codes.empty());
  EXPECT_FALSE(no_score.q.codes_t.empty() || no_score.v.codes.empty());
  expect_same(quantize_cpu(forward_only(b), opt), no_score);
}

TEST(GpuQuantize, EmptyAndOneTokenInputs) {
  FLAMIA_REQUIRE_GPU();
  for (const std::vector<int64_t>& docs : {std::vector<int64_t>{0, 0}, std::vector<int64_t>{1}}) {
    const AttentionBatch b = make_batch(docs, 64, 7, false);
    for (ScalePolicy p : kAllScalePolicies) {
      QuantizeOptions opt;
      opt.policy = p;
      opt.nvfp4_qk = true;
      expect_same(quantize_cpu(b.inputs(), opt), run_gpu(b, opt));
    }
  }
}

// codes_t's document starts, permuted groups and zero gaps (flamia/quantize.h) on layouts where
// groups straddle 128- and 256-token tiles, documents end inside and exactly at tile edges, and
// runs of empty documents make gaps: outputs poisoned with 0xFF (E4M3 NaN) first, so any position
// left unwritten shows.
TEST(GpuQuantize, TransposedLayoutOnUnalignedAndEmptyDocuments) {
  FLAMIA_REQUIRE_GPU();
  constexpr uint8_t kNaNPoison = 0xFF;
  const std::vector<std::vector<int64_t>> layouts = testlayouts::unaligned_and_empty_documents();
  for (const int dim : {64, 128}) {
    for (size_t i = 0; i < layouts.size(); ++i) {
      SCOPED_TRACE("dim " + std::to_string(dim) + ", layout " + std::to_string(i));
      const AttentionBatch b = make_batch(layouts[i], dim, 40 + i, false);
      for (ScalePolicy p : {ScalePolicy::kToken, ScalePolicy::kBlock32, ScalePolicy::kVGroup16}) {
        SCOPED_TRACE(to_string(p));
        QuantizeOptions opt;
        opt.policy = p;
        const QuantizedAttention gpu = run_gpu(b, opt, Arrangement::kDense, true, kNaNPoison);
        expect_same(quantize_cpu(b.inputs(), opt), gpu);
        EXPECT_EQ(gpu.q.layout.tokens_t, transposed_tokens(b.tokens, int(layouts[i].size())));
        EXPECT_EQ(std::count(gpu.v.codes_t.begin(), gpu.v.codes_t.end(), kNaNPoison), 0);
        EXPECT_EQ(std::count(gpu.v.codes_t_tiles.begin(), gpu.v.codes_t_tiles.end(), kNaNPoison),
                  0);
        EXPECT_EQ(std::count(gpu.k.codes_tiles.begin(), gpu.k.codes_tiles.end(), kNaNPoison), 0);
      }
    }
  }
  // No tokens at all, documents only: codes_t is all padding.
  const AttentionBatch empty = make_batch({0, 0, 0}, 128, 9, false);
  const QuantizedAttention gpu = run_gpu(empty, QuantizeOptions{}, Arrangement::kDense, true, 0xFF);
  ASSERT_EQ(gpu.k.codes_t.size(), size_t(kHeadsKV * 128 * 48));
  EXPECT_EQ(std::count(gpu.k.codes_t.begin(), gpu.k.codes_t.end(), uint8_t(0)),
            kHeadsKV * 128 * 48);
  expect_same(quantize_cpu(empty.inputs(), QuantizeOptions{}), gpu);
}

// Layouts whose packed quantizer tiles are the key tiles (quantize_geometry.h,
// tiles_are_key_tiles): at head dim 128 the quantizer writes K's and V's tile codes itself, with no
// tile pass; at 64, and on the layout beside them that misses the condition by one empty document,
// the passes do. Every policy, rotated or not, outputs poisoned with 0xFF (E4M3 NaN) first.
TEST(GpuQuantize, KeyTileLayoutsTakeTheTileCodesFromTheQuantizer) {
  FLAMIA_REQUIRE_GPU();
  constexpr uint8_t kNaNPoison = 0xFF;
  const std::vector<std::vector<int64_t>> layouts = {
      {1024}, {128, 256, 384, 48}, {256, 128, 0, 0}, {128, 0, 256}, {384, 200}};
  for (const int dim : {64, 128}) {
    for (size_t i = 0; i < layouts.size(); ++i) {
      SCOPED_TRACE("dim " + std::to_string(dim) + ", layout " + std::to_string(i));
      const AttentionBatch b = make_batch(layouts[i], dim, 70 + i, false);
      for (ScalePolicy p : kAllScalePolicies) {
        for (const bool hadamard : {false, true}) {
          SCOPED_TRACE(std::string(to_string(p)) + (hadamard ? ", rotated" : ""));
          QuantizeOptions opt;
          opt.policy = p;
          opt.hadamard = hadamard;
          opt.tiling = QuantizerTiling::kPacked;
          const QuantizedAttention gpu = run_gpu(b, opt, Arrangement::kDense, true, kNaNPoison);
          expect_same(quantize_cpu(b.inputs(), opt), gpu);
          EXPECT_EQ(std::count(gpu.v.codes_t_tiles.begin(), gpu.v.codes_t_tiles.end(), kNaNPoison),
                    0);
          EXPECT_EQ(std::count(gpu.k.codes_tiles.begin(), gpu.k.codes_tiles.end(), kNaNPoison), 0);
        }
      }
    }
  }
}

// The document tiling (tiles cut from each document's start, idle slots between documents)
// against the CPU quantizer, so against the packed tiling too: the layouts above, long documents
// off the tile edges and random ones; every policy, rotated on odd layouts, NVFP4 on some, outputs
// poisoned with 0xFF (E4M3 NaN) first. At head dim 128 its tiles are the key tiles: the tile codes
// come from the fused launch.
TEST(GpuQuantize, DocumentTilingWritesTheCpuQuantizersBytes) {
  FLAMIA_REQUIRE_GPU();
  constexpr uint8_t kNaNPoison = 0xFF;
  std::vector<std::vector<int64_t>> layouts = testlayouts::unaligned_and_empty_documents();
  layouts.insert(layouts.end(),
                 {kOddDocs, {1024}, {0, 0, 130, 0, 700, 3}, {37, 1000, 515}, {0, 0, 0}, {1}});
  for (uint64_t i = 0; i < 4; ++i) {
    std::vector<int64_t> docs;
    for (uint64_t j = 0; j < 12; ++j)
      docs.push_back(int64_t(std::fabs(normal_deviate(11, i, j)) * 200.0));
    layouts.push_back(docs);
  }
  for (const int dim : {64, 128}) {
    for (size_t i = 0; i < layouts.size(); ++i) {
      SCOPED_TRACE("dim " + std::to_string(dim) + ", layout " + std::to_string(i));
      const AttentionBatch b = make_batch(layouts[i], dim, 90 + i, false);
      QuantizeOptions opt;
      opt.tiling = QuantizerTiling::kDocument;
      opt.hadamard = i % 2 == 1;
      ASSERT_EQ(quantize_gpu_fuses_tile_codes(b.layout(), opt), dim == kKeyTileTokens);
      for (ScalePolicy p : kAllScalePolicies) {
        SCOPED_TRACE(to_string(p));
        opt.policy = p;
        opt.nvfp4_qk = (i + size_t(p)) % 3 == 0;
        const QuantizedAttention gpu = run_gpu(b, opt, Arrangement::kDense, true, kNaNPoison);
        expect_same(quantize_cpu(b.inputs(), opt), gpu);
        if (HasFailure()) return;  // one case's report is enough
      }
    }
  }
}

// kAuto: the packed tiles where they are the key tiles already, the document tiles where the
// documents start off them, the packed tiles again where documents are too short for theirs.
TEST(GpuQuantize, AutoTilingRule) {
  auto tiling = [](const std::vector<int64_t>& docs, int dim) {
    const AttentionBatch b = make_batch(docs, dim, 1, false);
    return quantize_gpu_tiling(b.layout(), QuantizeOptions{});
  };
  EXPECT_EQ(tiling({1024, 256, 384}, 128), QuantizerTiling::kPacked);
  EXPECT_EQ(tiling({37, 1000, 515}, 128), QuantizerTiling::kDocument);
  EXPECT_EQ(tiling({37, 1000, 515}, 64), QuantizerTiling::kDocument);
  EXPECT_EQ(tiling(std::vector<int64_t>(100, 100), 128), QuantizerTiling::kDocument);  // 100 : 79
  EXPECT_EQ(tiling(std::vector<int64_t>(100, 150), 128), QuantizerTiling::kPacked);    // 200 : 118
  EXPECT_EQ(tiling(std::vector<int64_t>(100, 40), 128), QuantizerTiling::kPacked);
  EXPECT_EQ(tiling({0, 0}, 64), QuantizerTiling::kPacked);  // no tokens: nothing to tile
  const AttentionBatch b = make_batch({37, 1000, 515}, 128, 1, false);
  QuantizeOptions packed;
  packed.tiling = QuantizerTiling::kPacked;
  EXPECT_EQ(quantize_gpu_tiling(b.layout(), packed), QuantizerTiling::kPacked);
  EXPECT_FALSE(quantize_gpu_fuses_tile_codes(b.layout(), packed));
  EXPECT_TRUE(quantize_gpu_fuses_tile_codes(b.layout(), QuantizeOptions{}));
}

TEST(GpuQuantize, RejectsBadArguments) {
  FLAMIA_REQUIRE_GPU();
  const AttentionBatch b = make_batch({10, 20}, 64, 8, false);
  const DeviceInputs good(b, Arrangement::kDense, true);
  QuantizeOptions opt;
  opt.policy = ScalePolicy::kVGroup16;
  opt.nvfp4_qk = true;
  const QuantizeOutputs outputs(b.layout(), opt, true);
  auto run = [&](DeviceAttentionInputs in, DeviceQuantizedAttention out, QuantizeOptions o) {
    return [=] { quantize_gpu(in, o, out, nullptr); };
  };
  const DeviceQuantizedAttention out = outputs.view();
  std::vector<int32_t> decreasing = {0, 20, 10};
  DeviceAttentionInputs in = good.in;
  in.layout.cu_seqlens = decreasing.data();
  expect_error(run(in, out, opt), "non-decreasing");
  in = good.in;
  in.layout.head_dim = 96;
  expect_error(run(in, out, opt), "head_dim");
  in = good.in;
  in.q.data = in.k.data = in.v.data = in.dout.data = nullptr;
  expect_error(run(in, out, opt), "no operand to quantize");
  in = good.in;
  in.cu_seqlens = nullptr;
  expect_error(run(in, out, opt), "device cu_seqlens is null");
  in = good.in;
  in.k.data += 1;
  expect_error(run(in, out, opt), "K must start 16-byte aligned");
  in = good.in;
  in.q.stride_token = kHeadsQ * 64 + 4;
  expect_error(run(in, out, opt), "multiples of 8 elements");

  DeviceQuantizedAttention o = out;
  o.non_finite_first = nullptr;
  expect_error(run(good.in, o, opt), "non_finite_first");
  o = out;
  o.k.codes = nullptr;
  expect_error(run(good.in, o, opt), "K output 'codes' is null");
  o = out;
  o.dout.codes_t = nullptr;
  expect_error(run(good.in, o, opt), "dO output 'codes_t' is null");
  o = out;
  o.v.channel_exponents = nullptr;
  expect_error(run(good.in, o, opt), "V output 'channel_exponents' is null");
  o = out;
  o.q4.local_scales = nullptr;
  expect_error(run(good.in, o, opt), "Q (NVFP4) output 'local_scales' is null");
  o = out;
  o.v.exponents += 1;
  expect_error(run(good.in, o, opt), "V output 'exponents' is not 16-byte aligned");

  // K's and V's tile codes: K's beside its codes, V's beside codes_t under every policy but
  // vgroup16.
  QuantizeOptions token;
  DeviceQuantizedAttention k_tiles = out;
  k_tiles.k.codes_tiles = nullptr;
  expect_error(run(good.in, k_tiles, opt), "K output 'codes_tiles' is null");
  expect_error(run(good.in, out, token), "V output 'codes_t_tiles' is null");

  // What an option does not need may be null: no transposed copy, no NVFP4, token policy.
  o = out;
  o.q.codes_t = o.k.codes_t = o.v.codes_t = o.dout.codes_t = nullptr;
  o.v.channel_exponents = nullptr;
  o.q4 = o.k4 = DeviceNvfp4Operand{};
  QuantizeOptions lean;
  lean.transposed = false;
  EXPECT_NO_THROW(run(good.in, o, lean)());
  // Nor a skipped operand's outputs: dO alone (token policy, no NVFP4 for dO) needs dO's arrays.
  o = DeviceQuantizedAttention{};
  o.dout = out.dout;
  o.non_finite_first = out.non_finite_first;
  in = good.in;
  in.q.data = in.k.data = in.v.data = nullptr;
  EXPECT_NO_THROW(run(in, o, opt)());
  FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
}

// The training call's backward quantizes dO alone (Q, K, V come from its forward); K alone covers
// NVFP4 K without Q. A skipped operand's outputs keep their poison byte for byte (not even
// zeroed), its status entry is -1 (the NaN planted in Q is not reported), and the present
// operand's outputs equal quantize_cpu's, under the tensor policy too (its maxima launch covers
// the present operand only). Odd documents at unaligned offsets make tiles share codes_t chunks.
TEST(GpuQuantize, NullInputsLeaveTheirOutputsUntouched) {
  FLAMIA_REQUIRE_GPU();
  const std::vector<int64_t> docs = {3, 1, 31, 0, 33, 127, 129, 5};
  for (const int dim : {64, 128}) {
    AttentionBatch b = make_batch(docs, dim, 60 + dim, false);
    row(b, Operand::kQ, 40, 1)[3] = kBf16NaN;
    const DeviceInputs device(b, Arrangement::kDense, true);
    for (const Operand only : {Operand::kDO, Operand::kK}) {
      for (ScalePolicy p : {ScalePolicy::kToken, ScalePolicy::kBlock32, ScalePolicy::kTensor,
                            ScalePolicy::kVGroup16}) {
        SCOPED_TRACE("dim " + std::to_string(dim) + ", " + to_string(only) + " only, " +
                     to_string(p));
        QuantizeOptions opt;
        opt.policy = p;
        opt.hadamard = true;
        opt.nvfp4_qk = true;
        AttentionInputs host;
        host.layout = b.layout();
        (only == Operand::kK ? host.k : host.dout) = operand_input(b.inputs(), only);
        DeviceAttentionInputs in;
        in.layout = device.in.layout;
        in.cu_seqlens = device.in.cu_seqlens;
        (only == Operand::kK ? in.k : in.dout) = operand_input(device.in, only);

        const QuantizeOutputs out(b.layout(), opt, true);
        out.fill(kPoison);
        quantize_gpu(in, opt, out.view(), nullptr);
        FLAMIA_CUDA_CHECK(cudaGetLastError());
        FLAMIA_CUDA_CHECK(cudaDeviceSynchronize());
        const QuantizedAttention gpu = out.download(), cpu = quantize_cpu(host, opt);

        auto expect_poison = [](const std::vector<uint8_t>& bytes, const std::string& what) {
          EXPECT_EQ(std::count(bytes.begin(), bytes.end(), kPoison), std::ptrdiff_t(bytes.size()))
              << what << " was written";
        };
        for (Operand op : {Operand::kQ, Operand::kK, Operand::kV, Operand::kDO}) {
          const std::string name = to_string(op);
          const E4M3Operand &w = cpu.operand(op), &g = gpu.operand(op);
          ASSERT_FALSE(g.codes.empty()) << name;
          if (op == only) {
            expect_bytes(w.codes, g.codes, name + " codes");
            expect_bytes(w.codes_t, g.codes_t, name + " codes_t");
            expect_bytes(w.exponents, g.exponents, name + " exponents");
            expect_bytes(w.channel_exponents, g.channel_exponents, name + " channel_exponents");
          } else {
            for (const auto* a : {&g.codes, &g.codes_t, &g.exponents, &g.channel_exponents})
              expect_poison(*a, name);
          }
          EXPECT_EQ(gpu.non_finite.first_index[int(op)], cpu.non_finite.first_index[int(op)])
              << name;
        }
        EXPECT_EQ(cpu.non_finite.first_index[int(Operand::kQ)], -1);
        for (const auto* a : {&gpu.q4.packed, &gpu.q4.local_scales, &gpu.q4.exponents})
          expect_poison(*a, "Q4");
        if (only == Operand::kK) {
          expect_bytes(cpu.k4.packed, gpu.k4.packed, "K4 packed");
          expect_bytes(cpu.k4.local_scales, gpu.k4.local_scales, "K4 local_scales");
          expect_bytes(cpu.k4.exponents, gpu.k4.exponents, "K4 exponents");
        } else {
          for (const auto* a : {&gpu.k4.packed, &gpu.k4.local_scales, &gpu.k4.exponents})
            expect_poison(*a, "K4");
        }
      }
    }
  }
}

}  // namespace
}  // namespace flamia
