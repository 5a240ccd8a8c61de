#include "problem.h"

#include <sstream>

#include "flamia/device.h"
#if defined(FLAMIA_HAVE_CUDA)
#include "flamia/attention_gpu.h"
#endif

namespace flamia::cli {
namespace {

// An Error's message without the "flamia: " its constructor adds, to nest it in another.
std::string bare(const Error& e) {
  const std::string m = e.what(), prefix = "flamia: ";
  return m.compare(0, prefix.size(), prefix) == 0 ? m.substr(prefix.size()) : m;
}

std::string describe(const GpuVariant& v) {
  return std::string(to_string(v.recipe)) + ", policy " + to_string(v.policy) +
         (v.hadamard ? ", Hadamard" : "");
}

#if defined(FLAMIA_HAVE_CUDA)
GpuAttentionOptions gpu_options(const Problem& p, const GpuVariant& v) {
  GpuAttentionOptions o;
  o.recipe = v.recipe;
  o.policy = v.policy;
  o.hadamard = v.hadamard;
  o.deterministic = v.deterministic;
  o.attention = p.attention;
  return o;
}
#endif

TileShape parse_tile(const std::string& s, const char* name) {
  TileShape t;
  char x = 0;
  std::istringstream is(s);
  if (!(is >> t.block_m >> x >> t.block_n) || x != 'x' || t.block_m <= 0 || t.block_n <= 0)
    throw Error(std::string("--") + name + " expects MxN (e.g. 128x128), got '" + s + "'");
  return t;
}

}  // namespace

std::vector<OptionSpec> problem_options(const std::string& docs, int heads, int dim,
                                        const std::string& backend) {
  return {
      {"docs", docs, "document lengths in tokens, packed in this order"},
      {"heads", std::to_string(heads), "query heads"},
      {"kv-heads", "", "key/value heads (GQA; default: = heads)"},
      {"dim", std::to_string(dim), "head dim (64 or 128)"},
      {"inputs", "normal", "input kind: normal, heavy-tail, outlier-channels"},
      {"sigma", "1.0", "heavy-tail: each token row scaled by exp(sigma * N(0,1))"},
      {"outlier-channels", "4", "outlier-channels: number of K channels scaled"},
      {"outlier-factor", "20", "outlier-channels: their scale factor"},
      {"seed", "1", "input seed"},
      {"non-causal", "", "attend to the whole document (default: causal)", true},
      {"softmax-scale", "0", "softmax scale (0: 1/sqrt(dim))"},
      {"fwd-tile", "128x128", "emulator forward tile, query rows x keys (cuda: the kernel's)"},
      {"bwd-tile", "64x128", "emulator backward tile, query rows x keys"},
      {"backend", backend,
       "cpu (the emulator), cuda (the sm_90a kernels, next to the emulator with their tiles), or "
       "auto (cuda when an sm_90 GPU is present, else cpu)"},
  };
}

Problem parse_problem(const Args& a) {
  Problem p;
  p.docs = a.integers("docs");
  if (p.docs.empty()) throw Error("--docs needs at least one document length");
  p.heads = int(a.integer("heads"));
  p.kv_heads = a.str("kv-heads").empty() ? p.heads : int(a.integer("kv-heads"));
  p.dim = int(a.integer("dim"));
  p.inputs.kind = parse_input_kind(a.str("inputs"));
  p.inputs.sigma = a.real("sigma");
  p.inputs.outlier_channels = int(a.integer("outlier-channels"));
  p.inputs.outlier_factor = a.real("outlier-factor");
  p.inputs.seed = uint64_t(a.integer("seed"));
  p.attention.causal = !a.flag("non-causal");
  p.attention.softmax_scale = a.real("softmax-scale");
  if (p.attention.softmax_scale < 0) throw Error("--softmax-scale must be >= 0");
  p.forward = parse_tile(a.str("fwd-tile"), "fwd-tile");
  p.backward = parse_tile(a.str("bwd-tile"), "bwd-tile");
  p.tiles_given = a.given("fwd-tile") || a.given("bwd-tile");
  p.backend = a.str("backend");
  if (p.backend == "auto") p.backend = query_device().available ? "cuda" : "cpu";
  if (p.backend != "cpu" && p.backend != "cuda")
    throw Error("--backend must be cpu, cuda or auto, got '" + p.backend + "'");
  return p;
}

void require_backend(const Problem& p, const std::vector<GpuVariant>& variants) {
  if (p.backend != "cuda") return;
  if (!built_with_cuda()) throw Error("--backend cuda: " + query_device().reason);
  for (const GpuVariant& v : variants) require_gpu_support(p, v);
  const DeviceInfo dev = query_device();
  if (!dev.available) throw Error("--backend cuda: " + dev.reason + "; use --backend cpu");
}

bool gpu_supports(const Problem& p, const GpuVariant& v, std::string* reason) {
#if defined(FLAMIA_HAVE_CUDA)
  const std::vector<int32_t> cu = cu_seqlens_from_lengths(p.docs);
  const PackedLayout layout{cu.data(), int(cu.size()) - 1, int64_t(cu.back()),
                            p.heads,   p.kv_heads,         p.dim};
  try {
    check_gpu_support(layout, gpu_options(p, v));
  } catch (const Error& e) {
    *reason = bare(e);
    return false;
  }
  return true;
#else
  (void)p;
  (void)v;
  *reason = query_device().reason;
  return false;
#endif
}

void require_gpu_support(const Problem& p, const GpuVariant& v) {
  std::string reason;
  if (!gpu_supports(p, v, &reason))
    throw Error("--backend cuda cannot run " + describe(v) + ": " + reason);
}

AttentionOutputs<float> gpu_training(const AttentionBatch& batch, const Problem& p,
                                     const GpuVariant& v, EmulatorStats* diagnostics) {
#if defined(FLAMIA_HAVE_CUDA)
  return training_gpu_to_host(batch, gpu_options(p, v), diagnostics);
#else
  (void)batch;
  (void)diagnostics;
  require_gpu_support(p, v);  // throws: no kernels in this build
  return {};
#endif
}

double gpu_score_mismatch(const AttentionBatch& batch, const Problem& p, const GpuVariant& v) {
#if defined(FLAMIA_HAVE_CUDA)
  const ScoreConsistencyReport r = score_consistency_to_host(batch, gpu_options(p, v));
  return r.entries > 0 ? double(r.differing) / double(r.entries) : 0.0;
#else
  (void)batch;
  require_gpu_support(p, v);  // throws: no kernels in this build
  return 0.0;
#endif
}

TileShape gpu_backward_tiles() {
#if defined(FLAMIA_HAVE_CUDA)
  return kGpuBackwardTiles;
#else
  return TileShape{};
#endif
}

TileShape gpu_forward_tiles() {
#if defined(FLAMIA_HAVE_CUDA)
  return kGpuForwardTiles;
#else
  return TileShape{};
#endif
}

AttentionBatch make_batch(const Problem& p) {
  return generate_batch(p.docs, p.heads, p.kv_heads, p.dim, p.inputs);
}

std::string describe(const Problem& p) {
  std::ostringstream os;
  int64_t total = 0;
  for (int64_t d : p.docs) total += d;
  os << p.docs.size() << " documents (";
  for (size_t i = 0; i < p.docs.size() && i < 8; ++i) os << (i ? "," : "") << p.docs[i];
  if (p.docs.size() > 8) os << ",...";
  os << "; " << total << " tokens), " << p.heads << " query / " << p.kv_heads << " kv heads, dim "
     << p.dim << ", " << (p.attention.causal ? "causal" : "non-causal") << ", "
     << to_string(p.inputs.kind);
  if (p.inputs.kind == InputKind::kHeavyTail) os << " sigma " << p.inputs.sigma;
  if (p.inputs.kind == InputKind::kOutlierChannels)
    os << " (" << p.inputs.outlier_channels << " x " << p.inputs.outlier_factor << ")";
  os << " inputs, seed " << p.inputs.seed;
  return os.str();
}

}  // namespace flamia::cli
