// Emulator backward stage: one (document, query head) task; per key tile (a kernel CTA), the query
// tiles from the diagonal on.
#include <algorithm>
#include <cmath>

#include "emulator_internal.h"
#include "flamia/row_terms.h"

namespace flamia::emu {
namespace {

// Scale exponent of an operand the kernel quantizes itself (P^T, dS): rounded up over the
// elements it covers; BF16 operands need none.
int operand_exponent(Recipe r, float amax) {
  return r == Recipe::kBf16 ? 0 : scale_exponent_up(amax, e4m3::kMax);
}

void add_scaled(float* acc, const float* tile, float factor, int n) {
  for (int d = 0; d < n; ++d) acc[d] += factor * tile[d];
}

}  // namespace

void backward_task(const Problem& p, int doc, int head_q, const AttentionOutputs<float>& fwd,
                   std::vector<float>& dq, std::vector<float>& dk_part, std::vector<float>& dv_part,
                   EmulatorStats& st) {
  const int L = p.layout.doc_length(doc);
  if (L == 0) return;
  const int64_t begin = p.layout.doc_begin(doc), T = p.layout.tokens;
  const int dim = p.layout.head_dim, hq = p.layout.heads_q;
  const int BM = p.config.backward.block_m, BN = p.config.backward.block_n;
  const bool causal = p.config.attention.causal;
  const Recipe recipe = p.config.recipe;
  const TaskOperands ops = p.operands(doc, head_q, /*backward=*/true);
  const auto row_of = [&](const std::vector<float>& v, int i) {
    return &v[size_t(((begin + i) * hq + head_q) * dim)];
  };

  // Preprocess: D from the dequantized quantized dO (the values dP uses) and the forward's BF16 O.
  std::vector<float> D(L), lse2(L);
  for (int i = 0; i < L; ++i) {
    const float unit = exp2i(ops.g.exponent[i]);
    const float* o = row_of(fwd.o, i);
    const float* g = ops.g.row(i);
    float sum = 0.0f;
    for (int d = 0; d < dim; ++d) sum += (g[d] * unit) * o[d];
    // As the kernel stages it: flamia/row_terms.h's delta word, D 2^-e_dO to
    // kStagedDeltaBits with Q's row factor in the low bits.
    D[i] = delta_word(sum * exp2i(-ops.g.exponent[i]), exp2i(ops.q8.exponent[i])) * unit;
    lse2[i] = fwd.lse[size_t(head_q * T + begin + i)] * kLog2e;
  }

  std::vector<float> dq_acc(size_t(L) * dim, 0.0f), dk_acc(size_t(BN) * dim),
      dv_acc(size_t(BN) * dim);
  std::vector<float> s(size_t(BM) * BN), s_tiles(size_t(BM) * BN), dp(size_t(BM) * BN),
      P(size_t(BM) * BN), dS(size_t(BM) * BN);
  // S as the forward formed it: from K's tile codes in the key tiles the forward's item saw whole.
  const ForwardItems items(L, p.config.forward, causal);
  const bool k_tiles = !ops.sk_tiles.rm.empty();
  std::vector<float> tile(dim);
  std::vector<double> rowsum(L, 0.0), rowabs(L, 0.0);

  for (int n0 = 0; n0 < L; n0 += BN) {
    const int cols = std::min(BN, L - n0);
    std::fill(dk_acc.begin(), dk_acc.end(), 0.0f);
    std::fill(dv_acc.begin(), dv_acc.end(), 0.0f);
    const int m_first = causal ? n0 / BM * BM : 0;
    for (int m0 = m_first; m0 < L; m0 += BM) {
      const int rows = std::min(BM, L - m0);
      tile_product_abt(ops.sq, m0, rows, ops.sk, n0, cols, s.data());
      if (k_tiles) tile_product_abt(ops.sq, m0, rows, ops.sk_tiles, n0, cols, s_tiles.data());
      tile_product_abt(ops.g, m0, rows, ops.v, n0, cols, dp.data());
      int c_ref = INT32_MIN;  // dV's fold reference: max dO exponent over rows with visible keys
      for (int r = 0; r < rows; ++r) {
        const int i = m0 + r;
        const float row_factor = p.scale_log2 * exp2i(ops.sq.exponent[i]);
        const float g_unit = exp2i(ops.g.exponent[i]);
        const bool whole = k_tiles && items.visible(items.item_of(i), n0 / BN);
        const ScaledRows& sk = whole ? ops.sk_tiles : ops.sk;
        const float* sr = whole ? s_tiles.data() : s.data();
        bool any_visible = false;
        for (int c = 0; c < cols; ++c) {
          const size_t k = size_t(r) * cols + c;
          if (causal && n0 + c > i) {
            P[k] = dS[k] = 0.0f;
            continue;
          }
          any_visible = true;
          const float t = scaled_logit(sr[k], row_factor, sk.exponent[n0 + c]);
          P[k] = std::exp2(t - lse2[i]);
          const float dpv = (dp[k] * g_unit) * exp2i(ops.v.exponent[n0 + c]);
          dS[k] = P[k] * (dpv - D[i]);
          ++st.ds_entries;
          if (dS[k] != 0.0f) ++st.ds_nonzero;
          rowsum[i] += dS[k];
          rowabs[i] += std::fabs(dS[k]);
        }
        if (any_visible) c_ref = std::max(c_ref, ops.g.exponent[i]);
      }
      if (c_ref == INT32_MIN) continue;

      // dV += 2^(C-8) * E4M3(P * 2^(eg_i - C + 8))^T dO: the dO row scale folded into P^T.
      for (int c = 0; c < cols; ++c) {
        std::fill(tile.begin(), tile.end(), 0.0f);
        for (int r = 0; r < rows; ++r) {
          const float pv = P[size_t(r) * cols + c];
          if (pv == 0.0f) continue;
          const float q = round_operand(
              recipe, scale_by_pow2(pv, ops.g.exponent[m0 + r] - c_ref + kPOffsetLog2));
          if (q == 0.0f) {
            ++st.pt_underflow;
            continue;
          }
          const float* g = ops.g.row(m0 + r);
          for (int d = 0; d < dim; ++d) tile[d] += q * g[d];
        }
        add_scaled(&dv_acc[size_t(c) * dim], tile.data(), exp2i(c_ref - kPOffsetLog2), dim);
      }

      // dQ += 2^er_i * E4M3(dS * 2^ek_j / 2^er_i) K: K's scale folded into dS, then a row scale
      // over this tile's visible keys.
      for (int r = 0; r < rows; ++r) {
        const float* dsr = &dS[size_t(r) * cols];
        float amax = 0.0f;
        for (int c = 0; c < cols; ++c)
          amax = std::max(amax, std::fabs(dsr[c] * exp2i(ops.k8.exponent[n0 + c])));
        if (amax == 0.0f) continue;
        const int er = operand_exponent(recipe, amax);
        std::fill(tile.begin(), tile.end(), 0.0f);
        for (int c = 0; c < cols; ++c) {
          if (dsr[c] == 0.0f) continue;
          const float q =
              round_operand(recipe, (dsr[c] * exp2i(ops.k8.exponent[n0 + c])) * exp2i(-er));
          if (q == 0.0f) {
            ++st.ds_zero_dq;
            continue;
          }
          const float* k = ops.k8.row(n0 + c);
          for (int d = 0; d < dim; ++d) tile[d] += q * k[d];
        }
        add_scaled(&dq_acc[size_t(m0 + r) * dim], tile.data(), exp2i(er), dim);
      }

      // dK += 2^ec_j * E4M3(dS * 2^eq_i / 2^ec_j)^T Q: Q's scale folded into dS^T, then a
      // per-key scale over this tile's rows.
      for (int c = 0; c < cols; ++c) {
        float amax = 0.0f;
        for (int r = 0; r < rows; ++r)
          amax =
              std::max(amax, std::fabs(dS[size_t(r) * cols + c] * exp2i(ops.q8.exponent[m0 + r])));
        if (amax == 0.0f) continue;
        const int ec = operand_exponent(recipe, amax);
        std::fill(tile.begin(), tile.end(), 0.0f);
        for (int r = 0; r < rows; ++r) {
          const float ds = dS[size_t(r) * cols + c];
          if (ds == 0.0f) continue;
          const float q = round_operand(recipe, (ds * exp2i(ops.q8.exponent[m0 + r])) * exp2i(-ec));
          if (q == 0.0f) {
            ++st.ds_zero_dk;
            continue;
          }
          const float* qr = ops.q8.row(m0 + r);
          for (int d = 0; d < dim; ++d) tile[d] += q * qr[d];
        }
        add_scaled(&dk_acc[size_t(c) * dim], tile.data(), exp2i(ec), dim);
      }
    }
    for (int c = 0; c < cols; ++c) {
      float* dk = &dk_part[size_t(((begin + n0 + c) * hq + head_q) * dim)];
      float* dv = &dv_part[size_t(((begin + n0 + c) * hq + head_q) * dim)];
      for (int d = 0; d < dim; ++d) {
        dk[d] = dk_acc[size_t(c) * dim + d] * p.scale;
        dv[d] = dv_acc[size_t(c) * dim + d];
      }
    }
  }
  for (int i = 0; i < L; ++i) {
    float* out = &dq[size_t(((begin + i) * hq + head_q) * dim)];
    for (int d = 0; d < dim; ++d) out[d] = dq_acc[size_t(i) * dim + d] * p.scale;
    if (rowabs[i] > 0.0) st.row_residual.push_back(std::fabs(rowsum[i]) / rowabs[i]);
  }
}

}  // namespace flamia::emu
