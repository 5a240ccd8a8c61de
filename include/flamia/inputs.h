// Reproducible packed attention inputs for tests, accuracy runs and the benchmark (DESIGN §4's
// stress cases). Values come from a counter-based generator, so any element can be drawn
// independently (and in parallel) and a seed gives the same tensors on every machine.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flamia/packed.h"
#include "flamia/quantize.h"

namespace flamia {

enum class InputKind {
  kNormal,           // N(0, 1) entries
  kHeavyTail,        // each (token, head) row of Q, K, V, dO scaled by exp(sigma * N(0, 1))
  kOutlierChannels,  // normal, with a few K channels (the same in every head) scaled by a factor
};
const char* to_string(InputKind k);
InputKind parse_input_kind(const std::string& name);  // "normal", "heavy-tail", "outlier-channels"

struct InputSpec {
  InputKind kind = InputKind::kNormal;
  double sigma = 1.0;            // heavy-tail log-normal spread
  int outlier_channels = 4;      // outlier-channels: how many K channels
  double outlier_factor = 20.0;  // outlier-channels: their scale
  uint64_t seed = 1;
};

// Host tensors, dense [tokens][heads][dim], BF16 bits.
struct AttentionBatch {
  std::vector<int32_t> cu_seqlens;
  int64_t tokens = 0;
  int heads_q = 0, heads_kv = 0, head_dim = 0;
  std::vector<uint16_t> q, k, v, dout;

  PackedLayout layout() const;
  // Views into this batch: Q, K and V always present (non-null, even with no tokens), dO when
  // the batch has one (an empty dout, as with no tokens, is skipped by the quantizers).
  AttentionInputs inputs() const;
};

AttentionBatch generate_batch(const std::vector<int64_t>& doc_lengths, int heads_q, int heads_kv,
                              int head_dim, const InputSpec& spec);

// Standard normal deviate number `index` of stream `stream` under `seed` (Box-Muller on a
// splitmix64 hash of the three).
double normal_deviate(uint64_t seed, uint64_t stream, uint64_t index);

}  // namespace flamia
