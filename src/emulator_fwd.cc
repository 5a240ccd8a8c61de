// Emulator forward stage: one (document, query head) task, query tile x key tile.
#include <algorithm>
#include <climits>
#include <cmath>

#include "emulator_internal.h"

namespace flamia::emu {

void forward_task(const Problem& p, int doc, int head_q, AttentionOutputs<float>& out,
                  EmulatorStats& st) {
  const int L = p.layout.doc_length(doc);
  if (L == 0) return;
  const int64_t begin = p.layout.doc_begin(doc), T = p.layout.tokens;
  const int dim = p.layout.head_dim, hq = p.layout.heads_q;
  const int BM = p.config.forward.block_m, BN = p.config.forward.block_n;
  const bool causal = p.config.attention.causal;
  const Recipe recipe = p.config.recipe;
  const TaskOperands ops = p.operands(doc, head_q, /*backward=*/false);
  constexpr float kOffset = float(kPOffsetLog2);
  constexpr int kNoExponent = INT_MIN;

  std::vector<float> s(size_t(BM) * BN), acc(size_t(BM) * dim), tile(dim);
  std::vector<float> m(BM), l(BM);
  std::vector<int> R(BM);
  const ForwardItems items(L, p.config.forward, causal);
  for (int item0 = items.item_of(0); item0 < L; item0 += BM) {
    const int m0 = std::max(item0, 0);
    const int rows = std::min(item0 + BM, L) - m0;
    std::fill(m.begin(), m.end(), -INFINITY);
    std::fill(l.begin(), l.end(), 0.0f);
    std::fill(R.begin(), R.end(), kNoExponent);
    std::fill(acc.begin(), acc.end(), 0.0f);
    // Key tiles from the last visible one (the masked one) down to the first, as the kernel runs
    // them: the order fixes every rescale and so the E4M3 rounding of each P~.
    for (int kb = items.last_tile(item0); kb >= 0; --kb) {
      const int n0 = kb * BN;
      const int cols = std::min(BN, L - n0);
      // A tile every row of the item sees reads the tile codes: one K and one V exponent.
      const bool whole = items.visible(item0, kb);
      const ScaledRows& sk = whole && !ops.sk_tiles.rm.empty() ? ops.sk_tiles : ops.sk;
      const ScaledRows& v = whole && !ops.v_tiles.rm.empty() ? ops.v_tiles : ops.v;
      tile_product_abt(ops.sq, m0, rows, sk, n0, cols, s.data());
      for (int r = 0; r < rows; ++r) {
        const int i = m0 + r;
        const int visible = causal ? std::min(cols, i - n0 + 1) : cols;
        if (visible <= 0) continue;
        float* sr = &s[size_t(r) * cols];
        const float row_factor = p.scale_log2 * exp2i(ops.sq.exponent[i]);
        float tile_max = -INFINITY;
        int r_new = R[r];
        for (int c = 0; c < visible; ++c) {
          sr[c] = scaled_logit(sr[c], row_factor, sk.exponent[n0 + c]);
          tile_max = std::max(tile_max, sr[c]);
          if (ops.fold_v) r_new = std::max(r_new, v.exponent[n0 + c]);
        }
        const float m_new = std::max(m[r], tile_max);
        // Rescale of the running state: the softmax max and the V reference exponent together.
        const float alpha = m[r] == -INFINITY ? 0.0f : std::exp2(m[r] - m_new);
        const float r_factor =
            (R[r] == kNoExponent || !ops.fold_v) ? 1.0f : scale_by_pow2(1.0f, R[r] - r_new);
        std::fill(tile.begin(), tile.end(), 0.0f);
        float psum = 0.0f;
        for (int c = 0; c < visible; ++c) {
          const float P = std::exp2(sr[c] - m_new + kOffset);
          psum += P;
          const float pt = ops.fold_v ? scale_by_pow2(P, v.exponent[n0 + c] - r_new) : P;
          st.p_max = std::max(st.p_max, double(pt));
          const float p8 = round_operand(recipe, pt);
          ++st.p_entries;
          if (p8 == 0.0f) {
            if (pt > 0.0f) ++st.p_underflow;
            continue;
          }
          const float* vr = v.row(n0 + c);
          for (int d = 0; d < dim; ++d) tile[d] += p8 * vr[d];
        }
        l[r] = l[r] * alpha + psum;
        float* a = &acc[size_t(r) * dim];
        const float rescale = alpha * r_factor;
        for (int d = 0; d < dim; ++d) a[d] = a[d] * rescale + tile[d];
        m[r] = m_new;
        R[r] = r_new;
      }
    }
    for (int r = 0; r < rows; ++r) {
      const int64_t t = begin + m0 + r;
      if (l[r] == 0.0f) continue;  // no visible key (cannot happen for causal rows)
      // One division per row (the kernel's epilogue): O = O_acc * (2^R / l).
      const float scale = (ops.fold_v ? exp2i(R[r]) : 1.0f) / l[r];
      float* o = &out.o[size_t((t * hq + head_q) * dim)];
      for (int d = 0; d < dim; ++d) o[d] = bf16::round(acc[size_t(r) * dim + d] * scale);
      out.lse[size_t(head_q * T + t)] = kLn2 * (m[r] - kOffset + std::log2(l[r]));
    }
  }
  if (st.p_max > e4m3::kMax)
    throw Error("internal: P~ exceeded the E4M3 budget (" + std::to_string(st.p_max) + " > 448)");
}

}  // namespace flamia::emu
