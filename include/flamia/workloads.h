// The benchmark's packed causal workloads (issue 5): 65,536 tokens, 16 query heads, head dim 128,
// documents generated with fixed seeds.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flamia/packed.h"

namespace flamia {

struct Workload {
  std::string name;
  std::vector<int64_t> docs;  // document lengths, packed in this order
  int heads_q = 16, heads_kv = 16, head_dim = 128;
  bool causal = true;

  int64_t tokens() const;
  // Query-key pairs the mask leaves visible: sum L(L+1)/2 (causal) or sum L^2.
  double visible_pairs() const;
  // FLOPs counted on visible pairs only: forward 4 * pairs * d * heads_q, backward 2.5 x that.
  double forward_flops() const {
    return attention_forward_flops(visible_pairs(), head_dim, heads_q);
  }
  double backward_flops() const { return 2.5 * forward_flops(); }
};

constexpr int64_t kWorkloadTokens = 65536;

// The nine named workloads: 16x4096, 8x8192, 4x16384, 2x32768, 1x65536, 8192+224x256, lognormal
// (lengths exp(7 + 1.2 N(0,1)), the last one truncated), tiny-unaligned (lengths uniform in
// 17..496, the last one truncated) and 4x16384-gqa (16 query / 4 key-value heads).
std::vector<Workload> standard_workloads();
Workload workload_by_name(const std::string& name);  // throws Error listing the names

}  // namespace flamia
