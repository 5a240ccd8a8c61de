// FP8 GEMM test vehicle against a CPU reference: exact on small integers (f32 and bf16 outputs,
// full and partial tiles, several persistent-CTA counts), within the tensor cores' accumulator
// precision on random E4M3 codes, and clear errors for unsupported shapes. Outputs are poisoned,
// with a guard region after C that must stay poisoned.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "flamia/formats.h"
#include "gemm_fp8.h"
#include "gpu_test.h"
#include "sm90_test_util.h"

namespace flamia {
namespace {

using sm90::GemmFp8Problem;
using sm90::GemmFp8Tuning;
using sm90::GemmOutType;
using test::DeviceBuffer;

constexpr size_t kGuard = 1024;   // elements after C that must stay untouched
constexpr int kIntMagnitude = 4;  // integer inputs in [-4, 4]: exact products and sums
constexpr uint16_t kBf16Poison = 0xFFFF;

struct Operands {
  std::vector<uint8_t> a, b;  // e4m3 codes
  std::vector<float> av, bv;  // decoded
};

Operands integer_operands(int64_t m, int64_t n, int64_t k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(-kIntMagnitude, kIntMagnitude);
  Operands o;
  auto fill = [&](std::vector<uint8_t>& codes, std::vector<float>& vals, int64_t rows) {
    codes.resize(size_t(rows * k));
    vals.resize(codes.size());
    for (size_t i = 0; i < codes.size(); ++i) {
      codes[i] = e4m3::encode(float(dist(rng)));
      vals[i] = e4m3::decode(codes[i]);
    }
  };
  fill(o.a, o.av, m);
  fill(o.b, o.bv, n);
  return o;
}

// Any finite E4M3 code (NaN codes 0x7F / 0xFF excluded), so magnitudes span 2^-9 .. 448.
Operands random_operands(int64_t m, int64_t n, int64_t k, uint32_t seed) {
  std::mt19937 rng(seed);
  Operands o;
  auto fill = [&](std::vector<uint8_t>& codes, std::vector<float>& vals, int64_t rows) {
    codes.resize(size_t(rows * k));
    vals.resize(codes.size());
    for (size_t i = 0; i < codes.size(); ++i) {
      uint8_t c;
      do c = uint8_t(rng());
      while (e4m3::is_nan(c));
      codes[i] = c;
      vals[i] = e4m3::decode(c);
    }
  };
  fill(o.a, o.av, m);
  fill(o.b, o.bv, n);
  return o;
}

// Reference C and, per element, sum |a||b| (the scale of the rounding error).
void reference(const Operands& o, int64_t m, int64_t n, int64_t k, std::vector<double>& c,
               std::vector<double>& mag) {
  c.assign(size_t(m * n), 0.0);
  mag.assign(size_t(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0, a = 0;
      const float* ar = &o.av[size_t(i * k)];
      const float* br = &o.bv[size_t(j * k)];
      for (int64_t kk = 0; kk < k; ++kk) {
        const double p = double(ar[kk]) * double(br[kk]);
        s += p;
        a += std::fabs(p);
      }
      c[size_t(i * n + j)] = s;
      mag[size_t(i * n + j)] = a;
    }
  }
}

// Runs the GEMM and returns C as floats (bf16 decoded); checks the guard region.
std::vector<float> run_gemm(const Operands& o, int64_t m, int64_t n, int64_t k, GemmOutType out,
                            const GemmFp8Tuning& tuning) {
  DeviceBuffer<uint8_t> a(o.a), b(o.b);
  const size_t count = size_t(m * n);
  std::vector<float> result(count);
  if (out == GemmOutType::kF32) {
    DeviceBuffer<float> c(count + kGuard);
    c.poison();
    sm90::gemm_fp8({a.get(), b.get(), c.get(), m, n, k, out}, nullptr, tuning);
    test::sync_checked();
    const std::vector<float> h = c.download();
    for (size_t i = count; i < h.size(); ++i) EXPECT_TRUE(std::isnan(h[i])) << "guard " << i;
    std::copy(h.begin(), h.begin() + count, result.begin());
  } else {
    DeviceBuffer<uint16_t> c(count + kGuard);
    c.poison();
    sm90::gemm_fp8({a.get(), b.get(), c.get(), m, n, k, out}, nullptr, tuning);
    test::sync_checked();
    const std::vector<uint16_t> h = c.download();
    for (size_t i = count; i < h.size(); ++i) EXPECT_EQ(h[i], kBf16Poison) << "guard " << i;
    for (size_t i = 0; i < count; ++i) result[i] = bf16::decode(h[i]);
  }
  return result;
}

struct Shape {
  int64_t m, n, k;
};

// Exact comparison: the f32 reference of integer inputs is exact, and bf16 is its RNE rounding.
void expect_exact(const Shape& s, GemmOutType out, const GemmFp8Tuning& tuning, uint32_t seed) {
  const Operands o = integer_operands(s.m, s.n, s.k, seed);
  std::vector<double> ref, mag;
  reference(o, s.m, s.n, s.k, ref, mag);
  const std::vector<float> got = run_gemm(o, s.m, s.n, s.k, out, tuning);
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float want =
        out == GemmOutType::kF32 ? float(ref[i]) : bf16::decode(bf16::encode(float(ref[i])));
    if (!(got[i] == want) && ++bad <= 5)
      ADD_FAILURE() << s.m << "x" << s.n << "x" << s.k << " C(" << i / s.n << ", " << i % s.n
                    << ") = " << got[i] << ", want " << want;
  }
  EXPECT_EQ(bad, 0) << s.m << "x" << s.n << "x" << s.k;
}

TEST(GpuGemmFp8, IntegerInputsExactF32) {
  FLAMIA_REQUIRE_GPU();
  for (const Shape& s : {Shape{128, 256, 128}, Shape{256, 512, 1024}, Shape{200, 300, 208},
                         Shape{1, 1, 16}, Shape{129, 257, 144}, Shape{64, 1000, 400}})
    expect_exact(s, GemmOutType::kF32, {}, 7);
}

TEST(GpuGemmFp8, IntegerInputsExactBf16) {
  FLAMIA_REQUIRE_GPU();
  for (const Shape& s : {Shape{128, 256, 128}, Shape{384, 512, 512}, Shape{77, 301, 48}})
    expect_exact(s, GemmOutType::kBF16, {}, 8);
}

// Few persistent CTAs: each walks many tiles, so the pipeline's phases carry across tiles and the
// raster wraps; an odd N takes the unpaired store path.
TEST(GpuGemmFp8, PersistentCtasWalkManyTiles) {
  FLAMIA_REQUIRE_GPU();
  const Shape s{640, 1283, 400};
  for (auto [ctas, group] : {std::pair{1, 8}, std::pair{3, 2}, std::pair{7, 3}}) {
    GemmFp8Tuning t;
    t.max_ctas = ctas;
    t.raster_group = group;
    expect_exact(s, GemmOutType::kF32, t, 9);
  }
}

// Hopper's FP8 MMA does not accumulate in full FP32: products are aligned to the running maximum
// and reportedly about 14 significant bits survive (DeepSeek-V3 report, arXiv 2412.19437,
// "Increasing Accumulation Precision"). On
// the H200 this test measured a worst error of 2^-10 of sum |a||b| at K = 2048. Bound: each k32
// instruction may lose 2^-kQgmmaAccumulatorBits of the magnitude accumulated so far. A wrong
// mapping or a dropped K step errs by O(1) of sum |a||b| and still fails.
constexpr int kQgmmaAccumulatorBits = 13;
constexpr int kQgmmaK = 32;

TEST(GpuGemmFp8, RandomCodesWithinAccumulatorPrecision) {
  FLAMIA_REQUIRE_GPU();
  const Shape s{256, 512, 2048};
  const Operands o = random_operands(s.m, s.n, s.k, 10);
  std::vector<double> ref, mag;
  reference(o, s.m, s.n, s.k, ref, mag);
  const std::vector<float> got = run_gemm(o, s.m, s.n, s.k, GemmOutType::kF32, {});
  const double tol = double(s.k / kQgmmaK) * std::ldexp(1.0, -kQgmmaAccumulatorBits);
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << i;
    worst = std::max(worst, std::fabs(got[i] - ref[i]) / std::max(mag[i], 1e-30));
  }
  EXPECT_LE(worst, tol);
}

TEST(GpuGemmFp8, UnsupportedShapesAreRejected) {
  FLAMIA_REQUIRE_GPU();
  DeviceBuffer<uint8_t> a(4096), b(4096);
  DeviceBuffer<float> c(4096);
  auto problem = [&](int64_t m, int64_t n, int64_t k) {
    return GemmFp8Problem{a.get(), b.get(), c.get(), m, n, k, GemmOutType::kF32};
  };
  EXPECT_THROW(sm90::GemmFp8Plan{problem(16, 16, 8)}, Error);    // K below 16
  EXPECT_THROW(sm90::GemmFp8Plan{problem(16, 16, 100)}, Error);  // K not a multiple of 16
  EXPECT_THROW(sm90::GemmFp8Plan{problem(0, 16, 32)}, Error);    // empty
  GemmFp8Problem misaligned = problem(16, 16, 32);
  misaligned.a = a.get() + 1;
  EXPECT_THROW(sm90::GemmFp8Plan{misaligned}, Error);
  EXPECT_NO_THROW(sm90::GemmFp8Plan{problem(16, 16, 32)});
}

TEST(GpuGemmFp8, KernelUsesNoLocalMemory) {
  FLAMIA_REQUIRE_GPU();
  for (GemmOutType out : {GemmOutType::kF32, GemmOutType::kBF16}) {
    const cudaFuncAttributes attr = sm90::gemm_fp8_kernel_attributes(out);
    EXPECT_EQ(attr.localSizeBytes, 0u) << "register spills";
  }
}

}  // namespace
}  // namespace flamia
