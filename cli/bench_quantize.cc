// `flamia bench quantize`: one fused quantizer launch on BF16 Q, K, V (and dO with --backward),
// next to a device-to-device copy in the same run. Inputs are fresh random non-zero BF16 drawn on
// the GPU, rotated over several buffer sets so that no rep finds them in L2; each rep is timed
// with its own pair of CUDA events after warm-up, and the table reports the median.
//
// Bytes counted: every input element read once, every output array written once (what a perfect
// implementation must move); the copy counts bytes read plus bytes written.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "args.h"
#include "check.h"
#include "commands.h"
#include "device_buffer.h"
#include "flamia/device.h"
#include "flamia/quantize_gpu.h"
#include "quantize_outputs.h"
#include "random_fill.h"
#include "table.h"
#include "timing.h"

namespace flamia::cli {
namespace {

constexpr int kMinReps = 20;
constexpr int kMinSets = 2;
constexpr size_t kCopyBytes = size_t(1) << 30;  // 1 GiB, far beyond L2
constexpr double kGiga = 1e9;
constexpr double kMsPerS = 1e3;

// One set of BF16 inputs.
struct InputSet {
  cuda::DeviceBuffer q, k, v, dout;
};

}  // namespace

int bench_quantize(int argc, char** argv, int first) {
  Args args("bench quantize",
            "Times quantize_gpu (the fused quantizer launch, on packed tiles or on tiles cut "
            "from each document's start; K's and V's tile codes in it where the tiles are the "
            "documents' key tiles, else in two passes after it) "
            "on fresh random BF16 Q, K, V (dO too with --backward) and a 1 GiB device-to-device "
            "copy in the same run; reports bytes moved (inputs read once, outputs written once), "
            "GB/s and the fraction of the copy's.",
            {{"tokens", "65536", "tokens of the packed batch"},
             {"heads", "16", "query heads"},
             {"heads-kv", "", "key/value heads (default: --heads)"},
             {"dim", "128", "head dim: 64 or 128"},
             {"docs", "1", "equal documents the tokens are split into (the last takes the rest)"},
             {"policy", "token", "scale policy: token, block32, tensor, floor, vgroup16"},
             {"hadamard", "", "rotate Q and K along the head dim", true},
             {"nvfp4", "", "also write NVFP4 Q and K", true},
             {"no-transposed", "", "skip the transposed (K-major) copies", true},
             {"backward", "", "quantize dO too", true},
             {"tiling", "auto",
              "the quantizer's tiles: packed, document (from each document's start) or auto "
              "(flamia/quantize_gpu.h); the outputs are the same bytes"},
             {"reps", "50", "timed reps (at least 20)"},
             {"warmup", "5", "untimed launches before the reps"},
             {"warmup-ms", std::to_string(int(bench::kSustainedWarmupMs)),
              "and more untimed launches until this many ms of GPU time, for the quantizer and "
              "for the copy: both are timed at the GPU's sustained clock (0: --warmup only)"},
             {"sets", "3", "input buffer sets rotated between reps (at least 2)"},
             {"seed", "", "input seed (default: drawn from the clock, so inputs are fresh)"},
             {"json", "", "print the table as JSON", true},
             {"csv", "", "print the table as CSV", true}},
            argc, argv, first);
  if (args.help_requested()) {
    std::cout << args.usage();
    return 0;
  }
  const int64_t tokens = args.integer("tokens");
  const int heads_q = int(args.integer("heads"));
  const int heads_kv = args.str("heads-kv").empty() ? heads_q : int(args.integer("heads-kv"));
  const int dim = int(args.integer("dim"));
  const int64_t docs = args.integer("docs");
  const int reps = int(args.integer("reps")), warmup = int(args.integer("warmup"));
  const int sets = int(args.integer("sets"));
  const double warmup_ms = double(args.integer("warmup-ms"));
  if (warmup_ms < 0) throw Error("--warmup-ms must not be negative");
  const bool backward = args.flag("backward");
  if (reps < kMinReps) throw Error("--reps must be at least " + std::to_string(kMinReps));
  if (warmup < 1) throw Error("--warmup must be at least 1");
  if (sets < kMinSets) throw Error("--sets must be at least " + std::to_string(kMinSets));
  if (docs < 1 || docs > tokens) throw Error("--docs must be within [1, --tokens]");
  const uint64_t seed = args.str("seed").empty()
                            ? uint64_t(std::chrono::steady_clock::now().time_since_epoch().count())
                            : uint64_t(args.integer("seed"));
  QuantizeOptions opt;
  opt.policy = parse_scale_policy(args.str("policy"));
  opt.hadamard = args.flag("hadamard");
  opt.nvfp4_qk = args.flag("nvfp4");
  opt.transposed = !args.flag("no-transposed");
  const std::string tiling = args.str("tiling");
  if (tiling == "packed") {
    opt.tiling = QuantizerTiling::kPacked;
  } else if (tiling == "document") {
    opt.tiling = QuantizerTiling::kDocument;
  } else if (tiling != "auto") {
    throw Error("unknown --tiling '" + tiling + "' (valid: auto, packed, document)");
  }

  std::vector<int64_t> lengths(size_t(docs), tokens / docs);
  lengths.back() += tokens % docs;
  const std::vector<int32_t> cu = cu_seqlens_from_lengths(lengths);
  PackedLayout layout{cu.data(), int(docs), tokens, heads_q, heads_kv, dim};
  validate(layout);
  const DeviceInfo dev = bench_device();
  cudaStream_t stream = nullptr;
  FLAMIA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // In the stream: a non-blocking stream does not wait for the legacy default stream's copies.
  const cuda::DeviceBuffer cu_device = cuda::DeviceBuffer::upload(cu, stream);
  const int64_t q_elems = tokens * heads_q * dim, kv_elems = tokens * heads_kv * dim;
  std::vector<InputSet> inputs;
  std::vector<DeviceAttentionInputs> views;
  for (int s = 0; s < sets; ++s) {
    InputSet set{cuda::DeviceBuffer(size_t(q_elems) * sizeof(uint16_t)),
                 cuda::DeviceBuffer(size_t(kv_elems) * sizeof(uint16_t)),
                 cuda::DeviceBuffer(size_t(kv_elems) * sizeof(uint16_t)),
                 cuda::DeviceBuffer(backward ? size_t(q_elems) * sizeof(uint16_t) : 0)};
    const uint64_t set_seed = seed + uint64_t(s) * kNumOperands;
    cuda::fill_random_bf16(set.q.get<uint16_t>(), q_elems, set_seed, stream);
    cuda::fill_random_bf16(set.k.get<uint16_t>(), kv_elems, set_seed + 1, stream);
    cuda::fill_random_bf16(set.v.get<uint16_t>(), kv_elems, set_seed + 2, stream);
    if (backward) cuda::fill_random_bf16(set.dout.get<uint16_t>(), q_elems, set_seed + 3, stream);
    views.push_back(dense_device_inputs(layout, cu_device.get<int32_t>(), set.q.get<uint16_t>(),
                                        set.k.get<uint16_t>(), set.v.get<uint16_t>(),
                                        set.dout.get<uint16_t>()));
    inputs.push_back(std::move(set));
  }
  const cuda::QuantizeOutputs out(layout, opt, backward);
  const bench::Timing t_quant =
      bench::time_reps([&](int set) { quantize_gpu(views[size_t(set)], opt, out.view(), stream); },
                       stream, warmup, reps, sets, /*use_graphs=*/false, warmup_ms);
  const NonFiniteReport status = out.non_finite();  // the last rep's
  inputs.clear();

  const cuda::DeviceBuffer copy_src(kCopyBytes), copy_dst(kCopyBytes);
  cuda::fill_random_bf16(copy_src.get<uint16_t>(), int64_t(kCopyBytes / sizeof(uint16_t)), seed,
                         stream);
  const bench::Timing t_copy = bench::time_reps(
      [&](int) {
        FLAMIA_CUDA_CHECK(cudaMemcpyAsync(copy_dst.get(), copy_src.get(), kCopyBytes,
                                          cudaMemcpyDeviceToDevice, stream));
      },
      stream, warmup, reps, /*sets=*/1, /*use_graphs=*/false, warmup_ms);
  FLAMIA_CUDA_CHECK(cudaStreamDestroy(stream));

  const int64_t input_elems = q_elems * (backward ? 2 : 1) + 2 * kv_elems;
  const double read = double(input_elems) * sizeof(uint16_t);
  const double written = double(out.array_bytes());
  const double quant_bytes = read + written, copy_bytes = 2.0 * double(kCopyBytes);
  auto gbps = [](double bytes, double ms) { return bytes / (ms / kMsPerS) / kGiga; };
  const double copy_gbps = gbps(copy_bytes, t_copy.median_ms);

  Table table;
  table.title = "fused quantizer: " + std::to_string(tokens) + " tokens, " +
                std::to_string(heads_q) + "/" + std::to_string(heads_kv) + " heads, dim " +
                std::to_string(dim) + ", policy " + to_string(opt.policy) +
                (opt.hadamard ? ", hadamard" : "") + (opt.nvfp4_qk ? ", nvfp4" : "") +
                (backward ? ", Q K V dO" : ", Q K V") + ", " + dev.name;
  table.columns = {"kernel", "median ms", "GB moved", "GB/s", "of copy", "min ms", "max ms"};
  auto row = [&](const std::string& name, const bench::Timing& t, double bytes) {
    const double rate = gbps(bytes, t.median_ms);
    table.add_row({name, fmt(t.median_ms, 4), fmt(bytes / kGiga, 3), fmt(rate, 0),
                   fmt(rate / copy_gbps, 3), fmt(t.min_ms, 4), fmt(t.max_ms, 4)});
  };
  const bool fused_tiles = quantize_gpu_fuses_tile_codes(layout, opt);
  const bool document_tiles = quantize_gpu_tiling(layout, opt) == QuantizerTiling::kDocument;
  row(std::string("quantize_gpu (") + (document_tiles ? "document" : "packed") + " tiles, " +
          (fused_tiles ? "one launch, tile codes in it)" : "tile passes after it)"),
      t_quant, quant_bytes);
  row("cudaMemcpyAsync device to device, 1 GiB", t_copy, copy_bytes);
  table.notes.push_back("quantizer bytes: " + fmt(read / kGiga, 3) + " GB read (BF16 inputs) + " +
                        fmt(written / kGiga, 3) +
                        " GB written (codes, codes_t, exponents and every other output array)");
  table.notes.push_back("copy bytes: read + written; median of " + std::to_string(reps) +
                        " reps after " + std::to_string(warmup) + " warm-ups and at least " +
                        std::to_string(int(warmup_ms)) +
                        " ms of them, one CUDA event pair per rep; inputs rotated over " +
                        std::to_string(sets) + " buffer sets, seed " + std::to_string(seed));
  if (!fused_tiles)
    table.notes.push_back(
        "tile passes (the layout's tiles are not the key tiles): K's codes and V's codes_t are "
        "read again (not counted in the bytes)");
  if (opt.policy == ScalePolicy::kTensor)
    table.notes.push_back(
        "tensor policy: a first launch re-reads the inputs for the maxima "
        "(not counted in the bytes)");
  table.notes.push_back("non-finite inputs reported: " +
                        (status.any() ? status.message() : std::string("none")));
  if (args.flag("json")) {
    table.print_json(std::cout);
  } else if (args.flag("csv")) {
    table.print_csv(std::cout);
  } else {
    table.print_text(std::cout);
  }
  return status.any() ? 1 : 0;
}

}  // namespace flamia::cli
