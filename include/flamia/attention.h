// Attention problem description shared by the FP64 reference, the CPU emulator and the kernels.
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "flamia/common.h"

namespace flamia {

// DESIGN §4. Which products run on which operand format.
enum class Recipe {
  kBf16,        // BF16 operands for all six products (P and dS rounded to BF16), FP32 accumulation
  kMxfp8,       // all six products on E4M3 with power-of-two operand scales
  kMxfp8Qk16,   // the score product (forward and its backward recomputation) on BF16 Q/K
  kNvfp4Mixed,  // NVFP4 Q/K for the score product (dequantized to BF16 on Hopper), E4M3 elsewhere
};
constexpr Recipe kAllRecipes[] = {Recipe::kBf16, Recipe::kMxfp8, Recipe::kMxfp8Qk16,
                                  Recipe::kNvfp4Mixed};
const char* to_string(Recipe r);
Recipe parse_recipe(const std::string& name);  // throws Error listing the valid names

// FP32 constants of the base-2 softmax, shared by the emulator and the kernels.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct AttentionConfig {
  bool causal = true;
  double softmax_scale = 0.0;  // 0 selects 1 / sqrt(head_dim)

  double scale_for(int head_dim) const {
    return softmax_scale > 0.0 ? softmax_scale : 1.0 / std::sqrt(double(head_dim));
  }
  // The scale in log2 units, rounded as the emulator and the kernels both use it.
  float scale_log2_for(int head_dim) const { return float(scale_for(head_dim)) * kLog2e; }
};

// Forward and backward results on the host. o, dq: [tokens][heads_q][dim]; dk, dv:
// [tokens][heads_kv][dim]; lse: [heads_q][tokens], natural log. Empty when not computed.
template <typename T>
struct AttentionOutputs {
  std::vector<T> o, lse, dq, dk, dv;
};

}  // namespace flamia
