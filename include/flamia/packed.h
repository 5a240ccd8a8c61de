// Packed variable-length documents: the layout every flamia entry point takes.
//
// Q, dO and O are [tokens, heads_q, head_dim]; K and V are [tokens, heads_kv, head_dim]; the head
// dimension is contiguous, the token and head strides are free (in elements). Document b occupies
// tokens [cu_seqlens[b], cu_seqlens[b+1]). Query head h reads key/value head h / group, with
// group = heads_q / heads_kv (GQA; group 1 is ordinary multi-head attention).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flamia/common.h"

namespace flamia {

constexpr int kSupportedHeadDims[] = {64, 128};

struct PackedLayout {
  const int32_t* cu_seqlens = nullptr;  // host memory, num_docs + 1 non-decreasing offsets
  int num_docs = 0;
  int64_t tokens = 0;
  int heads_q = 0;
  int heads_kv = 0;
  int head_dim = 0;

  int group() const { return heads_q / heads_kv; }
  int32_t doc_begin(int b) const { return cu_seqlens[b]; }
  int32_t doc_length(int b) const { return cu_seqlens[b + 1] - cu_seqlens[b]; }
};

// Query-key pairs the mask leaves visible in a document of `length` tokens: L(L+1)/2 causal, L^2
// otherwise.
inline double visible_pairs(int64_t length, bool causal) {
  const double n = double(length);
  return causal ? 0.5 * n * (n + 1) : n * n;
}

// FLOPs of an attention forward over `pairs` visible query-key pairs: a multiply-add per head
// dimension in QK^T and one in PV, for each query head. (The benchmark counts the backward
// as 2.5x.)
inline double attention_forward_flops(double pairs, int head_dim, int heads_q) {
  return 4.0 * pairs * head_dim * heads_q;
}

// Throws flamia::Error naming the first violated rule: offsets start at 0, never decrease, stay
// within int32, end at `tokens`; head counts positive with heads_q divisible by heads_kv; head_dim
// one of kSupportedHeadDims. Zero-length and one-token documents are valid.
void validate(const PackedLayout& layout);

// cu_seqlens for the given document lengths (each >= 0); throws on negative lengths or overflow.
std::vector<int32_t> cu_seqlens_from_lengths(const std::vector<int64_t>& lengths);

// A strided [tokens, heads, dim] view with the dim axis contiguous.
template <typename T>
struct TokenTensor {
  T* data = nullptr;
  int64_t stride_token = 0;
  int64_t stride_head = 0;

  T& at(int64_t token, int head, int d) const {
    return data[token * stride_token + head * stride_head + d];
  }
};

// Dense row-major [tokens, heads, dim] view of `data`.
template <typename T>
TokenTensor<T> dense_view(T* data, int heads, int dim) {
  return {data, int64_t(heads) * dim, int64_t(dim)};
}

// Throws unless the view is non-null (when tokens > 0), its strides are non-negative and no two
// (token, head) rows of `dim` elements overlap. `name` appears in the message.
void validate_view(const char* name, const void* data, int64_t stride_token, int64_t stride_head,
                   int64_t tokens, int heads, int dim);

template <typename T>
void validate_view(const char* name, const TokenTensor<T>& v, int64_t tokens, int heads, int dim) {
  validate_view(name, v.data, v.stride_token, v.stride_head, tokens, heads, dim);
}

}  // namespace flamia
