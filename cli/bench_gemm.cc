// `flamia bench gemm`: the FP8 GEMM test vehicle next to cuBLASLt's FP8 GEMM, same inputs, same
// run. C[M, N] = A[M, K] · B[N, K]^T with E4M3 operands (fresh random non-zero codes drawn on the
// GPU), FP32 accumulation. Each implementation is warmed up, then the reps of all implementations
// are interleaved, each timed with its own pair of CUDA events; the table reports the median (and
// the spread) of the reps.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "args.h"
#include "check.h"
#include "commands.h"
#include "flamia/device.h"
#include "flamia/formats.h"
#include "gemm_fp8.h"
#include "table.h"

namespace flamia::cli {
namespace {

constexpr int kMinReps = 20;
constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;
constexpr double kFlopsPerMac = 2.0;
constexpr double kTera = 1e12;
constexpr double kMsPerS = 1e3;
constexpr uint8_t kPoisonByte = 0xFF;  // NaN in f32 and bf16: unwritten outputs show

template <typename T>
class DeviceMemory {
 public:
  explicit DeviceMemory(size_t count) : bytes_(count * sizeof(T)) {
    FLAMIA_CUDA_CHECK(cudaMalloc(&ptr_, bytes_));
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() {
    if (cudaFree(ptr_) != cudaSuccess) std::cerr << "flamia bench gemm: cudaFree failed\n";
  }
  T* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  T* ptr_ = nullptr;
  size_t bytes_ = 0;
};

struct Timing {
  double median_ms = 0, min_ms = 0, max_ms = 0;
};

// Warm-up launches of each implementation, then `reps` rounds in which every implementation runs
// once between its own pair of events: interleaving spreads clock and temperature drift evenly
// over the implementations. No host sync until all rounds are queued.
std::vector<Timing> time_interleaved(const std::vector<std::function<void()>>& launches, int warmup,
                                     int reps, cudaStream_t stream) {
  const size_t impls = launches.size();
  for (const auto& launch : launches)
    for (int i = 0; i < warmup; ++i) launch();
  std::vector<cudaEvent_t> start(impls * reps), stop(impls * reps);
  for (size_t i = 0; i < start.size(); ++i) {
    FLAMIA_CUDA_CHECK(cudaEventCreate(&start[i]));
    FLAMIA_CUDA_CHECK(cudaEventCreate(&stop[i]));
  }
  for (int r = 0; r < reps; ++r) {
    for (size_t j = 0; j < impls; ++j) {
      FLAMIA_CUDA_CHECK(cudaEventRecord(start[r * impls + j], stream));
      launches[j]();
      FLAMIA_CUDA_CHECK(cudaEventRecord(stop[r * impls + j], stream));
    }
  }
  FLAMIA_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<Timing> result(impls);
  for (size_t j = 0; j < impls; ++j) {
    std::vector<double> ms(reps);
    for (int r = 0; r < reps; ++r) {
      float t = 0;
      FLAMIA_CUDA_CHECK(cudaEventElapsedTime(&t, start[r * impls + j], stop[r * impls + j]));
      ms[r] = t;
    }
    std::sort(ms.begin(), ms.end());
    result[j].median_ms = reps % 2 ? ms[reps / 2] : 0.5 * (ms[reps / 2 - 1] + ms[reps / 2]);
    result[j].min_ms = ms.front();
    result[j].max_ms = ms.back();
  }
  for (size_t i = 0; i < start.size(); ++i) {
    FLAMIA_CUDA_CHECK(cudaEventDestroy(start[i]));
    FLAMIA_CUDA_CHECK(cudaEventDestroy(stop[i]));
  }
  return result;
}

// cuBLASLt FP8 GEMM computing the same row-major C. cuBLASLt is column-major and FP8 needs the
// "TN" form, so it computes C^T[N, M] = B · A^T: its A is our B ([N][K] row-major = K x N
// column-major, transposed), its B is our A (K x M column-major), its D is C^T (N x M, ld N).
class CublasLtFp8 {
 public:
  CublasLtFp8(const sm90::GemmFp8Problem& p, bool fast_accum, cudaStream_t stream)
      : problem_(p), stream_(stream), workspace_(kCublasWorkspaceBytes) {
    const cudaDataType out = p.out == sm90::GemmOutType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
    FLAMIA_CUDA_CHECK(cublasLtCreate(&handle_));
    FLAMIA_CUDA_CHECK(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t trans = CUBLAS_OP_T, no_trans = CUBLAS_OP_N;
    FLAMIA_CUDA_CHECK(
        cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans)));
    FLAMIA_CUDA_CHECK(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &no_trans,
                                                     sizeof(no_trans)));
    const int8_t fast = fast_accum ? 1 : 0;
    FLAMIA_CUDA_CHECK(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast,
                                                     sizeof(fast)));
    FLAMIA_CUDA_CHECK(cublasLtMatrixLayoutCreate(&layout_a_, CUDA_R_8F_E4M3, p.k, p.n, p.k));
    FLAMIA_CUDA_CHECK(cublasLtMatrixLayoutCreate(&layout_b_, CUDA_R_8F_E4M3, p.k, p.m, p.k));
    FLAMIA_CUDA_CHECK(cublasLtMatrixLayoutCreate(&layout_c_, out, p.n, p.m, p.n));
    FLAMIA_CUDA_CHECK(cublasLtMatmulPreferenceCreate(&pref_));
    const size_t ws = workspace_.bytes();
    FLAMIA_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref_, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    int found = 0;
    FLAMIA_CUDA_CHECK(cublasLtMatmulAlgoGetHeuristic(
        handle_, desc_, layout_a_, layout_b_, layout_c_, layout_c_, pref_, 1, &heuristic_, &found));
    if (found == 0) throw Error("cuBLASLt offers no FP8 algorithm for this problem");
  }
  CublasLtFp8(const CublasLtFp8&) = delete;
  CublasLtFp8& operator=(const CublasLtFp8&) = delete;
  ~CublasLtFp8() {
    bool ok = cublasLtMatmulPreferenceDestroy(pref_) == CUBLAS_STATUS_SUCCESS;
    ok &= cublasLtMatrixLayoutDestroy(layout_c_) == CUBLAS_STATUS_SUCCESS;
    ok &= cublasLtMatrixLayoutDestroy(layout_b_) == CUBLAS_STATUS_SUCCESS;
    ok &= cublasLtMatrixLayoutDestroy(layout_a_) == CUBLAS_STATUS_SUCCESS;
    ok &= cublasLtMatmulDescDestroy(desc_) == CUBLAS_STATUS_SUCCESS;
    ok &= cublasLtDestroy(handle_) == CUBLAS_STATUS_SUCCESS;
    if (!ok) std::cerr << "flamia bench gemm: cuBLASLt teardown failed\n";
  }

  void run() const {
    const float alpha = 1.0f, beta = 0.0f;
    FLAMIA_CUDA_CHECK(cublasLtMatmul(handle_, desc_, &alpha, problem_.b, layout_a_, problem_.a,
                                     layout_b_, &beta, problem_.c, layout_c_, problem_.c, layout_c_,
                                     &heuristic_.algo, workspace_.get(), workspace_.bytes(),
                                     stream_));
  }

 private:
  sm90::GemmFp8Problem problem_;
  cudaStream_t stream_;
  DeviceMemory<uint8_t> workspace_;
  cublasLtHandle_t handle_ = nullptr;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t layout_a_ = nullptr, layout_b_ = nullptr, layout_c_ = nullptr;
  cublasLtMatmulPreference_t pref_ = nullptr;
  cublasLtMatmulHeuristicResult_t heuristic_{};
};

std::vector<float> download_as_float(const void* c, size_t count, sm90::GemmOutType out) {
  std::vector<float> host(count);
  if (out == sm90::GemmOutType::kF32) {
    FLAMIA_CUDA_CHECK(cudaMemcpy(host.data(), c, count * sizeof(float), cudaMemcpyDeviceToHost));
  } else {
    std::vector<uint16_t> bits(count);
    FLAMIA_CUDA_CHECK(cudaMemcpy(bits.data(), c, count * sizeof(uint16_t), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < count; ++i) host[i] = bf16::decode(bits[i]);
  }
  return host;
}

struct Difference {
  double max_rel = 0;         // max |ours - ref| / max |ref|
  double equal_fraction = 0;  // elements with identical values
};

Difference compare(const std::vector<float>& ours, const std::vector<float>& ref) {
  double max_diff = 0, max_ref = 0;
  size_t equal = 0;
  for (size_t i = 0; i < ours.size(); ++i) {
    max_diff = std::max(max_diff, double(std::fabs(ours[i] - ref[i])));
    max_ref = std::max(max_ref, double(std::fabs(ref[i])));
    equal += ours[i] == ref[i];
  }
  Difference d;
  d.max_rel = max_ref > 0 ? max_diff / max_ref : max_diff;
  d.equal_fraction = ours.empty() ? 1.0 : double(equal) / double(ours.size());
  return d;
}

}  // namespace

int bench_gemm(int argc, char** argv, int first) {
  Args args("bench gemm",
            "Times the FP8 GEMM test vehicle (TMA + mbarrier pipeline + warp-specialised QGMMA) "
            "and cuBLASLt's FP8 GEMM on the same fresh random E4M3 inputs, C = A * B^T.",
            {{"m", "8192", "rows of A and C"},
             {"n", "8192", "rows of B, columns of C"},
             {"k", "8192", "contraction length (multiple of 16)"},
             {"reps", "50", "timed reps per implementation (at least 20)"},
             {"warmup", "10", "untimed launches before the reps"},
             {"out", "bf16", "output type: bf16 or f32"},
             {"seed", "", "input seed (default: drawn from the clock, so inputs are fresh)"},
             {"raster-group", "8", "tuning: tile rows walked together"},
             {"ctas", "0", "tuning: persistent CTAs (0 = one per multiprocessor)"},
             {"json", "", "print the table as JSON", true},
             {"csv", "", "print the table as CSV", true}},
            argc, argv, first);
  if (args.help_requested()) {
    std::cout << args.usage();
    return 0;
  }
  const int64_t m = args.integer("m"), n = args.integer("n"), k = args.integer("k");
  const int reps = int(args.integer("reps")), warmup = int(args.integer("warmup"));
  if (reps < kMinReps) throw Error("--reps must be at least " + std::to_string(kMinReps));
  if (warmup < 1) throw Error("--warmup must be at least 1");
  const std::string out_name = args.str("out");
  if (out_name != "bf16" && out_name != "f32") throw Error("--out must be bf16 or f32");
  const sm90::GemmOutType out =
      out_name == "f32" ? sm90::GemmOutType::kF32 : sm90::GemmOutType::kBF16;
  const uint64_t seed = args.str("seed").empty()
                            ? uint64_t(std::chrono::steady_clock::now().time_since_epoch().count())
                            : uint64_t(args.integer("seed"));
  sm90::GemmFp8Tuning tuning;
  tuning.raster_group = int(args.integer("raster-group"));
  tuning.max_ctas = int(args.integer("ctas"));
  const DeviceInfo dev = bench_device();

  cudaStream_t stream = nullptr;
  FLAMIA_CUDA_CHECK(cudaStreamCreate(&stream));
  const size_t out_elem = out == sm90::GemmOutType::kF32 ? sizeof(float) : sizeof(uint16_t);
  const size_t c_count = size_t(m) * size_t(n);
  DeviceMemory<uint8_t> a(size_t(m) * size_t(k)), b(size_t(n) * size_t(k));
  DeviceMemory<uint8_t> c_ours(c_count * out_elem), c_fast(c_count * out_elem),
      c_default(c_count * out_elem);
  sm90::fill_random_e4m3(a.get(), a.bytes(), seed, stream);
  sm90::fill_random_e4m3(b.get(), b.bytes(), seed + 1, stream);
  for (const auto* c : {&c_ours, &c_fast, &c_default})
    FLAMIA_CUDA_CHECK(cudaMemsetAsync(c->get(), kPoisonByte, c->bytes(), stream));

  const sm90::GemmFp8Problem ours_problem{a.get(), b.get(), c_ours.get(), m, n, k, out};
  sm90::GemmFp8Problem fast_problem = ours_problem, default_problem = ours_problem;
  fast_problem.c = c_fast.get();
  default_problem.c = c_default.get();
  const sm90::GemmFp8Plan plan(ours_problem, tuning);
  const CublasLtFp8 blas_fast(fast_problem, true, stream);
  const CublasLtFp8 blas_default(default_problem, false, stream);

  const std::vector<Timing> times = time_interleaved(
      {[&] { plan.launch(stream); }, [&] { blas_fast.run(); }, [&] { blas_default.run(); }}, warmup,
      reps, stream);
  const Timing &t_ours = times[0], &t_fast = times[1], &t_default = times[2];

  const std::vector<float> ours = download_as_float(c_ours.get(), c_count, out);
  const size_t non_finite =
      size_t(std::count_if(ours.begin(), ours.end(), [](float x) { return !std::isfinite(x); }));
  const Difference vs_fast = compare(ours, download_as_float(c_fast.get(), c_count, out));
  const Difference vs_default = compare(ours, download_as_float(c_default.get(), c_count, out));
  FLAMIA_CUDA_CHECK(cudaStreamDestroy(stream));

  const double flops = kFlopsPerMac * double(m) * double(n) * double(k);
  auto tflops = [&](double ms) { return flops / (ms / kMsPerS) / kTera; };
  Table table;
  table.title = "FP8 GEMM C[M,N] = A[M,K] B[N,K]^T, e4m3 in, fp32 accumulate, " + out_name +
                " out, " + dev.name;
  table.columns = {"kernel",  "M",      "N",      "K",          "median ms",
                   "TFLOP/s", "min ms", "max ms", "vs cuBLASLt"};
  auto row = [&](const std::string& name, const Timing& t) {
    table.add_row({name, std::to_string(m), std::to_string(n), std::to_string(k),
                   fmt(t.median_ms, 4), fmt(tflops(t.median_ms), 1), fmt(t.min_ms, 4),
                   fmt(t.max_ms, 4), fmt(t_fast.median_ms / t.median_ms, 3)});
  };
  row("flamia gemm_fp8 (" + std::to_string(sm90::kGemmFp8BlockM) + "x" +
          std::to_string(sm90::kGemmFp8BlockN) + "x" + std::to_string(sm90::kGemmFp8BlockK) + ", " +
          std::to_string(sm90::kGemmFp8Stages) + " stages, " + std::to_string(plan.ctas()) +
          " CTAs)",
      t_ours);
  row("cuBLASLt fp8, fast accumulation", t_fast);
  row("cuBLASLt fp8, default accumulation", t_default);
  table.notes.push_back("median of " + std::to_string(reps) + " reps after " +
                        std::to_string(warmup) +
                        " warm-up launches, implementations interleaved, one CUDA event pair per "
                        "rep; " +
                        "'vs cuBLASLt' = cuBLASLt fast-accumulation time / this row's time");
  table.notes.push_back("inputs: random non-zero e4m3, |x| in [1/8, 2), seed " +
                        std::to_string(seed));
  auto describe = [](const Difference& d) {
    return "max |diff| / max |ref| = " + fmt_sci(d.max_rel) + ", bitwise equal " +
           fmt(100.0 * d.equal_fraction, 2) + "%";
  };
  table.notes.push_back("flamia vs cuBLASLt fast accumulation: " + describe(vs_fast) +
                        "; vs default accumulation: " + describe(vs_default) +
                        "; non-finite flamia outputs: " + std::to_string(non_finite));
  if (args.flag("json")) {
    table.print_json(std::cout);
  } else if (args.flag("csv")) {
    table.print_csv(std::cout);
  } else {
    table.print_text(std::cout);
  }
  return non_finite == 0 ? 0 : 1;
}

}  // namespace flamia::cli
