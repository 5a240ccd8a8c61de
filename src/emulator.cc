// CPU emulator: operand assembly per recipe and the orchestration of the forward and backward
// stages (emulator_fwd.cc, emulator_bwd.cc).
#include <algorithm>

#include "emulator_internal.h"
#include "flamia/hadamard.h"

namespace flamia {
namespace emu {
namespace {

ScaledRows rows_from_e4m3(const E4M3Operand& o, int head, int64_t begin, int n) {
  ScaledRows r;
  r.rows = n;
  r.dim = o.layout.dim;
  r.rm.resize(size_t(n) * r.dim);
  r.exponent.assign(n, 0);
  const bool per_channel = !o.channel_exponents.empty();
  for (int i = 0; i < n; ++i) {
    const int64_t t = begin + i;
    // Per-channel scales cannot leave the product: such rows are dequantized in place.
    if (!per_channel) r.exponent[i] = ue8m0::exponent(o.exponents[o.layout.exponent(head, t)]);
    for (int d = 0; d < r.dim; ++d)
      r.rm[size_t(i) * r.dim + d] =
          per_channel ? o.value(t, head, d) : e4m3::decode(o.codes[o.layout.code(t, head, d)]);
  }
  return r;
}

ScaledRows rows_from_nvfp4(const Nvfp4Operand& o, int head, int64_t begin, int n) {
  ScaledRows r;
  r.rows = n;
  r.dim = o.layout.dim;
  r.rm.resize(size_t(n) * r.dim);
  r.exponent.resize(n);
  for (int i = 0; i < n; ++i) {
    r.exponent[i] = o.exponent(begin + i, head);
    for (int d = 0; d < r.dim; ++d)
      r.rm[size_t(i) * r.dim + d] = o.unscaled_value(begin + i, head, d);
  }
  return r;
}

// BF16 inputs; `rotate` applies the Hadamard rotation in FP32 and rounds back to BF16 (the bf16
// recipe's rotated operand).
ScaledRows rows_from_bf16(const std::vector<uint16_t>& src, int heads, int head, int dim,
                          int64_t begin, int n, bool rotate) {
  ScaledRows r;
  r.rows = n;
  r.dim = dim;
  r.rm.resize(size_t(n) * dim);
  r.exponent.assign(n, 0);
  for (int i = 0; i < n; ++i) {
    float* row = &r.rm[size_t(i) * dim];
    for (int d = 0; d < dim; ++d)
      row[d] = bf16::decode(src[size_t(((begin + i) * heads + head) * dim + d)]);
    if (rotate) {
      hadamard_rotate(row, dim);
      for (int d = 0; d < dim; ++d) row[d] = bf16::round(row[d]);
    }
  }
  return r;
}

}  // namespace

ScaledRows tile_requantized(const ScaledRows& rows, int tile) {
  ScaledRows t = rows;
  t.cm.clear();
  for (int n0 = 0; n0 < rows.rows; n0 += tile) {
    const int n1 = std::min(n0 + tile, rows.rows);
    const int top = *std::max_element(rows.exponent.begin() + n0, rows.exponent.begin() + n1);
    for (int j = n0; j < n1; ++j) {
      const int shift = tile_shift(rows.exponent[j], top);
      // The rows hold decoded codes: the quantizer's rule on their codes (flamia/quantize.h).
      for (int d = 0; d < rows.dim; ++d) {
        float& x = t.rm[size_t(j) * rows.dim + d];
        x = e4m3::decode(tile_code(e4m3::encode(x), shift));
      }
      t.exponent[j] = top;
    }
  }
  if (!rows.cm.empty()) t.build_column_major();
  return t;
}

TaskOperands Problem::operands(int doc, int head_q, bool backward) const {
  const AttentionBatch& b = *batch;
  const int64_t begin = layout.doc_begin(doc);
  const int n = layout.doc_length(doc), dim = layout.head_dim;
  const int head_kv = head_q / layout.group();
  const Recipe recipe = config.recipe;
  const bool rot = config.hadamard;
  TaskOperands ops;
  auto bf16_rows = [&](const std::vector<uint16_t>& src, int heads, int head, bool rotate) {
    return rows_from_bf16(src, heads, head, dim, begin, n, rotate);
  };

  switch (recipe) {
    case Recipe::kBf16:
      ops.sq = bf16_rows(b.q, b.heads_q, head_q, rot);
      ops.sk = bf16_rows(b.k, b.heads_kv, head_kv, rot);
      break;
    case Recipe::kMxfp8:
      ops.sq = rows_from_e4m3(quant->q, head_q, begin, n);
      ops.sk = rows_from_e4m3(quant->k, head_kv, begin, n);
      break;
    case Recipe::kMxfp8Qk16:
      ops.sq = bf16_rows(b.q, b.heads_q, head_q, false);
      ops.sk = bf16_rows(b.k, b.heads_kv, head_kv, false);
      break;
    case Recipe::kNvfp4Mixed:
      ops.sq = rows_from_nvfp4(quant->q4, head_q, begin, n);
      ops.sk = rows_from_nvfp4(quant->k4, head_kv, begin, n);
      break;
  }
  ops.sk.build_column_major();
  if (recipe == Recipe::kBf16) {
    ops.v = bf16_rows(b.v, b.heads_kv, head_kv, false);
  } else {
    ops.v = rows_from_e4m3(quant->v, head_kv, begin, n);
    ops.fold_v = quant->v.channel_exponents.empty();
    // The kernels' key tiles and blocks are kKeyTileTokens keys; other emulator tiles keep
    // per-token codes (both passes alike, so the backward recomputes the forward's S).
    const bool tiles =
        config.forward.block_n == kKeyTileTokens && config.backward.block_n == kKeyTileTokens;
    if (tiles && ops.fold_v) ops.v_tiles = tile_requantized(ops.v, kKeyTileTokens);
    if (tiles && recipe == Recipe::kMxfp8) ops.sk_tiles = tile_requantized(ops.sk, kKeyTileTokens);
  }
  if (!backward) return ops;

  ops.v.build_column_major();
  if (recipe == Recipe::kBf16) {
    ops.q8 = ops.sq;
    ops.k8 = ops.sk;
    ops.g = bf16_rows(b.dout, b.heads_q, head_q, false);
  } else {
    ops.q8 = rows_from_e4m3(quant->q, head_q, begin, n);
    ops.k8 = rows_from_e4m3(quant->k, head_kv, begin, n);
    ops.g = rows_from_e4m3(quant->dout, head_q, begin, n);
  }
  return ops;
}

namespace {

void merge(EmulatorStats& into, const EmulatorStats& s) {
  into.p_entries += s.p_entries;
  into.p_underflow += s.p_underflow;
  into.p_max = std::max(into.p_max, s.p_max);
  into.ds_entries += s.ds_entries;
  into.ds_nonzero += s.ds_nonzero;
  into.ds_zero_dq += s.ds_zero_dq;
  into.ds_zero_dk += s.ds_zero_dk;
  into.pt_underflow += s.pt_underflow;
  into.row_residual.insert(into.row_residual.end(), s.row_residual.begin(), s.row_residual.end());
}

// Inputs that are nonzero (after the optional rotation) but quantize to a zero code.
void count_operand_underflow(const AttentionBatch& b, const QuantizedAttention& qa, bool rotate,
                             EmulatorStats& st) {
  const int dim = b.head_dim;
  std::vector<float> row(dim);
  for (Operand op : {Operand::kQ, Operand::kK, Operand::kV, Operand::kDO}) {
    const std::vector<uint16_t>& src = op == Operand::kQ   ? b.q
                                       : op == Operand::kK ? b.k
                                       : op == Operand::kV ? b.v
                                                           : b.dout;
    const E4M3Operand& o = qa.operand(op);
    const bool rot = rotate && (op == Operand::kQ || op == Operand::kK);
    int64_t nonzero = 0, underflow = 0;
    for (size_t r = 0; r < src.size() / dim; ++r) {
      for (int d = 0; d < dim; ++d) row[d] = bf16::decode(src[r * dim + d]);
      if (rot) hadamard_rotate(row.data(), dim);
      for (int d = 0; d < dim; ++d) {
        if (row[d] == 0.0f) continue;
        ++nonzero;
        if ((o.codes[r * dim + d] & 0x7F) == 0) ++underflow;
      }
    }
    st.operand_nonzero[int(op)] = nonzero;
    st.operand_underflow[int(op)] = underflow;
  }
}

}  // namespace
}  // namespace emu

EmulatorResult emulate(const AttentionBatch& batch, const EmulatorConfig& config) {
  using namespace emu;
  const PackedLayout layout = batch.layout();
  validate(layout);
  if (config.forward.block_m <= 0 || config.forward.block_n <= 0 || config.backward.block_m <= 0 ||
      config.backward.block_n <= 0)
    throw Error("tile sizes must be positive");
  if (config.backward_pass && batch.dout.empty()) throw Error("the backward pass needs dO");

  QuantizeOptions qo;
  qo.policy = config.policy;
  qo.hadamard = config.hadamard;
  qo.transposed = false;  // the emulator reads codes row-wise; codes_t is the kernels' copy
  qo.nvfp4_qk = config.recipe == Recipe::kNvfp4Mixed;
  AttentionInputs in = batch.inputs();
  if (!config.backward_pass) in.dout.data = nullptr;
  const QuantizedAttention qa = quantize_cpu(in, qo);
  qa.non_finite.throw_if_any();

  Problem p;
  p.batch = &batch;
  p.quant = &qa;
  p.config = config;
  p.layout = layout;
  p.scale = float(config.attention.scale_for(layout.head_dim));
  p.scale_log2 = config.attention.scale_log2_for(layout.head_dim);

  const int64_t T = layout.tokens;
  const int hq = layout.heads_q, hkv = layout.heads_kv, dim = layout.head_dim;
  EmulatorResult res;
  if (config.recipe != Recipe::kBf16 && config.backward_pass)
    count_operand_underflow(batch, qa, config.hadamard, res.stats);
  res.out.o.assign(size_t(T * hq * dim), 0.0f);
  res.out.lse.assign(size_t(hq * T), -INFINITY);

  // Longest documents first so the dynamic schedule balances.
  std::vector<int> docs(layout.num_docs);
  for (int d = 0; d < layout.num_docs; ++d) docs[d] = d;
  std::stable_sort(docs.begin(), docs.end(),
                   [&](int a, int b) { return layout.doc_length(a) > layout.doc_length(b); });
  const int tasks = layout.num_docs * hq;
  std::vector<EmulatorStats> task_stats(tasks);
#pragma omp parallel for schedule(dynamic, 1)
  for (int task = 0; task < tasks; ++task)
    forward_task(p, docs[task / hq], task % hq, res.out, task_stats[task]);
  if (config.backward_pass) {
    res.out.dq.assign(size_t(T * hq * dim), 0.0f);
    std::vector<float> dk_part(size_t(T * hq * dim), 0.0f), dv_part(size_t(T * hq * dim), 0.0f);
#pragma omp parallel for schedule(dynamic, 1)
    for (int task = 0; task < tasks; ++task)
      backward_task(p, docs[task / hq], task % hq, res.out, res.out.dq, dk_part, dv_part,
                    task_stats[task]);
    // GQA: dK, dV summed over each group's query heads, in head order.
    res.out.dk.assign(size_t(T * hkv * dim), 0.0f);
    res.out.dv.assign(size_t(T * hkv * dim), 0.0f);
    const int group = layout.group();
    for (int64_t t = 0; t < T; ++t)
      for (int h = 0; h < hq; ++h)
        for (int d = 0; d < dim; ++d) {
          const size_t src = size_t((t * hq + h) * dim + d),
                       dst = size_t((t * hkv + h / group) * dim + d);
          res.out.dk[dst] += dk_part[src];
          res.out.dv[dst] += dv_part[src];
        }
    // Gradients of rotated Q and K rotate back (the rotation is its own inverse).
    if (config.hadamard) {
      for (int64_t r = 0; r < T * hq; ++r) hadamard_rotate(&res.out.dq[size_t(r * dim)], dim);
      for (int64_t r = 0; r < T * hkv; ++r) hadamard_rotate(&res.out.dk[size_t(r * dim)], dim);
    }
    for (auto* v : {&res.out.dq, &res.out.dk, &res.out.dv})
      for (float& x : *v) x = bf16::round(x);
  }
  for (const EmulatorStats& s : task_stats) merge(res.stats, s);
  return res;
}

}  // namespace flamia
