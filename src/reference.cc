#include "flamia/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace flamia {

const char* to_string(Recipe r) {
  switch (r) {
    case Recipe::kBf16:
      return "bf16";
    case Recipe::kMxfp8:
      return "mxfp8";
    case Recipe::kMxfp8Qk16:
      return "mxfp8-qk16";
    case Recipe::kNvfp4Mixed:
      return "nvfp4-mixed";
  }
  return "?";
}

Recipe parse_recipe(const std::string& name) {
  for (Recipe r : kAllRecipes)
    if (name == to_string(r)) return r;
  throw Error("unknown recipe '" + name + "' (valid: bf16, mxfp8, mxfp8-qk16, nvfp4-mixed)");
}

namespace {

constexpr int kQueryBlock = 64;  // rows per block: bounds the score buffer, keeps loops cache-sized

// One document's rows of one head as doubles, in both [row][d] and [d][row] layouts (the inner
// loops then run over contiguous memory and vectorize without reassociation).
struct HeadRows {
  int rows = 0, dim = 0;
  std::vector<double> rm, cm;  // row-major, column-major

  void load(const std::vector<double>& src, int heads, int head, int64_t begin, int n, int d) {
    rows = n;
    dim = d;
    rm.assign(size_t(n) * d, 0.0);
    cm.assign(size_t(n) * d, 0.0);
    for (int i = 0; i < n; ++i)
      for (int k = 0; k < d; ++k) {
        const double x = src[size_t(((begin + i) * heads + head) * d + k)];
        rm[size_t(i) * d + k] = x;
        cm[size_t(k) * n + i] = x;
      }
  }
  const double* row(int i) const { return &rm[size_t(i) * dim]; }
};

// out[i][j] = sum_k a[i][k] * b[k][j] for i in [0, m), j in [0, n); a row-major with stride lda,
// b column-major rows of `ldb`.
void matmul_abt(const double* a, int m, int lda, const double* bcm, int ldb, int n, int kdim,
                double* out) {
  for (int i = 0; i < m; ++i) {
    double* o = out + size_t(i) * n;
    std::fill(o, o + n, 0.0);
    for (int k = 0; k < kdim; ++k) {
      const double aik = a[size_t(i) * lda + k];
      const double* b = bcm + size_t(k) * ldb;
      for (int j = 0; j < n; ++j) o[j] += aik * b[j];
    }
  }
}

void axpy(double alpha, const double* x, double* y, int n) {
  for (int k = 0; k < n; ++k) y[k] += alpha * x[k];
}

}  // namespace

PackedLayout DoubleBatch::layout() const {
  return {cu_seqlens.data(), int(cu_seqlens.size()) - 1, tokens, heads_q, heads_kv, head_dim};
}

DoubleBatch to_double(const AttentionBatch& b) {
  DoubleBatch d;
  d.cu_seqlens = b.cu_seqlens;
  d.tokens = b.tokens;
  d.heads_q = b.heads_q;
  d.heads_kv = b.heads_kv;
  d.head_dim = b.head_dim;
  auto convert = [](const std::vector<uint16_t>& src, std::vector<double>& dst) {
    dst.resize(src.size());
    for (size_t i = 0; i < src.size(); ++i) dst[i] = bf16::decode(src[i]);
  };
  convert(b.q, d.q);
  convert(b.k, d.k);
  convert(b.v, d.v);
  convert(b.dout, d.dout);
  return d;
}

AttentionOutputs<double> reference_attention(const AttentionBatch& batch,
                                             const AttentionConfig& config, bool backward) {
  return reference_attention(to_double(batch), config, backward);
}

AttentionOutputs<double> reference_attention(const DoubleBatch& batch,
                                             const AttentionConfig& config, bool backward) {
  const PackedLayout pl = batch.layout();
  validate(pl);
  const int hq = pl.heads_q, hkv = pl.heads_kv, dim = pl.head_dim, group = pl.group();
  const int64_t T = pl.tokens;
  const double scale = config.scale_for(dim);

  AttentionOutputs<double> out;
  out.o.assign(size_t(T * hq * dim), 0.0);
  out.lse.assign(size_t(hq * T), -std::numeric_limits<double>::infinity());
  const size_t q_size = size_t(T * hq * dim), kv_size = size_t(T * hkv * dim);
  if (batch.q.size() != q_size || batch.k.size() != kv_size || batch.v.size() != kv_size)
    throw Error("reference: Q, K, V sizes do not match the layout");
  if (backward && batch.dout.size() != q_size) throw Error("reference: the backward pass needs dO");
  if (backward) {
    out.dq.assign(size_t(T * hq * dim), 0.0);
    out.dk.assign(size_t(T * hkv * dim), 0.0);
    out.dv.assign(size_t(T * hkv * dim), 0.0);
  }

  const int tasks = pl.num_docs * hkv;
#pragma omp parallel for schedule(dynamic, 1)
  for (int task = 0; task < tasks; ++task) {
    const int doc = task / hkv, kvh = task % hkv;
    const int64_t begin = pl.doc_begin(doc);
    const int L = pl.doc_length(doc);
    if (L == 0) continue;
    HeadRows k, v, q, g;
    k.load(batch.k, hkv, kvh, begin, L, dim);
    v.load(batch.v, hkv, kvh, begin, L, dim);
    std::vector<double> dk(size_t(L) * dim, 0.0), dv(size_t(L) * dim, 0.0);
    std::vector<double> s(size_t(kQueryBlock) * L), dp(size_t(kQueryBlock) * L);
    std::vector<double> o_row(dim), dq_row(dim);

    for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
      q.load(batch.q, hq, h, begin, L, dim);
      if (backward) g.load(batch.dout, hq, h, begin, L, dim);
      for (int i0 = 0; i0 < L; i0 += kQueryBlock) {
        const int m = std::min(kQueryBlock, L - i0);
        const int nkeys = config.causal ? i0 + m : L;
        matmul_abt(q.row(i0), m, dim, k.cm.data(), L, nkeys, dim, s.data());
        if (backward) matmul_abt(g.row(i0), m, dim, v.cm.data(), L, nkeys, dim, dp.data());
        for (int r = 0; r < m; ++r) {
          const int i = i0 + r;
          const int visible = config.causal ? i + 1 : L;
          double* sr = &s[size_t(r) * nkeys];
          double mx = -std::numeric_limits<double>::infinity();
          for (int j = 0; j < visible; ++j) {
            sr[j] *= scale;
            mx = std::max(mx, sr[j]);
          }
          double sum = 0.0;
          for (int j = 0; j < visible; ++j) {
            sr[j] = std::exp(sr[j] - mx);
            sum += sr[j];
          }
          std::fill(o_row.begin(), o_row.end(), 0.0);
          for (int j = 0; j < visible; ++j) {
            sr[j] /= sum;  // now P_ij
            axpy(sr[j], v.row(j), o_row.data(), dim);
          }
          const int64_t t = begin + i;
          std::copy(o_row.begin(), o_row.end(), &out.o[size_t((t * hq + h) * dim)]);
          out.lse[size_t(h * T + t)] = mx + std::log(sum);
          if (!backward) continue;

          const double* gi = g.row(i);
          double D = 0.0;
          for (int d = 0; d < dim; ++d) D += gi[d] * o_row[d];
          const double* dpr = &dp[size_t(r) * nkeys];
          std::fill(dq_row.begin(), dq_row.end(), 0.0);
          for (int j = 0; j < visible; ++j) {
            const double ds = sr[j] * (dpr[j] - D);
            axpy(scale * ds, k.row(j), dq_row.data(), dim);
            axpy(scale * ds, q.row(i), &dk[size_t(j) * dim], dim);
            axpy(sr[j], gi, &dv[size_t(j) * dim], dim);
          }
          std::copy(dq_row.begin(), dq_row.end(), &out.dq[size_t((t * hq + h) * dim)]);
        }
      }
    }
    if (backward) {
      for (int j = 0; j < L; ++j)
        for (int d = 0; d < dim; ++d) {
          out.dk[size_t(((begin + j) * hkv + kvh) * dim + d)] = dk[size_t(j) * dim + d];
          out.dv[size_t(((begin + j) * hkv + kvh) * dim + d)] = dv[size_t(j) * dim + d];
        }
    }
  }
  return out;
}

}  // namespace flamia
