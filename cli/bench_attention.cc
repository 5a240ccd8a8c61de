// `flamia bench attention` (the default `flamia bench`): the packed causal workloads, flamia's
// stages (the fused quantizer; per recipe the forward from BF16 and from quantized operands, the
// backward from quantized operands and the training call from BF16), and the cuDNN peers a user
// would pick instead, in one run.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <utility>

#include "args.h"
#include "commands.h"
#include "cudnn_sdpa.h"
#include "device_buffer.h"
#include "flamia/attention_gpu.h"
#include "flamia/device.h"
#include "flamia/quantize_gpu.h"
#include "flamia/workloads.h"
#include "fp8_cast.h"
#include "quantize_outputs.h"
#include "random_fill.h"
#include "table.h"
#include "timing.h"

namespace flamia::cli {
namespace {

using bench::CudnnLayout;
using bench::CudnnPrecision;
using bench::CudnnSdpa;
using cuda::DeviceBuffer;

constexpr int kMinReps = 20;
constexpr int kInputSets = 2;         // input sets rotated between reps
constexpr double kMaxPaddedGiB = 64;  // a padded peer layout larger than this is not attempted
constexpr float kProbabilityScale = 256.0f;  // cuDNN FP8: P in [0, 1] scaled into E4M3's range
constexpr double kTera = 1e12, kMsPerS = 1e3;

// DESIGN §7 (H200, cuDNN 9.19): BF16 fwd, BF16 fwd+bwd, FP8 fwd, FP8 fwd+bwd, in ms.
struct Reference {
  double bf16_fwd, bf16_total, fp8_fwd, fp8_total;
};
const std::map<std::string, Reference> kDesignReference = {
    {"16x4096", {1.80, 7.51, 1.50, 9.96}},      {"8x8192", {3.40, 14.38, 2.84, 18.81}},
    {"4x16384", {7.55, 28.31, 4.98, 33.18}},    {"2x32768", {15.14, 55.83, 9.74, 41.12}},
    {"1x65536", {28.95, 109.35, 19.36, 78.79}}, {"4x16384-gqa", {7.43, 28.32, 4.75, 34.88}}};

struct Stage {
  std::string impl, stage, layout;
  double ms = 0, flops = 0;
  bool graph = false;
};

struct PeerOutcome {
  std::string impl;
  bool ok = false;
  std::string reason;  // why not, when !ok
  double fwd_ms = 0, bwd_ms = 0, call_ms = 0;
};

// flamia's stages of one recipe, in ms; 0 for a stage not run (after a failure: `reason`).
struct FlamiaOutcome {
  Recipe recipe;
  std::string reason;    // why the stages stopped; empty when all ran
  double fwd_ms = 0;     // forward from BF16, quantizer included
  double kernel_ms = 0;  // forward kernel on quantized operands
  double bwd_ms = 0;     // backward on quantized operands (its kernels, either form)
  double call_ms = 0;    // training call from BF16: forward, then backward, quantizers included
};

struct WorkloadResult {
  Workload w;
  std::vector<Stage> stages;
  std::vector<PeerOutcome> peers;
  std::vector<FlamiaOutcome> flamia;  // in Options::recipes order
  double quantize_ms = 0;
};

struct Options {
  int reps = 30, warmup = 5;
  double warmup_ms = bench::kSustainedWarmupMs;  // each stage's warm-up lasts at least this long
  bool graphs = true;
  BackwardForm backward_form = BackwardForm::kAuto;  // the default backward's (--backward)
  bool deterministic = false;                        // also time the backward with deterministic dQ
  bool hadamard = false;                             // Q and K Hadamard-rotated (mxfp8 only)
  bool peer_bf16 = true, peer_fp8 = true;            // cuDNN peers timed (--peers)
  std::vector<Recipe> recipes{Recipe::kMxfp8, Recipe::kMxfp8Qk16};  // flamia recipes timed
};

// An Error's message without the "flamia: " its constructor adds, to nest it in another.
std::string bare(const Error& e) {
  const std::string m = e.what(), prefix = "flamia: ";
  return m.compare(0, prefix.size(), prefix) == 0 ? m.substr(prefix.size()) : m;
}

std::string impl_name(Recipe r, bool hadamard) {
  return std::string("flamia ") + to_string(r) + (hadamard ? " + Hadamard" : "");
}

PackedLayout packed_layout(const Workload& w, const std::vector<int32_t>& cu_seqlens) {
  return {cu_seqlens.data(), int(cu_seqlens.size()) - 1, w.tokens(), w.heads_q, w.heads_kv,
          w.head_dim};
}

GpuAttentionOptions gpu_options(const Workload& w, Recipe recipe, bool hadamard,
                                BackwardForm form = BackwardForm::kAuto,
                                bool deterministic = false) {
  GpuAttentionOptions go;
  go.recipe = recipe;
  go.hadamard = hadamard;
  go.attention.causal = w.causal;
  go.attention.softmax_scale = 1.0 / std::sqrt(double(w.head_dim));
  go.backward_form = form;
  go.deterministic = deterministic;
  return go;
}

// --backward's values.
constexpr std::pair<const char*, BackwardForm> kBackwardForms[] = {{"auto", BackwardForm::kAuto},
                                                                   {"fused", BackwardForm::kFused},
                                                                   {"split", BackwardForm::kSplit}};

const char* form_name(BackwardForm form) {
  for (const auto& [name, f] : kBackwardForms)
    if (f == form) return name;
  return "?";
}

// Everything one workload allocates: BF16 tensors (inputs in kInputSets sets), E4M3 tensors for
// the FP8 peer, and the packing metadata.
struct Buffers {
  int64_t q_elems = 0, kv_elems = 0;
  std::vector<DeviceBuffer> q, k, v, dout;  // per input set
  DeviceBuffer o, dq, dk, dv, stats;
  DeviceBuffer seq_len, ragged_q, ragged_kv, cu_seqlens, pad_row;
  DeviceBuffer scalars;  // FP8 scales, descales and amaxes
};

enum Scalar {
  kDescaleQ,
  kDescaleK,
  kDescaleV,
  kDescaleO,
  kDescaleDO,
  kDescaleS,
  kScaleS,
  kDescaleDP,
  kScaleDP,
  kScaleO,
  kScaleDQ,
  kScaleDK,
  kScaleDV,
  kAmaxQ,
  kAmaxK,
  kAmaxV,
  kAmaxDO,
  kAmaxOut,
  kNumScalars = kAmaxOut + 6
};

void fill(DeviceBuffer& b, uint64_t seed, cudaStream_t s) {
  cuda::fill_random_bf16(b.get<uint16_t>(), int64_t(b.bytes() / sizeof(uint16_t)), seed, s);
}

Buffers make_buffers(const Workload& w, const bench::SdpaProblem& p, uint64_t seed,
                     cudaStream_t s) {
  Buffers b;
  const int64_t T = w.tokens();
  b.q_elems = T * w.heads_q * w.head_dim;
  b.kv_elems = T * w.heads_kv * w.head_dim;
  for (int set = 0; set < kInputSets; ++set) {
    b.q.emplace_back(b.q_elems * 2);
    b.k.emplace_back(b.kv_elems * 2);
    b.v.emplace_back(b.kv_elems * 2);
    b.dout.emplace_back(b.q_elems * 2);
    for (auto* t : {&b.q.back(), &b.k.back(), &b.v.back(), &b.dout.back()}) fill(*t, seed++, s);
  }
  b.o = DeviceBuffer(b.q_elems * 2);
  b.dq = DeviceBuffer(b.q_elems * 2);
  b.dk = DeviceBuffer(b.kv_elems * 2);
  b.dv = DeviceBuffer(b.kv_elems * 2);
  fill(b.o, seed++, s);
  b.stats = DeviceBuffer(sizeof(float) * size_t(p.docs.size() * w.heads_q * p.max_len()));
  const std::vector<int32_t> cu = cu_seqlens_from_lengths(w.docs);
  std::vector<int32_t> seq(w.docs.begin(), w.docs.end());
  std::vector<int64_t> rq(cu.size()), rkv(cu.size()), pad(static_cast<size_t>(T));
  for (size_t i = 0; i < cu.size(); ++i) {
    rq[i] = int64_t(cu[i]) * w.heads_q * w.head_dim;
    rkv[i] = int64_t(cu[i]) * w.heads_kv * w.head_dim;
  }
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int64_t t = cu[d]; t < cu[d + 1]; ++t)
      pad[size_t(t)] = int64_t(d) * p.max_len() + (t - cu[d]);
  // In the stream: the stages run on a non-blocking stream, which does not wait for the legacy
  // default stream's copies.
  b.seq_len = DeviceBuffer::upload(seq, s);
  b.ragged_q = DeviceBuffer::upload(rq, s);
  b.ragged_kv = DeviceBuffer::upload(rkv, s);
  b.cu_seqlens = DeviceBuffer::upload(cu, s);
  b.pad_row = DeviceBuffer::upload(pad, s);
  std::vector<float> scalars(kNumScalars, 1.0f);
  scalars[kScaleS] = kProbabilityScale;
  scalars[kDescaleS] = 1.0f / kProbabilityScale;
  b.scalars = DeviceBuffer::upload(scalars, s);
  return b;
}

bench::SdpaProblem problem_of(const Workload& w) {
  bench::SdpaProblem p;
  p.docs = w.docs;
  p.heads_q = w.heads_q;
  p.heads_kv = w.heads_kv;
  p.dim = w.head_dim;
  p.causal = w.causal;
  p.softmax_scale = 1.0f / std::sqrt(float(w.head_dim));
  return p;
}

// Builds a peer, ragged first (no padding work), then padded if cuDNN refuses ragged.
std::unique_ptr<CudnnSdpa> build_peer(const bench::SdpaProblem& p, CudnnPrecision precision,
                                      cudaStream_t s, std::string* reason) {
  std::string ragged_reason;
  auto peer = CudnnSdpa::build(p, precision, CudnnLayout::kRagged, s, &ragged_reason);
  if (peer) return peer;
  const double bytes = double(p.rows(CudnnLayout::kPadded)) * (p.heads_q + p.heads_kv) * p.dim *
                       (precision == CudnnPrecision::kFp8 ? 1 : 2) * 4;
  if (bytes > kMaxPaddedGiB * (1u << 30)) {
    *reason = "ragged: " + ragged_reason + "; padded layout needs " +
              std::to_string(int(bytes / (1u << 30))) + " GiB";
    return nullptr;
  }
  std::string padded_reason;
  peer = CudnnSdpa::build(p, precision, CudnnLayout::kPadded, s, &padded_reason);
  if (!peer) *reason = "ragged: " + ragged_reason + "; padded: " + padded_reason;
  if (peer)
    std::cerr << "[bench] ragged layout refused, padded used: " << ragged_reason << std::endl;
  return peer;
}

// Tensors a peer reads and writes when its layout is padded (and for FP8 in any layout).
struct PeerTensors {
  DeviceBuffer q, k, v, o, dout, dq, dk, dv;
};

PeerTensors make_peer_tensors(const bench::SdpaProblem& p, CudnnLayout layout, size_t elem_bytes,
                              uint64_t seed, cudaStream_t s) {
  const int64_t rows = p.rows(layout);
  const size_t qb = size_t(rows * p.heads_q * p.dim) * elem_bytes;
  const size_t kvb = size_t(rows * p.heads_kv * p.dim) * elem_bytes;
  PeerTensors t{DeviceBuffer(qb), DeviceBuffer(kvb), DeviceBuffer(kvb), DeviceBuffer(qb),
                DeviceBuffer(qb), DeviceBuffer(qb),  DeviceBuffer(kvb), DeviceBuffer(kvb)};
  for (DeviceBuffer* x : {&t.q, &t.k, &t.v, &t.o, &t.dout}) fill(*x, seed++, s);
  return t;
}

// flamia's side of one workload: per input set the BF16 inputs (the peers' buffers), the
// quantized operands of the kernel-alone stages (Q, K, V, dO with transposed codes) and the O and
// LSE the forward writes and the backward reads; and the calls on them.
class FlamiaWorkload {
 public:
  FlamiaWorkload(const Workload& w, const Buffers& b, bool hadamard)
      : w_(w), b_(b), cu_(cu_seqlens_from_lengths(w.docs)), hadamard_(hadamard) {}

  PackedLayout layout() const { return packed_layout(w_, cu_); }
  // Token policy with transposed copies (what the kernels consume), Q and K rotated with
  // --hadamard.
  QuantizeOptions quantize_options() const {
    QuantizeOptions q;
    q.hadamard = hadamard_;
    return q;
  }

  DeviceAttentionInputs inputs(int set) const {
    const size_t s = size_t(set);
    return dense_device_inputs(layout(), b_.cu_seqlens.get<int32_t>(), b_.q[s].get<uint16_t>(),
                               b_.k[s].get<uint16_t>(), b_.v[s].get<uint16_t>(),
                               b_.dout[s].get<uint16_t>());
  }

  // Quantizes every input set and allocates its O and LSE: once, outside the timing.
  void prepare(cudaStream_t stream) {
    for (int set = 0; set < kInputSets; ++set) {
      Set x;
      x.quantized = std::make_unique<cuda::QuantizeOutputs>(layout(), quantize_options(),
                                                            /*backward=*/true);
      quantize_gpu(inputs(set), quantize_options(), x.quantized->view(), stream);
      x.o = DeviceBuffer(size_t(b_.q_elems) * sizeof(uint16_t));
      x.lse = DeviceBuffer(sizeof(float) * size_t(w_.heads_q * w_.tokens()));
      sets_.push_back(std::move(x));
    }
    FLAMIA_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  void forward_bf16(GpuAttention& a, int set, cudaStream_t s) const {
    a.forward(inputs(set), outputs(set), s);
  }
  void forward_quantized(const GpuAttention& a, int set, cudaStream_t s) const {
    a.forward(inputs(set), quantized(set), outputs(set), s);
  }
  // The training call's backward: needs the BF16 forward of the same set on `a` just before.
  void backward_bf16(GpuAttention& a, int set, cudaStream_t s) const {
    a.backward(inputs(set), o(set), lse(set), gradients(), s);
  }
  void backward_quantized(GpuAttention& a, int set, cudaStream_t s) const {
    a.backward(inputs(set), quantized(set), o(set), lse(set), gradients(), s);
  }

 private:
  struct Set {
    std::unique_ptr<cuda::QuantizeOutputs> quantized;
    DeviceBuffer o, lse;
  };

  const DeviceQuantizedAttention& quantized(int set) const {
    return sets_[size_t(set)].quantized->view();
  }
  DeviceAttentionOutputs outputs(int set) const {
    DeviceAttentionOutputs out;
    out.o = dense_view(sets_[size_t(set)].o.get<uint16_t>(), w_.heads_q, w_.head_dim);
    out.lse = sets_[size_t(set)].lse.get<float>();
    return out;
  }
  TokenTensor<const uint16_t> o(int set) const {
    return dense_view<const uint16_t>(sets_[size_t(set)].o.get<uint16_t>(), w_.heads_q,
                                      w_.head_dim);
  }
  const float* lse(int set) const { return sets_[size_t(set)].lse.get<float>(); }
  // Written, never read: shared by the sets (and with the BF16 peer).
  DeviceAttentionGradients gradients() const {
    DeviceAttentionGradients g;
    g.dq = dense_view(b_.dq.get<uint16_t>(), w_.heads_q, w_.head_dim);
    g.dk = dense_view(b_.dk.get<uint16_t>(), w_.heads_kv, w_.head_dim);
    g.dv = dense_view(b_.dv.get<uint16_t>(), w_.heads_kv, w_.head_dim);
    return g;
  }

  const Workload& w_;
  const Buffers& b_;
  std::vector<int32_t> cu_;
  bool hadamard_;
  std::vector<Set> sets_;
};

class Runner {
 public:
  Runner(const Options& o, cudaStream_t s) : opt_(o), stream_(s) {}

  WorkloadResult run(const Workload& w, uint64_t seed) {
    WorkloadResult r;
    r.w = w;
    const bench::SdpaProblem p = problem_of(w);
    Buffers b = make_buffers(w, p, seed, stream_);
    if (opt_.peer_bf16) {
      run_bf16(r, p, b, seed);
      require_intact_cu_seqlens(w, b, "the cuDNN BF16 stages");
    }
    if (opt_.peer_fp8) {
      run_fp8(r, p, b, seed);
      require_intact_cu_seqlens(w, b, "the cuDNN FP8 stages");
    }
    run_flamia(r, b);
    return r;
  }

 private:
  bench::Timing time(const std::function<void(int)>& enqueue, int sets = kInputSets,
                     bool graphs = true) {
    return bench::time_reps(enqueue, stream_, opt_.warmup, opt_.reps, sets, opt_.graphs && graphs,
                            opt_.warmup_ms);
  }

  void add(WorkloadResult& r, const std::string& impl, const std::string& stage,
           const std::string& layout, const bench::Timing& t, double flops) {
    r.stages.push_back({impl, stage, layout, t.median_ms, flops, t.graph});
    progress(r.w.name + ": " + impl + " " + stage + " " + fmt(t.median_ms, 3) + " ms");
  }

  // A peer that ran: its forward, backward and training-call stages, and its outcome.
  void add_peer(WorkloadResult& r, PeerOutcome out, const std::string& layout,
                const bench::Timing& fwd, const bench::Timing& bwd, const bench::Timing& call,
                double fwd_flops, double bwd_flops) {
    add(r, out.impl, "forward", layout, fwd, fwd_flops);
    add(r, out.impl, "backward", layout, bwd, bwd_flops);
    add(r, out.impl, "training call", layout, call, fwd_flops + bwd_flops);
    out.ok = true;
    out.fwd_ms = fwd.median_ms;
    out.bwd_ms = bwd.median_ms;
    out.call_ms = call.median_ms;
    r.peers.push_back(out);
  }

  // flamia's stages read the device cu_seqlens the peers never should write: a stray write there
  // would otherwise surface later as a fault inside flamia's kernels.
  static void require_intact_cu_seqlens(const Workload& w, const Buffers& b, const char* after) {
    if (b.cu_seqlens.download<int32_t>() != cu_seqlens_from_lengths(w.docs))
      throw Error(w.name + ": the device cu_seqlens changed during " + after);
  }

  // Progress on stderr, so a slow or stuck stage shows where it is.
  static void progress(const std::string& line) { std::cerr << "[bench] " << line << std::endl; }

  DeviceBuffer& workspace(size_t bytes) {
    if (workspace_.bytes() < bytes) workspace_ = DeviceBuffer(bytes);
    return workspace_;
  }

  bench::SdpaBuffers sdpa_buffers(const Buffers& b, float* scalars) {
    bench::SdpaBuffers s;
    s.stats = b.stats.get<float>();
    s.seq_len = b.seq_len.get<int32_t>();
    s.ragged_q = b.ragged_q.get<int64_t>();
    s.ragged_kv = b.ragged_kv.get<int64_t>();
    s.descale_q = scalars + kDescaleQ;
    s.descale_k = scalars + kDescaleK;
    s.descale_v = scalars + kDescaleV;
    s.descale_o = scalars + kDescaleO;
    s.descale_do = scalars + kDescaleDO;
    s.descale_s = scalars + kDescaleS;
    s.scale_s = scalars + kScaleS;
    s.descale_dp = scalars + kDescaleDP;
    s.scale_dp = scalars + kScaleDP;
    s.scale_o = scalars + kScaleO;
    s.scale_dq = scalars + kScaleDQ;
    s.scale_dk = scalars + kScaleDK;
    s.scale_dv = scalars + kScaleDV;
    s.amax = scalars + kAmaxOut;
    return s;
  }

  void run_bf16(WorkloadResult& r, const bench::SdpaProblem& p, Buffers& b, uint64_t seed) {
    PeerOutcome out{"cuDNN BF16"};
    progress(r.w.name + ": building cuDNN BF16 graphs");
    auto peer = build_peer(p, CudnnPrecision::kBf16, stream_, &out.reason);
    if (!peer) progress(r.w.name + ": cuDNN BF16 unsupported: " + out.reason);
    if (!peer) {
      r.peers.push_back(out);
      return;
    }
    std::optional<PeerTensors> padded;
    if (peer->layout() == CudnnLayout::kPadded)
      padded = make_peer_tensors(p, CudnnLayout::kPadded, 2, seed + 100, stream_);
    void* ws = workspace(peer->workspace_bytes()).get();
    auto bufs = [&](int set) {
      bench::SdpaBuffers s = sdpa_buffers(b, b.scalars.get<float>());
      if (padded) {
        s.q = padded->q.get(), s.k = padded->k.get(), s.v = padded->v.get();
        s.o = padded->o.get(), s.dout = padded->dout.get();
        s.dq = padded->dq.get(), s.dk = padded->dk.get(), s.dv = padded->dv.get();
      } else {
        s.q = b.q[size_t(set)].get(), s.k = b.k[size_t(set)].get(), s.v = b.v[size_t(set)].get();
        s.o = b.o.get(), s.dout = b.dout[size_t(set)].get();
        s.dq = b.dq.get(), s.dk = b.dk.get(), s.dv = b.dv.get();
      }
      return s;
    };
    const std::string layout = bench::to_string(peer->layout());
    const double ff = r.w.forward_flops(), bf = r.w.backward_flops();
    const auto fwd = time([&](int set) { peer->forward(bufs(set), ws); });
    const auto bwd = time([&](int set) { peer->backward(bufs(set), ws); });
    const auto call = time([&](int set) {
      peer->forward(bufs(set), ws);
      peer->backward(bufs(set), ws);
    });
    add_peer(r, out, layout, fwd, bwd, call, ff, bf);
  }

  void run_fp8(WorkloadResult& r, const bench::SdpaProblem& p, Buffers& b, uint64_t seed) {
    std::string reason;
    // cuDNN 9.19's FP8 path with GQA never returned when replayed from a captured CUDA graph on
    // the H200 (it runs normally when launched directly), so its calls are launched directly.
    const bool graphs = opt_.graphs && p.heads_kv == p.heads_q;
    progress(r.w.name + ": building cuDNN FP8 graphs");
    auto peer = build_peer(p, CudnnPrecision::kFp8, stream_, &reason);
    if (!peer) progress(r.w.name + ": cuDNN FP8 unsupported: " + reason);
    if (peer) progress(r.w.name + ": cuDNN FP8 built, " + bench::to_string(peer->layout()));
    if (!peer) {
      r.peers.push_back({"cuDNN FP8 fresh scales", false, reason});
      r.peers.push_back({"cuDNN FP8 calibrated", false, reason});
      return;
    }
    const CudnnLayout layout = peer->layout();
    PeerTensors t = make_peer_tensors(p, layout, 1, seed + 200, stream_);
    const int64_t* rows_map = layout == CudnnLayout::kPadded ? b.pad_row.get<int64_t>() : nullptr;
    float* sc = b.scalars.get<float>();
    void* ws = workspace(peer->workspace_bytes()).get();
    bench::SdpaBuffers s = sdpa_buffers(b, sc);
    s.q = t.q.get(), s.k = t.k.get(), s.v = t.v.get(), s.o = t.o.get(), s.dout = t.dout.get();
    s.dq = t.dq.get(), s.dk = t.dk.get(), s.dv = t.dv.get();
    const int64_t T = r.w.tokens();
    const int64_t q_row = int64_t(p.heads_q) * p.dim, kv_row = int64_t(p.heads_kv) * p.dim;
    auto amax_fwd = [&](int set) {
      bench::amax_bf16(b.q[size_t(set)].get<uint16_t>(), b.q_elems, sc + kAmaxQ, stream_);
      bench::amax_bf16(b.k[size_t(set)].get<uint16_t>(), b.kv_elems, sc + kAmaxK, stream_);
      bench::amax_bf16(b.v[size_t(set)].get<uint16_t>(), b.kv_elems, sc + kAmaxV, stream_);
    };
    auto cast_fwd = [&](int set) {
      bench::cast_bf16_to_e4m3(b.q[size_t(set)].get<uint16_t>(), T, q_row, rows_map,
                               t.q.get<uint8_t>(), sc + kAmaxQ, sc + kDescaleQ, stream_);
      bench::cast_bf16_to_e4m3(b.k[size_t(set)].get<uint16_t>(), T, kv_row, rows_map,
                               t.k.get<uint8_t>(), sc + kAmaxK, sc + kDescaleK, stream_);
      bench::cast_bf16_to_e4m3(b.v[size_t(set)].get<uint16_t>(), T, kv_row, rows_map,
                               t.v.get<uint8_t>(), sc + kAmaxV, sc + kDescaleV, stream_);
    };
    auto amax_bwd = [&](int set) {
      bench::amax_bf16(b.dout[size_t(set)].get<uint16_t>(), b.q_elems, sc + kAmaxDO, stream_);
    };
    auto cast_bwd = [&](int set) {
      bench::cast_bf16_to_e4m3(b.dout[size_t(set)].get<uint16_t>(), T, q_row, rows_map,
                               t.dout.get<uint8_t>(), sc + kAmaxDO, sc + kDescaleDO, stream_);
    };
    // Calibration: the amaxes the calibrated variant reuses, and valid E4M3 inputs.
    amax_fwd(0);
    amax_bwd(0);
    cast_fwd(0);
    cast_bwd(0);
    const std::string lay = bench::to_string(layout);
    const double ff = r.w.forward_flops(), bf = r.w.backward_flops();
    const auto fwd = time([&](int) { peer->forward(s, ws); }, 1, graphs);
    const auto bwd = time([&](int) { peer->backward(s, ws); }, 1, graphs);
    for (bool fresh : {true, false}) {
      PeerOutcome out{fresh ? "cuDNN FP8 fresh scales" : "cuDNN FP8 calibrated"};
      const auto prep_fwd = time(
          [&](int set) {
            if (fresh) amax_fwd(set);
            cast_fwd(set);
          },
          kInputSets, graphs);
      const auto prep_bwd = time(
          [&](int set) {
            if (fresh) amax_bwd(set);
            cast_bwd(set);
          },
          kInputSets, graphs);
      const auto call = time(
          [&](int set) {
            if (fresh) amax_fwd(set);
            cast_fwd(set);
            peer->forward(s, ws);
            if (fresh) amax_bwd(set);
            cast_bwd(set);
            peer->backward(s, ws);
          },
          kInputSets, graphs);
      add(r, out.impl, fresh ? "amax + cast Q K V" : "cast Q K V", lay, prep_fwd, 0);
      add(r, out.impl, fresh ? "amax + cast dO" : "cast dO", lay, prep_bwd, 0);
      add_peer(r, out, lay, fwd, bwd, call, ff, bf);
    }
  }

  void run_flamia(WorkloadResult& r, const Buffers& b) {
    FlamiaWorkload x(r.w, b, opt_.hadamard);
    {
      const QuantizeOptions opt = x.quantize_options();
      const cuda::QuantizeOutputs out(x.layout(), opt, /*backward=*/true);
      const auto t = time([&](int set) { quantize_gpu(x.inputs(set), opt, out.view(), stream_); });
      add(r, impl_name(Recipe::kMxfp8, opt_.hadamard), "quantize Q K V dO (quantize_gpu)", "packed",
          t, 0);
      r.quantize_ms = t.median_ms;
    }
    if (opt_.recipes.empty()) return;
    x.prepare(stream_);
    for (Recipe recipe : opt_.recipes) {
      FlamiaOutcome f{recipe};
      try {
        run_recipe(r, x, f);
      } catch (const Error& e) {
        f.reason = bare(e);
        progress(r.w.name + ": " + impl_name(recipe, opt_.hadamard) + " stopped: " + f.reason);
        cudaGetLastError();  // a failed launch must not poison the next stage
      }
      r.flamia.push_back(f);
    }
  }

  // One recipe's stages. Each records its time in `f` as it ends, so a failure keeps those before.
  void run_recipe(WorkloadResult& r, const FlamiaWorkload& x, FlamiaOutcome& f) {
    const std::string impl = impl_name(f.recipe, opt_.hadamard);
    const double ff = r.w.forward_flops(), bf = r.w.backward_flops();
    auto stage = [&](const std::string& name, double flops,
                     const std::function<void(int)>& enqueue) {
      const bench::Timing t = time(enqueue);
      add(r, impl, name, "packed", t, flops);
      return t.median_ms;
    };
    const GpuAttentionOptions options =
        gpu_options(r.w, f.recipe, opt_.hadamard, opt_.backward_form);
    GpuAttention attention(x.layout(), options);
    // One untimed training call: the first calls allocate the owned quantizer buffers and the
    // backward's workspaces (nothing may be allocated while a CUDA graph is captured); the
    // quantizer reports non-finite inputs.
    x.forward_bf16(attention, 0, stream_);
    attention.quantizer_status().throw_if_any();  // Q, K, V
    x.backward_bf16(attention, 0, stream_);
    attention.quantizer_status().throw_if_any();  // dO
    progress(r.w.name + ": " + impl + ": " + std::to_string(attention.work_items()) +
             " forward work items on " + std::to_string(attention.ctas()) + " CTAs; backward " +
             (backward_runs_split(x.layout(), options) ? "split" : "fused") + " (--backward " +
             form_name(opt_.backward_form) + ")");

    f.fwd_ms = stage("forward from BF16 (quantize Q K V + attention)", ff,
                     [&](int set) { x.forward_bf16(attention, set, stream_); });
    f.kernel_ms = stage("forward kernel (quantized Q K V)", ff,
                        [&](int set) { x.forward_quantized(attention, set, stream_); });
    // The backward stages read each set's O and LSE: this recipe's forward of that set.
    for (int set = 0; set < kInputSets; ++set) x.forward_quantized(attention, set, stream_);
    f.bwd_ms = stage("backward kernels (quantized Q K V dO, O, LSE)", bf,
                     [&](int set) { x.backward_quantized(attention, set, stream_); });
    if (opt_.deterministic) {
      GpuAttention deterministic(
          x.layout(),
          gpu_options(r.w, f.recipe, opt_.hadamard, BackwardForm::kAuto, /*deterministic=*/true));
      x.backward_quantized(deterministic, 0, stream_);  // allocates its workspaces, untimed
      stage("deterministic backward kernels (quantized Q K V dO, O, LSE)", bf,
            [&](int set) { x.backward_quantized(deterministic, set, stream_); });
    }
    f.call_ms = stage("training call from BF16 (quantizers included)", ff + bf, [&](int set) {
      x.forward_bf16(attention, set, stream_);
      x.backward_bf16(attention, set, stream_);
    });
  }

  Options opt_;
  cudaStream_t stream_;
  DeviceBuffer workspace_;
};

// The peer `impl` of r, when it ran.
const PeerOutcome* find_peer(const WorkloadResult& r, const std::string& impl) {
  for (const PeerOutcome& p : r.peers)
    if (p.impl == impl && p.ok) return &p;
  return nullptr;
}

// A peer's time; "unsupported" when it could not run, "not run" when --peers left it out.
std::string peer_cell(const PeerOutcome* p, double ms, bool requested) {
  return !requested ? "not run" : p ? fmt(ms, 3) : "unsupported";
}

std::string flamia_cell(double ms) {
  return ms > 0 ? fmt(ms, 3) : "not run";
}

// The shortest of the times that were measured (> 0); 0 when none was.
double fastest(const std::vector<double>& ms) {
  double best = 0;
  for (double t : ms)
    if (t > 0 && (best == 0 || t < best)) best = t;
  return best;
}

// A peer's time over flamia's: above 1, flamia is faster.
std::string speedup(double peer_ms, double flamia_ms) {
  return peer_ms > 0 && flamia_ms > 0 ? fmt(peer_ms / flamia_ms, 2) : "-";
}

Table summary_table(const std::vector<WorkloadResult>& results, const Options& opt) {
  Table t;
  t.title =
      "training-call times (ms; median) and the DESIGN §7 reference ratio (measured / "
      "reference, equal-length workloads)";
  t.columns = {"workload", "fwd TFLOP",   "BF16 fwd",       "BF16 fwd+bwd",   "BF16 call",
               "FP8 fwd",  "FP8 fwd+bwd", "FP8 call fresh", "FP8 call calib", "flamia quant"};
  const bool with_flamia = !opt.recipes.empty();
  if (with_flamia) {
    for (Recipe recipe : opt.recipes) t.columns.push_back(std::string(to_string(recipe)) + " fwd");
    t.columns.push_back("fwd vs BF16");
    for (Recipe recipe : opt.recipes) t.columns.push_back(std::string(to_string(recipe)) + " call");
    for (const char* c : {"flamia call", "vs BF16 call", "vs FP8 call"}) t.columns.push_back(c);
  }
  for (const char* c : {"BF16 vs ref", "FP8 vs ref"}) t.columns.push_back(c);
  for (const WorkloadResult& r : results) {
    const PeerOutcome *bf = find_peer(r, "cuDNN BF16"),
                      *fresh = find_peer(r, "cuDNN FP8 fresh scales"),
                      *cal = find_peer(r, "cuDNN FP8 calibrated");
    // A peer's times; 0 for one that did not run.
    auto fwd = [](const PeerOutcome* p) { return p ? p->fwd_ms : 0.0; };
    auto kernels = [](const PeerOutcome* p) { return p ? p->fwd_ms + p->bwd_ms : 0.0; };
    auto call = [](const PeerOutcome* p) { return p ? p->call_ms : 0.0; };
    const bool b16 = opt.peer_bf16, f8 = opt.peer_fp8;
    std::vector<std::string> row = {r.w.name,
                                    fmt(r.w.forward_flops() / kTera, 2),
                                    peer_cell(bf, fwd(bf), b16),
                                    peer_cell(bf, kernels(bf), b16),
                                    peer_cell(bf, call(bf), b16),
                                    peer_cell(fresh, fwd(fresh), f8),
                                    peer_cell(fresh, kernels(fresh), f8),
                                    peer_cell(fresh, call(fresh), f8),
                                    peer_cell(cal, call(cal), f8),
                                    fmt(r.quantize_ms, 3)};
    if (with_flamia) {
      std::vector<double> flamia_fwd, flamia_call;  // per recipe
      for (const FlamiaOutcome& f : r.flamia) {
        flamia_fwd.push_back(f.fwd_ms);
        flamia_call.push_back(f.call_ms);
      }
      for (double ms : flamia_fwd) row.push_back(flamia_cell(ms));
      row.push_back(speedup(fwd(bf), fastest(flamia_fwd)));
      for (double ms : flamia_call) row.push_back(flamia_cell(ms));
      const double best_call = fastest(flamia_call);
      row.push_back(flamia_cell(best_call));
      row.push_back(speedup(call(bf), best_call));
      row.push_back(speedup(fastest({call(fresh), call(cal)}), best_call));
    }
    std::string bf_ref = "-", fp8_ref = "-";
    if (auto it = kDesignReference.find(r.w.name); it != kDesignReference.end()) {
      if (bf) bf_ref = fmt(kernels(bf) / it->second.bf16_total, 2);
      if (fresh) fp8_ref = fmt(kernels(fresh) / it->second.fp8_total, 2);
    }
    row.push_back(bf_ref);
    row.push_back(fp8_ref);
    t.add_row(row);
  }
  t.notes.push_back(
      "fwd+bwd: the two cuDNN kernels' medians (what DESIGN §7 reports); call: forward and "
      "backward timed as one call, for FP8 with amax (fresh only) and cast of Q K V, and of dO.");
  if (with_flamia) {
    t.notes.push_back(
        "<recipe> fwd: flamia's forward from BF16 Q K V (the fused quantizer included, token "
        "policy); fwd vs BF16: cuDNN BF16 fwd / the fastest of them.");
    t.notes.push_back(
        "<recipe> call: flamia's training call from BF16, timed as one call (quantize Q K V, "
        "forward, quantize dO, backward); flamia call: the fastest recipe's. vs BF16 call, vs FP8 "
        "call: cuDNN BF16's call, and the faster of cuDNN FP8's two, / flamia call (above 1: "
        "flamia is faster). The kernels alone are in the stage table.");
  }
  return t;
}

Table stage_table(const std::vector<WorkloadResult>& results, const Options& opt) {
  Table t;
  t.title =
      "stages (median ms; TFLOP/s on visible pairs: forward 4 pairs d h, backward 2.5x, "
      "training call 3.5x)";
  t.columns = {"workload", "implementation", "stage", "layout", "ms", "TFLOP/s", "graph"};
  for (const WorkloadResult& r : results) {
    for (const Stage& s : r.stages)
      t.add_row({r.w.name, s.impl, s.stage, s.layout, fmt(s.ms, 3),
                 s.flops > 0 ? fmt(s.flops / (s.ms / kMsPerS) / kTera, 1) : "-",
                 s.graph ? "yes" : "no"});
    for (const PeerOutcome& p : r.peers)
      if (!p.ok) t.add_row({r.w.name, p.impl, "unsupported: " + p.reason, "-", "-", "-", "-"});
    for (const FlamiaOutcome& f : r.flamia)
      if (!f.reason.empty())
        t.add_row({r.w.name, impl_name(f.recipe, opt.hadamard), "stopped: " + f.reason, "-", "-",
                   "-", "-"});
  }
  return t;
}

}  // namespace

int bench_attention(int argc, char** argv, int first) {
  Args args(
      "bench attention",
      "Times the packed causal workloads (65,536 tokens, 16 query heads, head dim 128): "
      "flamia's stages (the fused quantizer; per recipe, the forward from BF16 inputs, "
      "quantizer included; the forward kernel alone on quantized operands; the backward "
      "(fused: preprocess, main kernel, postprocess; split: preprocess, dK/dV pass, dQ pass) on "
      "quantized Q, K, V, dO and the forward's O and LSE; and the training call: forward from "
      "BF16, then the backward from BF16 dO, "
      "every quantization included) and, in the same run, cuDNN fused attention in BF16 and "
      "in FP8 with per-tensor scales (fresh: an amax pass in the call; calibrated: scales "
      "known beforehand). CUDA events, warm-up, medians, fresh random inputs rotated over two "
      "sets, CUDA graphs where capture works.",
      {{"workloads", "all", "comma-separated workload names, or all"},
       {"docs", "", "a custom workload: document lengths (replaces --workloads)"},
       {"heads", "16", "custom workload: query heads"},
       {"kv-heads", "", "custom workload: key/value heads (default: = heads)"},
       {"dim", "128", "custom workload: head dim"},
       {"non-causal", "", "custom workload: no causal mask", true},
       {"reps", "30", "timed reps per stage (at least 20)"},
       {"warmup", "5", "untimed calls before the reps"},
       {"warmup-ms", std::to_string(int(bench::kSustainedWarmupMs)),
        "and more untimed calls until this many ms of GPU time: every stage is timed at the "
        "GPU's sustained clock, whatever ran before it (0: the calls of --warmup only)"},
       {"no-graphs", "", "launch directly instead of replaying CUDA graphs", true},
       {"recipes", "mxfp8,mxfp8-qk16",
        "flamia recipes to time (those the kernels implement: mxfp8, mxfp8-qk16), or none"},
       {"peers", "all",
        "cuDNN peers to time in the same run: bf16, fp8 (comma-separated), all, or none"},
       {"backward", "auto",
        "the backward's form: fused (one kernel, dQ added by atomics), split (a dK/dV pass, then a "
        "dQ pass), or auto (split where the documents are short enough for it to be faster)"},
       {"deterministic", "",
        "also time each recipe's backward with deterministic dQ (summed in key-block order; the "
        "split form)",
        true},
       {"hadamard", "",
        "flamia with Q and K Hadamard-rotated (quantizer, kernels, dQ and dK rotated back; mxfp8 "
        "only: pass --recipes mxfp8)",
        true},
       {"quick", "", "three workloads, 20 reps, 2 warm-ups (for scripts/device-check.sh)", true},
       {"seed", "", "input seed (default: drawn from the clock, so inputs are fresh)"},
       {"csv", "", "also write the stage table to this CSV file"},
       {"json-out", "", "also write both tables as JSON to this file (scripts/plot_bench.py)"},
       {"json", "", "print the tables as JSON", true}},
      argc, argv, first);
  if (args.help_requested()) {
    std::cout << args.usage();
    return 0;
  }
  Options opt;
  opt.reps = int(args.integer("reps"));
  opt.warmup = int(args.integer("warmup"));
  opt.warmup_ms = double(args.integer("warmup-ms"));
  if (opt.warmup_ms < 0) throw Error("--warmup-ms must not be negative");
  opt.graphs = !args.flag("no-graphs");
  const std::string form = args.str("backward");
  const auto* known = std::find_if(std::begin(kBackwardForms), std::end(kBackwardForms),
                                   [&](const auto& k) { return form == k.first; });
  if (known == std::end(kBackwardForms))
    throw Error("--backward must be auto, fused or split, not '" + form + "'");
  opt.backward_form = known->second;
  opt.deterministic = args.flag("deterministic");
  opt.hadamard = args.flag("hadamard");
  if (args.str("peers") != "all") {
    opt.peer_bf16 = opt.peer_fp8 = false;
    if (args.str("peers") != "none")
      for (const std::string& name : args.strings("peers")) {
        if (name == "bf16") {
          opt.peer_bf16 = true;
        } else if (name == "fp8") {
          opt.peer_fp8 = true;
        } else {
          throw Error("--peers: unknown peer '" + name + "' (bf16, fp8, all or none)");
        }
      }
  }
  opt.recipes.clear();
  if (args.str("recipes") != "none")
    for (const std::string& name : args.strings("recipes")) {
      const Recipe recipe = parse_recipe(name);
      if (std::find(opt.recipes.begin(), opt.recipes.end(), recipe) == opt.recipes.end())
        opt.recipes.push_back(recipe);
    }
  std::vector<Workload> workloads;
  if (!args.str("docs").empty()) {
    Workload w;
    w.name = "custom";
    w.docs = args.integers("docs");
    w.heads_q = int(args.integer("heads"));
    w.heads_kv = args.str("kv-heads").empty() ? w.heads_q : int(args.integer("kv-heads"));
    w.head_dim = int(args.integer("dim"));
    w.causal = !args.flag("non-causal");
    const std::vector<int32_t> cu = cu_seqlens_from_lengths(w.docs);
    validate(packed_layout(w, cu));
    workloads.push_back(w);
  } else if (args.flag("quick")) {
    for (const char* n : {"16x4096", "8192+224x256", "4x16384-gqa"})
      workloads.push_back(workload_by_name(n));
    opt.reps = kMinReps;
    opt.warmup = 2;
  } else if (args.str("workloads") == "all") {
    workloads = standard_workloads();
  } else {
    for (const std::string& n : args.strings("workloads")) workloads.push_back(workload_by_name(n));
  }
  if (opt.reps < kMinReps) throw Error("--reps must be at least " + std::to_string(kMinReps));
  // Every recipe must be one the kernels implement: say so now, not after the peers ran.
  for (const Workload& w : workloads)
    for (Recipe recipe : opt.recipes) {
      const std::vector<int32_t> cu = cu_seqlens_from_lengths(w.docs);
      try {
        check_gpu_support(packed_layout(w, cu), gpu_options(w, recipe, opt.hadamard));
      } catch (const Error& e) {
        throw Error("--recipes " + std::string(to_string(recipe)) + " on workload " + w.name +
                    ": " + bare(e) + " (--recipes none times the peers only)");
      }
    }
  const DeviceInfo dev = bench_device();
  if (const std::string s = bench::cudnn_status(); !s.empty())
    std::cerr << "flamia bench: cuDNN peers unavailable: " << s << "\n";
  const uint64_t seed = args.str("seed").empty()
                            ? uint64_t(std::chrono::steady_clock::now().time_since_epoch().count())
                            : uint64_t(args.integer("seed"));

  cudaStream_t stream;
  FLAMIA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<WorkloadResult> results;
  {
    Runner runner(opt, stream);
    for (const Workload& w : workloads) results.push_back(runner.run(w, seed));
  }
  FLAMIA_CUDA_CHECK(cudaStreamDestroy(stream));

  Table summary = summary_table(results, opt), stages = stage_table(results, opt);
  const std::string header = dev.name + " " + dev.uuid + ", cuDNN " + bench::cudnn_version() +
                             ", " + std::to_string(opt.reps) + " reps after " +
                             std::to_string(opt.warmup) + " warm-ups and at least " +
                             std::to_string(int(opt.warmup_ms)) + " ms of them, seed " +
                             std::to_string(seed);
  summary.notes.insert(summary.notes.begin(), header);
  if (!args.str("csv").empty()) {
    std::ofstream f(args.str("csv"));
    stages.print_csv(f);
  }
  if (!args.str("json-out").empty()) {
    std::ofstream f(args.str("json-out"));
    print_json(f, {summary, stages});
  }
  if (args.flag("json")) {
    print_json(std::cout, {summary, stages});
  } else {
    stages.print_text(std::cout);
    std::cout << "\n";
    summary.print_text(std::cout);
  }
  return 0;
}

}  // namespace flamia::cli
