#include "flamia/probe.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace flamia {

const char* to_string(ProbeControl c) {
  switch (c) {
    case ProbeControl::kSuffixRandom:
      return "suffix-random";
    case ProbeControl::kSuffixDouble:
      return "suffix-double";
    case ProbeControl::kSuffixSpike:
      return "suffix-spike";
    case ProbeControl::kOtherDocument:
      return "other-document";
    case ProbeControl::kMoveAligned:
      return "move-aligned";
    case ProbeControl::kMoveUnaligned:
      return "move-unaligned";
  }
  return "?";
}

bool is_suffix_control(ProbeControl c) {
  return c == ProbeControl::kSuffixRandom || c == ProbeControl::kSuffixDouble ||
         c == ProbeControl::kSuffixSpike;
}

int default_prefix_end(int doc_length) {
  const int p = doc_length / 2 / kBlockTokens * kBlockTokens + (kBlockTokens - 2);
  return p + 1 < doc_length ? p : doc_length - 2;
}

namespace {

constexpr int kSpikeLog2 = 6;
constexpr int64_t kAlignedShift = 64;
constexpr int64_t kUnalignedShift = 13;

// The four input tensors of a batch by index (Q, K, V, dO), and rows of them.
constexpr int kQ = 0, kK = 1, kV = 2, kDO = 3;
std::vector<uint16_t>& tensor(AttentionBatch& b, int i) {
  return i == kQ ? b.q : i == kK ? b.k : i == kV ? b.v : b.dout;
}
const std::vector<uint16_t>& tensor(const AttentionBatch& b, int i) {
  return i == kQ ? b.q : i == kK ? b.k : i == kV ? b.v : b.dout;
}
int heads_of(const AttentionBatch& b, int i) {
  return (i == kQ || i == kDO) ? b.heads_q : b.heads_kv;
}

uint16_t* row_ptr(AttentionBatch& b, int i, int64_t token, int head) {
  return &tensor(b, i)[size_t((token * heads_of(b, i) + head) * b.head_dim)];
}

void redraw_rows(AttentionBatch& b, int i, int64_t begin, int64_t end, uint64_t seed) {
  const int heads = heads_of(b, i), dim = b.head_dim;
  for (int64_t tok = begin; tok < end; ++tok)
    for (int h = 0; h < heads; ++h) {
      uint16_t* r = row_ptr(b, i, tok, h);
      for (int d = 0; d < dim; ++d)
        r[d] = bf16::encode(
            float(normal_deviate(seed, uint64_t(i), uint64_t((tok * heads + h) * dim + d))));
    }
}

void scale_row(AttentionBatch& b, int i, int64_t token, float factor) {
  for (int h = 0; h < heads_of(b, i); ++h) {
    uint16_t* r = row_ptr(b, i, token, h);
    for (int d = 0; d < b.head_dim; ++d)
      r[d] = bf16::encode(bf16::decode(r[d]) * factor);  // exact: 2^k
  }
}

// The first suffix row of each head becomes twice the prefix row with the largest magnitude.
void double_largest_prefix_row(AttentionBatch& b, int i, int64_t begin, int64_t prefix_end,
                               int64_t target) {
  const int dim = b.head_dim;
  for (int h = 0; h < heads_of(b, i); ++h) {
    int64_t best = begin;
    float best_amax = -1.0f;
    for (int64_t tok = begin; tok <= prefix_end; ++tok) {
      const uint16_t* r = row_ptr(b, i, tok, h);
      float amax = 0.0f;
      for (int d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(bf16::decode(r[d])));
      if (amax > best_amax) {
        best_amax = amax;
        best = tok;
      }
    }
    const uint16_t* src = row_ptr(b, i, best, h);
    uint16_t* dst = row_ptr(b, i, target, h);
    for (int d = 0; d < dim; ++d) dst[d] = bf16::encode(2.0f * bf16::decode(src[d]));
  }
}

// A copy of `b` with a document of `length` random tokens inserted before document `doc`.
AttentionBatch insert_document_before(const AttentionBatch& b, int doc, int64_t length,
                                      uint64_t seed) {
  std::vector<int64_t> lengths;
  for (size_t i = 0; i + 1 < b.cu_seqlens.size(); ++i) {
    if (int(i) == doc) lengths.push_back(length);
    lengths.push_back(b.cu_seqlens[i + 1] - b.cu_seqlens[i]);
  }
  AttentionBatch out = b;
  out.cu_seqlens = cu_seqlens_from_lengths(lengths);
  out.tokens = out.cu_seqlens.back();
  const int64_t at = b.cu_seqlens[doc];
  for (int i = kQ; i <= kDO; ++i) {
    const int64_t row = int64_t(heads_of(b, i)) * b.head_dim;
    const std::vector<uint16_t>& src = tensor(b, i);
    std::vector<uint16_t>& dst = tensor(out, i);
    dst.assign(size_t(out.tokens * row), 0);
    std::copy(src.begin(), src.begin() + at * row, dst.begin());
    std::copy(src.begin() + at * row, src.end(), dst.begin() + (at + length) * row);
    redraw_rows(out, i, at, at + length, seed);
  }
  return out;
}

struct Change {
  double rel = 0;
  bool exact = true;
  int64_t first_changed = -1;  // earliest document-relative row that changed
};

// Compares rows [0, rows) of a document between two runs; `per_row` values per (row, head).
Change compare_rows(const std::vector<float>& a, int64_t a_begin, const std::vector<float>& b,
                    int64_t b_begin, int64_t rows, int heads, int width, bool head_major,
                    int64_t a_tokens, int64_t b_tokens) {
  Change c;
  double max_base = 0, max_diff = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int h = 0; h < heads; ++h)
      for (int k = 0; k < width; ++k) {
        const size_t ia = head_major ? size_t(h * a_tokens + a_begin + r)
                                     : size_t(((a_begin + r) * heads + h) * width + k);
        const size_t ib = head_major ? size_t(h * b_tokens + b_begin + r)
                                     : size_t(((b_begin + r) * heads + h) * width + k);
        const float x = a[ia], y = b[ib];
        max_base = std::max(max_base, double(std::fabs(x)));
        if (std::memcmp(&x, &y, sizeof x) != 0) {
          c.exact = false;
          max_diff = std::max(max_diff, double(std::fabs(x - y)));
          if (c.first_changed < 0 || r < c.first_changed) c.first_changed = r;
        }
      }
  c.rel = max_base > 0 ? max_diff / max_base : max_diff;
  return c;
}

// Runs one batch and checks the shapes of what the runner returned. `dq_expected` (null for the
// base run) says whether the base run returned dQ: every run must agree with it.
AttentionOutputs<float> checked_run(const ProbeRunner& runner, const AttentionBatch& b,
                                    const bool* dq_expected) {
  AttentionOutputs<float> out = runner(b);
  const size_t rows = size_t(b.tokens) * size_t(b.heads_q);
  const size_t values = rows * size_t(b.head_dim);
  if (out.o.size() != values || out.lse.size() != rows)
    throw Error("probe runner returned O of " + std::to_string(out.o.size()) + " and LSE of " +
                std::to_string(out.lse.size()) + " values; expected " + std::to_string(values) +
                " and " + std::to_string(rows));
  if (!out.dq.empty() && out.dq.size() != values)
    throw Error("probe runner returned dQ of " + std::to_string(out.dq.size()) +
                " values; expected " + std::to_string(values) + " or none");
  if (dq_expected && *dq_expected != !out.dq.empty())
    throw Error("probe runner returned dQ for some batches and not for others");
  return out;
}

}  // namespace

ProbeTarget resolve_probe_target(const PackedLayout& layout, int doc, int prefix_end) {
  if (doc < 0) {
    doc = 0;
    for (int d = 1; d < layout.num_docs; ++d)
      if (layout.doc_length(d) > layout.doc_length(doc)) doc = d;
  }
  if (doc >= layout.num_docs)
    throw Error("probe target document " + std::to_string(doc) + " is past the last document");
  const int L = layout.doc_length(doc);
  if (L < 2) throw Error("the probe's target document needs at least 2 tokens");
  const int p = prefix_end >= 0 ? prefix_end : default_prefix_end(L);
  if (p + 1 >= L) throw Error("prefix_end must leave at least one suffix row");
  return {doc, p};
}

ProbeRunner emulator_runner(const EmulatorConfig& emulator) {
  return [emulator](const AttentionBatch& b) { return emulate(b, emulator).out; };
}

std::vector<ProbeOutcome> run_probe(const AttentionBatch& base, const ProbeConfig& config,
                                    const std::vector<ProbeControl>& controls) {
  if (!config.emulator.backward_pass) throw Error("the probe needs the backward pass (dQ)");
  return run_probe(base, config, controls, emulator_runner(config.emulator));
}

std::vector<ProbeOutcome> run_probe(const AttentionBatch& base, const ProbeConfig& config,
                                    const std::vector<ProbeControl>& controls,
                                    const ProbeRunner& runner) {
  const PackedLayout layout = base.layout();
  validate(layout);
  if (!runner) throw Error("run_probe: the runner is empty");
  const ProbeTarget target = resolve_probe_target(layout, config.target_doc, config.prefix_end);
  const int doc = target.doc, p = target.prefix_end;
  const int L = layout.doc_length(doc);
  const int64_t begin = layout.doc_begin(doc);
  const int dim = base.head_dim;

  const AttentionOutputs<float> ref = checked_run(runner, base, nullptr);
  const bool dq_probed = !ref.dq.empty();
  std::vector<ProbeOutcome> outcomes;
  for (ProbeControl control : controls) {
    AttentionBatch b = base;
    int64_t new_begin = begin;
    int64_t rows = L;  // rows compared
    switch (control) {
      case ProbeControl::kSuffixRandom:
        for (int i : {kK, kV})
          redraw_rows(b, i, begin + p + 1, begin + L, config.perturbation_seed);
        rows = p + 1;
        break;
      case ProbeControl::kSuffixDouble:
        for (int i : {kK, kV}) double_largest_prefix_row(b, i, begin, begin + p, begin + p + 1);
        rows = p + 1;
        break;
      case ProbeControl::kSuffixSpike:
        for (int i : {kK, kV}) scale_row(b, i, begin + p + 1, float(1 << kSpikeLog2));
        rows = p + 1;
        break;
      case ProbeControl::kOtherDocument: {
        int other = -1;
        for (int d = 0; d < layout.num_docs; ++d)
          if (d != doc && layout.doc_length(d) > 0) other = d;
        if (other < 0) continue;  // a single document: nothing to change
        const int64_t ob = layout.doc_begin(other), oe = ob + layout.doc_length(other);
        for (int i = kQ; i <= kDO; ++i) {
          redraw_rows(b, i, ob, oe, config.perturbation_seed);
          scale_row(b, i, ob, float(1 << kSpikeLog2));
        }
        break;
      }
      case ProbeControl::kMoveAligned:
      case ProbeControl::kMoveUnaligned: {
        const int64_t shift =
            control == ProbeControl::kMoveAligned ? kAlignedShift : kUnalignedShift;
        b = insert_document_before(base, doc, shift, config.perturbation_seed);
        new_begin = begin + shift;
        break;
      }
    }
    const AttentionOutputs<float> got = checked_run(runner, b, &dq_probed);
    const int hq = base.heads_q;
    const Change o =
        compare_rows(ref.o, begin, got.o, new_begin, rows, hq, dim, false, base.tokens, b.tokens);
    const Change lse =
        compare_rows(ref.lse, begin, got.lse, new_begin, rows, hq, 1, true, base.tokens, b.tokens);
    Change dq;
    if (dq_probed)
      dq = compare_rows(ref.dq, begin, got.dq, new_begin, rows, hq, dim, false, base.tokens,
                        b.tokens);
    ProbeOutcome out;
    out.control = control;
    out.o_change = o.rel;
    out.lse_change = lse.rel;
    out.o_exact = o.exact;
    out.lse_exact = lse.exact;
    out.dq_probed = dq_probed;
    out.dq_change = dq_probed ? dq.rel : std::nan("");
    out.dq_exact = dq_probed && dq.exact;
    if (is_suffix_control(control)) {
      int64_t first = -1;
      for (const Change& c : {o, lse, dq})
        if (c.first_changed >= 0 && (first < 0 || c.first_changed < first)) first = c.first_changed;
      out.leak_reach = first < 0 ? 0 : int(p + 1 - first);
    }
    outcomes.push_back(out);
  }
  return outcomes;
}

}  // namespace flamia
