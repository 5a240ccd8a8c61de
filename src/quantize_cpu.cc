#include <algorithm>
#include <climits>
#include <cmath>
#include <sstream>

#include "flamia/hadamard.h"
#include "flamia/quantize.h"

namespace flamia {

const char* to_string(ScalePolicy p) {
  switch (p) {
    case ScalePolicy::kToken:
      return "token";
    case ScalePolicy::kBlock32:
      return "block32";
    case ScalePolicy::kTensor:
      return "tensor";
    case ScalePolicy::kFloor:
      return "floor";
    case ScalePolicy::kVGroup16:
      return "vgroup16";
  }
  return "?";
}

ScalePolicy parse_scale_policy(const std::string& name) {
  for (ScalePolicy p : kAllScalePolicies)
    if (name == to_string(p)) return p;
  throw Error("unknown scale policy '" + name +
              "' (valid: token, block32, tensor, floor, vgroup16)");
}

const char* to_string(Operand op) {
  switch (op) {
    case Operand::kQ:
      return "Q";
    case Operand::kK:
      return "K";
    case Operand::kV:
      return "V";
    case Operand::kDO:
      return "dO";
  }
  return "?";
}

ScalePolicy effective_policy(ScalePolicy policy, Operand op) {
  if (policy == ScalePolicy::kVGroup16 && op != Operand::kV) return ScalePolicy::kToken;
  return policy;
}

bool NonFiniteReport::any() const {
  return std::any_of(first_index.begin(), first_index.end(), [](int64_t i) { return i >= 0; });
}

std::string NonFiniteReport::message() const {
  for (int op = 0; op < kNumOperands; ++op) {
    int64_t i = first_index[op];
    if (i < 0) continue;
    const QuantLayout& l = layouts[op];
    std::ostringstream os;
    os << "non-finite input in " << to_string(Operand(op)) << " at token " << i / (l.heads * l.dim)
       << ", head " << (i / l.dim) % l.heads << ", dim " << i % l.dim;
    return os.str();
  }
  return {};
}

void NonFiniteReport::throw_if_any() const {
  if (any()) throw Error(message());
}

const E4M3Operand& QuantizedAttention::operand(Operand op) const {
  switch (op) {
    case Operand::kQ:
      return q;
    case Operand::kK:
      return k;
    case Operand::kV:
      return v;
    case Operand::kDO:
      break;
  }
  return dout;
}

namespace {

// Reads one (token, head) row as floats: non-finite values become 0 (and are reported), then the
// optional rotation.
struct RowReader {
  TokenTensor<const uint16_t> view;
  int dim;
  bool rotate;

  // Returns the flat index of the first non-finite element of the row, or -1.
  int64_t load(int64_t t, int h, int heads, float* out) const {
    int64_t bad = -1;
    const uint16_t* row = &view.at(t, h, 0);
    for (int d = 0; d < dim; ++d) {
      float x = bf16::decode(row[d]);
      if (!is_finite_float(x)) {
        if (bad < 0) bad = (t * heads + h) * dim + d;
        x = 0.0f;
      }
      out[d] = x;
    }
    if (rotate) hadamard_rotate(out, dim);
    return bad;
  }
};

float row_amax(const float* x, int n) {
  float m = 0.0f;
  for (int i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

int exponent_for(ScalePolicy policy, float amax) {
  return policy == ScalePolicy::kFloor ? scale_exponent_floor(amax)
                                       : scale_exponent_up(amax, e4m3::kMax);
}

// Per-(token, head) amax rows and the first non-finite index of the operand.
struct RowStats {
  std::vector<float> amax;  // [T][H]
  int64_t first_bad = -1;
};

RowStats collect_row_amax(const RowReader& reader, int64_t tokens, int heads) {
  RowStats s;
  s.amax.assign(size_t(tokens * heads), 0.0f);
  std::vector<int64_t> bad(size_t(tokens * heads), -1);
#pragma omp parallel
  {
    std::vector<float> buf(reader.dim);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < tokens * heads; ++r) {
      bad[r] = reader.load(r / heads, int(r % heads), heads, buf.data());
      s.amax[r] = row_amax(buf.data(), reader.dim);
    }
  }
  for (int64_t b : bad)
    if (b >= 0) {
      s.first_bad = b;
      break;
    }
  return s;
}

// Exponent of every (token, head) row under a token-geometry policy.
std::vector<int> row_exponents(ScalePolicy policy, const RowStats& stats, const PackedLayout& pl,
                               int heads) {
  std::vector<int> e(stats.amax.size());
  switch (policy) {
    case ScalePolicy::kToken:
    case ScalePolicy::kVGroup16:
      for (size_t r = 0; r < e.size(); ++r) e[r] = exponent_for(policy, stats.amax[r]);
      break;
    case ScalePolicy::kTensor: {
      float m = 0.0f;
      for (float a : stats.amax) m = std::max(m, a);
      std::fill(e.begin(), e.end(), exponent_for(policy, m));
      break;
    }
    case ScalePolicy::kBlock32:
    case ScalePolicy::kFloor:
      for (int b = 0; b < pl.num_docs; ++b) {
        for (int64_t s = pl.doc_begin(b); s < pl.cu_seqlens[b + 1]; s += kBlockTokens) {
          int64_t end = std::min<int64_t>(s + kBlockTokens, pl.cu_seqlens[b + 1]);
          for (int h = 0; h < heads; ++h) {
            float m = 0.0f;
            for (int64_t t = s; t < end; ++t) m = std::max(m, stats.amax[t * heads + h]);
            int ex = exponent_for(policy, m);
            for (int64_t t = s; t < end; ++t) e[t * heads + h] = ex;
          }
        }
      }
      break;
  }
  return e;
}

// vgroup16: one exponent per (document-local 16-token group, head, channel), for the E2M1 grid.
std::vector<uint8_t> vgroup_channel_exponents(const RowReader& reader, const PackedLayout& pl,
                                              int heads) {
  const int dim = reader.dim;
  std::vector<uint8_t> ce(size_t(pl.tokens * heads * dim));
  std::vector<float> buf(dim), amax(dim);
  for (int b = 0; b < pl.num_docs; ++b) {
    for (int64_t s = pl.doc_begin(b); s < pl.cu_seqlens[b + 1]; s += kVGroupTokens) {
      int64_t end = std::min<int64_t>(s + kVGroupTokens, pl.cu_seqlens[b + 1]);
      for (int h = 0; h < heads; ++h) {
        std::fill(amax.begin(), amax.end(), 0.0f);
        for (int64_t t = s; t < end; ++t) {
          reader.load(t, h, heads, buf.data());
          for (int d = 0; d < dim; ++d) amax[d] = std::max(amax[d], std::fabs(buf[d]));
        }
        for (int64_t t = s; t < end; ++t)
          for (int d = 0; d < dim; ++d)
            ce[(t * heads + h) * dim + d] =
                ue8m0::from_exponent(scale_exponent_up(amax[d], e2m1::kMax));
      }
    }
  }
  return ce;
}

// vgroup16's 4-bit V: x / 2^e rounded to the E2M1 grid, stored as the E4M3 code of that grid
// value (every E2M1 value is an E4M3 value), so the kernels' V path needs no second format.
uint8_t e2m1_grid_as_e4m3(float x, int e) {
  return e4m3::encode(e2m1::decode(e2m1::encode_scaled(x, exp2i(e))));
}

E4M3Operand quantize_e4m3(const RowReader& reader, const PackedLayout& pl, int heads,
                          ScalePolicy policy, bool transposed, int64_t* first_bad) {
  E4M3Operand out;
  out.layout = QuantLayout::make(pl.tokens, heads, reader.dim, pl.num_docs);
  const QuantLayout& l = out.layout;
  const int64_t rows = pl.tokens * heads;
  RowStats stats = collect_row_amax(reader, pl.tokens, heads);
  *first_bad = stats.first_bad;
  std::vector<int> e = row_exponents(policy, stats, pl, heads);
  out.exponents.assign(size_t(l.num_exponents()), kPaddingExponentCode);
  for (int64_t r = 0; r < rows; ++r)
    out.exponents[l.exponent(int(r % heads), r / heads)] = ue8m0::from_exponent(e[r]);
  if (policy == ScalePolicy::kVGroup16)
    out.channel_exponents = vgroup_channel_exponents(reader, pl, heads);

  out.codes.assign(size_t(l.num_codes()), 0);
#pragma omp parallel
  {
    std::vector<float> buf(l.dim);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = r / heads;
      const int h = int(r % heads);
      reader.load(t, h, heads, buf.data());
      for (int d = 0; d < l.dim; ++d) {
        const int e = out.exponent(t, h, d);
        out.codes[l.code(t, h, d)] = policy == ScalePolicy::kVGroup16 ? e2m1_grid_as_e4m3(buf[d], e)
                                                                      : e4m3_quantize(buf[d], e);
      }
    }
  }
  if (transposed) {  // every position without a token keeps code 0
    out.codes_t.assign(size_t(l.num_codes_t()), 0);
    for (int b = 0; b < pl.num_docs; ++b) {
      const int64_t begin = pl.doc_begin(b), pos = transposed_doc_begin(begin, b);
      for (int r = 0; r < pl.doc_length(b); ++r)
        for (int h = 0; h < heads; ++h)
          for (int d = 0; d < l.dim; ++d)
            out.codes_t[l.code_t(h, d, pos + transposed_slot(r))] =
                out.codes[l.code(begin + r, h, d)];
    }
  }
  return out;
}

// Smallest E4M3 local scale s with amax <= 6 * s * 2^e, by exact comparisons.
uint8_t nvfp4_local_scale(float amax, int e) {
  const float unit = exp2i(e);
  auto covers = [&](uint8_t c) { return e4m3::decode(c) * e2m1::kMax * unit >= amax; };
  uint8_t c = e4m3::encode_up(std::min(amax * exp2i(-e) / e2m1::kMax, e4m3::kMax));
  while (!covers(c) && c < e4m3::kMaxCode) ++c;
  while (c > 0 && covers(uint8_t(c - 1))) --c;
  return c;
}

Nvfp4Operand quantize_nvfp4(const RowReader& reader, const PackedLayout& pl, int heads) {
  const int64_t tokens = pl.tokens;
  Nvfp4Operand out;
  out.layout = QuantLayout::make(tokens, heads, reader.dim, pl.num_docs);
  const QuantLayout& l = out.layout;
  out.packed.assign(size_t(tokens * heads * l.dim / 2), 0);
  out.local_scales.assign(size_t(tokens * heads * l.dim / kNvfp4GroupSize), 0);
  out.exponents.assign(size_t(l.num_exponents()), kPaddingExponentCode);
#pragma omp parallel
  {
    std::vector<float> buf(l.dim);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < tokens * heads; ++r) {
      const int64_t t = r / heads;
      const int h = int(r % heads);
      reader.load(t, h, heads, buf.data());
      const int e = scale_exponent_up(row_amax(buf.data(), l.dim), kNvfp4TokenMax);
      out.exponents[l.exponent(h, t)] = ue8m0::from_exponent(e);
      for (int g = 0; g < l.dim; g += kNvfp4GroupSize) {
        const float amax = row_amax(&buf[g], kNvfp4GroupSize);
        const uint8_t s = amax > 0.0f ? nvfp4_local_scale(amax, e) : 0;
        out.local_scales[l.nvfp4_scale(t, h, g)] = s;
        const float scale = e4m3::decode(s) * exp2i(e);
        for (int d = g; d < g + kNvfp4GroupSize; ++d) {
          const uint8_t c = s == 0 ? 0 : e2m1::encode_scaled(buf[d], scale);
          out.packed[l.nvfp4_byte(t, h, d)] |= uint8_t((d & 1) ? c << 4 : c);
        }
      }
    }
  }
  return out;
}

// Calls f(document, document-relative token, shift) for every token of every document, shift =
// tile_shift of its exponent in head h against its tile's largest.
template <typename F>
void for_each_tile_shift(const E4M3Operand& o, const PackedLayout& pl, int h, F f) {
  const QuantLayout& l = o.layout;
  for (int b = 0; b < pl.num_docs; ++b) {
    const int64_t begin = pl.doc_begin(b);
    const int length = pl.doc_length(b);
    for (int n0 = 0; n0 < length; n0 += kKeyTileTokens) {
      const int keys = std::min(kKeyTileTokens, length - n0);
      int tile_max = INT_MIN;
      for (int j = 0; j < keys; ++j)
        tile_max = std::max(tile_max, ue8m0::exponent(o.exponents[l.exponent(h, begin + n0 + j)]));
      for (int j = 0; j < keys; ++j)
        f(b, n0 + j,
          tile_shift(ue8m0::exponent(o.exponents[l.exponent(h, begin + n0 + j)]), tile_max));
    }
  }
}

// The tile codes need per-token exponents and the codes they requantize, on the operand's layout.
void require_tile_inputs(const E4M3Operand& o, const PackedLayout& pl, size_t codes,
                         const char* what) {
  validate(pl);
  const QuantLayout& l = o.layout;
  const QuantLayout want = QuantLayout::make(pl.tokens, l.heads, l.dim, pl.num_docs);
  if (!o.channel_exponents.empty())
    throw Error(std::string(what) + ": the operand has per-channel exponents (vgroup16)");
  if (l.tokens != want.tokens || l.tokens_t != want.tokens_t ||
      o.exponents.size() != size_t(l.num_exponents()))
    throw Error(std::string(what) + ": the operand's layout is not the packed layout's");
  if (codes == 0 && l.num_codes() > 0)
    throw Error(std::string(what) + ": the operand has no codes to requantize");
}

}  // namespace

uint8_t tile_code(uint8_t code, int shift) {
  return e4m3::encode(e4m3::decode(code) * exp2i(shift));
}

std::vector<uint8_t> make_codes_tiles(const E4M3Operand& k, const PackedLayout& pl) {
  require_tile_inputs(k, pl, k.codes.size(), "make_codes_tiles");
  const QuantLayout& l = k.layout;
  std::vector<uint8_t> out(k.codes.size(), 0);
  for (int h = 0; h < l.heads; ++h)
    for_each_tile_shift(k, pl, h, [&](int b, int r, int shift) {
      const int64_t t = pl.doc_begin(b) + r;
      for (int d = 0; d < l.dim; ++d)
        out[size_t(l.code(t, h, d))] = tile_code(k.codes[size_t(l.code(t, h, d))], shift);
    });
  return out;
}

std::vector<uint8_t> make_codes_t_tiles(const E4M3Operand& v, const PackedLayout& pl) {
  require_tile_inputs(v, pl, v.codes_t.size(), "make_codes_t_tiles");
  const QuantLayout& l = v.layout;
  std::vector<uint8_t> out(v.codes_t.size(), 0);  // positions without a token stay 0
  for (int h = 0; h < l.heads; ++h)
    for_each_tile_shift(v, pl, h, [&](int b, int r, int shift) {
      const int64_t pos = transposed_doc_begin(pl.doc_begin(b), b) + transposed_slot(r);
      for (int d = 0; d < l.dim; ++d) {
        const int64_t at = l.code_t(h, d, pos);
        out[size_t(at)] = tile_code(v.codes_t[size_t(at)], shift);
      }
    });
  return out;
}

QuantizedAttention quantize_cpu(const AttentionInputs& in, const QuantizeOptions& options) {
  const PackedLayout& pl = in.layout;
  validate(pl);
  const std::array<bool, kNumOperands> present = present_operands(in);
  constexpr Operand kAll[] = {Operand::kQ, Operand::kK, Operand::kV, Operand::kDO};
  for (Operand op : kAll)
    if (present[int(op)])
      validate_view(to_string(op), operand_input(in, op), pl.tokens, operand_heads(pl, op),
                    pl.head_dim);

  QuantizedAttention out;
  E4M3Operand* const dst[kNumOperands] = {&out.q, &out.k, &out.v, &out.dout};
  for (Operand op : kAll) {
    if (!present[int(op)]) continue;
    const bool rotate = options.hadamard && (op == Operand::kQ || op == Operand::kK);
    RowReader reader{operand_input(in, op), pl.head_dim, rotate};
    *dst[int(op)] =
        quantize_e4m3(reader, pl, operand_heads(pl, op), effective_policy(options.policy, op),
                      options.transposed, &out.non_finite.first_index[int(op)]);
    out.non_finite.layouts[int(op)] = dst[int(op)]->layout;
    if (writes_codes_t_tiles(options, op))
      dst[int(op)]->codes_t_tiles = make_codes_t_tiles(*dst[int(op)], pl);
    if (writes_codes_tiles(options, op))
      dst[int(op)]->codes_tiles = make_codes_tiles(*dst[int(op)], pl);
    if (!writes_codes(options, op)) dst[int(op)]->codes.clear();  // codes_t came from them above
  }
  if (options.nvfp4_qk && present[int(Operand::kQ)])
    out.q4 = quantize_nvfp4(RowReader{in.q, pl.head_dim, options.hadamard}, pl, pl.heads_q);
  if (options.nvfp4_qk && present[int(Operand::kK)])
    out.k4 = quantize_nvfp4(RowReader{in.k, pl.head_dim, options.hadamard}, pl, pl.heads_kv);
  return out;
}

}  // namespace flamia
