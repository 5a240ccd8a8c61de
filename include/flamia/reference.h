// FP64 reference attention on packed documents: the yardstick of every accuracy number.
//
// Inputs are the batch's BF16 values (exact in double); every product and sum runs in double.
// Per document and query head h (key/value head h / group), for visible keys j of query i (same
// document; j <= i when causal):
//   s_ij = scale * q_i . k_j,  P = softmax_j(s),  O_i = sum_j P_ij v_j,  LSE_i = log sum_j e^s_ij
//   dP_ij = dO_i . v_j,  D_i = dO_i . O_i,  dS_ij = P_ij (dP_ij - D_i)
//   dQ_i = scale sum_j dS_ij k_j,  dK_j = scale sum_i dS_ij q_i,  dV_j = sum_i P_ij dO_i
// with dK and dV summed over the query heads of a group.
#pragma once

#include "flamia/attention.h"
#include "flamia/inputs.h"

namespace flamia {

// Dense double inputs in the batch layout ([tokens][heads][dim]).
struct DoubleBatch {
  std::vector<int32_t> cu_seqlens;
  int64_t tokens = 0;
  int heads_q = 0, heads_kv = 0, head_dim = 0;
  std::vector<double> q, k, v, dout;

  PackedLayout layout() const;
};
DoubleBatch to_double(const AttentionBatch& batch);  // exact: BF16 values

// backward = false leaves dq, dk, dv empty.
AttentionOutputs<double> reference_attention(const DoubleBatch& batch,
                                             const AttentionConfig& config, bool backward = true);
AttentionOutputs<double> reference_attention(const AttentionBatch& batch,
                                             const AttentionConfig& config, bool backward = true);

}  // namespace flamia
