#include "problem.h"

#include <sstream>

namespace flamia::cli {
namespace {

TileShape parse_tile(const std::string& s, const char* name) {
  TileShape t;
  char x = 0;
  std::istringstream is(s);
  if (!(is >> t.block_m >> x >> t.block_n) || x != 'x' || t.block_m <= 0 || t.block_n <= 0)
    throw Error(std::string("--") + name + " expects MxN (e.g. 128x128), got '" + s + "'");
  return t;
}

}  // namespace

std::vector<OptionSpec> problem_options(const std::string& docs, int heads, int dim) {
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
      {"fwd-tile", "128x128", "emulator forward tile, query rows x keys"},
      {"bwd-tile", "64x128", "emulator backward tile, query rows x keys"},
      {"backend", "cpu", "cpu (the emulator) or cuda (the sm_90a kernels)"},
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
  p.backend = a.str("backend");
  if (p.backend != "cpu" && p.backend != "cuda")
    throw Error("--backend must be cpu or cuda, got '" + p.backend + "'");
  return p;
}

void require_backend(const Problem& p) {
  if (p.backend == "cuda")
    throw Error(
        "--backend cuda: the GPU attention kernels are not built yet (they arrive with the "
        "forward and backward kernel issues); use --backend cpu");
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
