#include "flamia/inputs.h"

#include <cmath>

namespace flamia {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A uniform in (0, 1] from the top 53 bits of a hash.
double unit_open(uint64_t h) {
  return (double(h >> 11) + 1.0) * 0x1.0p-53;
}

enum Stream : uint64_t { kStreamQ = 1, kStreamK, kStreamV, kStreamDO, kStreamRowScale = 16 };

// Q, K and V are always present: with no tokens their vectors are empty and data() may be null,
// which the quantizers read as a skipped operand, so such a view points here (nothing is read).
const uint16_t* present_data(const std::vector<uint16_t>& x) {
  static const uint16_t kNoTokens = 0;
  return x.empty() ? &kNoTokens : x.data();
}

}  // namespace

const char* to_string(InputKind k) {
  switch (k) {
    case InputKind::kNormal:
      return "normal";
    case InputKind::kHeavyTail:
      return "heavy-tail";
    case InputKind::kOutlierChannels:
      return "outlier-channels";
  }
  return "?";
}

InputKind parse_input_kind(const std::string& name) {
  for (InputKind k : {InputKind::kNormal, InputKind::kHeavyTail, InputKind::kOutlierChannels})
    if (name == to_string(k)) return k;
  throw Error("unknown input kind '" + name + "' (valid: normal, heavy-tail, outlier-channels)");
}

double normal_deviate(uint64_t seed, uint64_t stream, uint64_t index) {
  uint64_t h = splitmix64(seed ^ splitmix64(stream * 0x100000001B3ull ^ splitmix64(index)));
  double u1 = unit_open(h), u2 = unit_open(splitmix64(h));
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

PackedLayout AttentionBatch::layout() const {
  return {cu_seqlens.data(), int(cu_seqlens.size()) - 1, tokens, heads_q, heads_kv, head_dim};
}

AttentionInputs AttentionBatch::inputs() const {
  AttentionInputs in;
  in.layout = layout();
  in.q = dense_view<const uint16_t>(present_data(q), heads_q, head_dim);
  in.k = dense_view<const uint16_t>(present_data(k), heads_kv, head_dim);
  in.v = dense_view<const uint16_t>(present_data(v), heads_kv, head_dim);
  in.dout = dense_view<const uint16_t>(dout.empty() ? nullptr : dout.data(), heads_q, head_dim);
  return in;
}

AttentionBatch generate_batch(const std::vector<int64_t>& doc_lengths, int heads_q, int heads_kv,
                              int head_dim, const InputSpec& spec) {
  AttentionBatch b;
  b.cu_seqlens = cu_seqlens_from_lengths(doc_lengths);
  b.tokens = b.cu_seqlens.back();
  b.heads_q = heads_q;
  b.heads_kv = heads_kv;
  b.head_dim = head_dim;
  validate(b.layout());
  if (spec.kind == InputKind::kOutlierChannels &&
      (spec.outlier_channels < 0 || spec.outlier_channels > head_dim))
    throw Error("outlier_channels = " + std::to_string(spec.outlier_channels) +
                " must be within [0, head_dim]");

  auto fill = [&](std::vector<uint16_t>& dst, int heads, uint64_t stream, bool outliers) {
    const int64_t rows = b.tokens * heads;
    dst.resize(size_t(rows * head_dim));
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      double row_scale = 1.0;
      if (spec.kind == InputKind::kHeavyTail)
        row_scale =
            std::exp(spec.sigma * normal_deviate(spec.seed, stream + kStreamRowScale, uint64_t(r)));
      for (int d = 0; d < head_dim; ++d) {
        double x = normal_deviate(spec.seed, stream, uint64_t(r * head_dim + d)) * row_scale;
        // Outlier channels are spread over the head dim (d = 0, D/n, 2D/n, ...).
        if (outliers && spec.outlier_channels > 0) {
          const int stride = head_dim / spec.outlier_channels;
          if (d % stride == 0 && d / stride < spec.outlier_channels) x *= spec.outlier_factor;
        }
        dst[size_t(r * head_dim + d)] = bf16::encode(float(x));
      }
    }
  };
  fill(b.q, heads_q, kStreamQ, false);
  fill(b.k, heads_kv, kStreamK, spec.kind == InputKind::kOutlierChannels);
  fill(b.v, heads_kv, kStreamV, false);
  fill(b.dout, heads_q, kStreamDO, false);
  return b;
}

}  // namespace flamia
