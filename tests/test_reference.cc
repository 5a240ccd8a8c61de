// The FP64 reference against the naive formula (dense softmax per query, written here without
// tiling) and against central finite differences of L = sum(O * dO).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "flamia/reference.h"

namespace flamia {
namespace {

DoubleBatch random_double_batch(const std::vector<int64_t>& docs, int hq, int hkv, int dim,
                                uint64_t seed) {
  AttentionBatch b =
      generate_batch(docs, hq, hkv, dim, InputSpec{InputKind::kNormal, 1, 4, 20, seed});
  DoubleBatch d = to_double(b);
  // Off the BF16 grid, so nothing depends on the inputs being BF16.
  int64_t i = 0;
  for (auto* t : {&d.q, &d.k, &d.v, &d.dout})
    for (double& x : *t) x += 1e-3 * normal_deviate(seed + 7, 99, uint64_t(i++));
  return d;
}

// Naive attention for one (document, query head): explicit softmax over the visible keys.
void naive(const DoubleBatch& b, const AttentionConfig& cfg, AttentionOutputs<double>& out) {
  const int hq = b.heads_q, hkv = b.heads_kv, D = b.head_dim, g = hq / hkv;
  const double scale = cfg.scale_for(D);
  out.o.assign(b.q.size(), 0);
  out.lse.assign(size_t(hq * b.tokens), 0);
  out.dq.assign(b.q.size(), 0);
  out.dk.assign(b.k.size(), 0);
  out.dv.assign(b.v.size(), 0);
  auto Q = [&](int64_t t, int h, int d) { return b.q[size_t((t * hq + h) * D + d)]; };
  auto K = [&](int64_t t, int h, int d) { return b.k[size_t((t * hkv + h) * D + d)]; };
  auto V = [&](int64_t t, int h, int d) { return b.v[size_t((t * hkv + h) * D + d)]; };
  auto G = [&](int64_t t, int h, int d) { return b.dout[size_t((t * hq + h) * D + d)]; };
  for (size_t doc = 0; doc + 1 < b.cu_seqlens.size(); ++doc) {
    const int64_t s = b.cu_seqlens[doc], e = b.cu_seqlens[doc + 1];
    for (int h = 0; h < hq; ++h) {
      const int kh = h / g;
      for (int64_t i = s; i < e; ++i) {
        const int64_t last = cfg.causal ? i : e - 1;
        std::vector<double> p;
        double mx = -INFINITY;
        for (int64_t j = s; j <= last; ++j) {
          double dot = 0;
          for (int d = 0; d < D; ++d) dot += Q(i, h, d) * K(j, kh, d);
          p.push_back(scale * dot);
          mx = std::max(mx, p.back());
        }
        double z = 0;
        for (double& x : p) z += (x = std::exp(x - mx));
        for (double& x : p) x /= z;
        out.lse[size_t(h * b.tokens + i)] = mx + std::log(z);
        std::vector<double> o(D, 0.0);
        for (int64_t j = s; j <= last; ++j)
          for (int d = 0; d < D; ++d) o[d] += p[size_t(j - s)] * V(j, kh, d);
        double Dsum = 0;
        for (int d = 0; d < D; ++d) {
          out.o[size_t((i * hq + h) * D + d)] = o[d];
          Dsum += o[d] * G(i, h, d);
        }
        for (int64_t j = s; j <= last; ++j) {
          double dp = 0;
          for (int d = 0; d < D; ++d) dp += G(i, h, d) * V(j, kh, d);
          const double pij = p[size_t(j - s)], ds = pij * (dp - Dsum);
          for (int d = 0; d < D; ++d) {
            out.dq[size_t((i * hq + h) * D + d)] += scale * ds * K(j, kh, d);
            out.dk[size_t((j * hkv + kh) * D + d)] += scale * ds * Q(i, h, d);
            out.dv[size_t((j * hkv + kh) * D + d)] += pij * G(i, h, d);
          }
        }
      }
    }
  }
}

double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

class ReferenceVsNaive : public ::testing::TestWithParam<std::tuple<bool, int>> {};

TEST_P(ReferenceVsNaive, MatchesToRoundoff) {
  const auto [causal, hkv] = GetParam();
  // Documents of 1, 31, 33, 129 tokens (more than one 64-row query block) and an empty one.
  DoubleBatch b = random_double_batch({1, 31, 0, 33, 129}, 4, hkv, 64, 3);
  AttentionConfig cfg;
  cfg.causal = causal;
  AttentionOutputs<double> got = reference_attention(b, cfg), want;
  naive(b, cfg, want);
  EXPECT_LT(max_diff(got.o, want.o), 1e-12);
  EXPECT_LT(max_diff(got.lse, want.lse), 1e-12);
  EXPECT_LT(max_diff(got.dq, want.dq), 1e-12);
  EXPECT_LT(max_diff(got.dk, want.dk), 1e-12);
  EXPECT_LT(max_diff(got.dv, want.dv), 1e-12);
}

INSTANTIATE_TEST_SUITE_P(MaskAndGqa, ReferenceVsNaive,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(4, 2, 1)));

TEST(Reference, GradientsMatchFiniteDifferences) {
  // L = sum(O * dO) with dO fixed: dL/dQ = dQ, dL/dK = dK, dL/dV = dV.
  for (bool causal : {true, false}) {
    DoubleBatch b = random_double_batch({5, 7}, 2, 1, 64, 11);
    AttentionConfig cfg;
    cfg.causal = causal;
    cfg.softmax_scale = 0.3;
    const AttentionOutputs<double> g = reference_attention(b, cfg);
    auto loss = [&](const DoubleBatch& x) {
      const AttentionOutputs<double> r = reference_attention(x, cfg, false);
      double l = 0;
      for (size_t i = 0; i < r.o.size(); ++i) l += r.o[i] * x.dout[i];
      return l;
    };
    const double h = 1e-5;
    struct Case {
      std::vector<double> DoubleBatch::*tensor;
      const std::vector<double>* grad;
    };
    for (Case c : {Case{&DoubleBatch::q, &g.dq}, Case{&DoubleBatch::k, &g.dk},
                   Case{&DoubleBatch::v, &g.dv}}) {
      for (size_t i = 0; i < (b.*c.tensor).size(); i += 37) {
        DoubleBatch plus = b, minus = b;
        (plus.*c.tensor)[i] += h;
        (minus.*c.tensor)[i] -= h;
        const double fd = (loss(plus) - loss(minus)) / (2 * h);
        EXPECT_NEAR(fd, (*c.grad)[i], 1e-7 * std::max(1.0, std::fabs(fd))) << i;
      }
    }
  }
}

TEST(Reference, RejectsMismatchedInputs) {
  DoubleBatch b = random_double_batch({4}, 2, 2, 64, 1);
  b.v.pop_back();
  EXPECT_THROW(reference_attention(b, AttentionConfig{}), Error);
  b = random_double_batch({4}, 2, 2, 64, 1);
  b.dout.clear();
  EXPECT_THROW(reference_attention(b, AttentionConfig{}), Error);
  EXPECT_NO_THROW(reference_attention(b, AttentionConfig{}, /*backward=*/false));
}

}  // namespace
}  // namespace flamia
