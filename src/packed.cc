#include "flamia/packed.h"

#include <algorithm>
#include <limits>
#include <sstream>

namespace flamia {
namespace {

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw Error(os.str());
}

}  // namespace

void validate(const PackedLayout& l) {
  if (l.num_docs < 0) fail("num_docs = ", l.num_docs, " is negative");
  if (l.tokens < 0) fail("token count = ", l.tokens, " is negative");
  if (l.tokens > std::numeric_limits<int32_t>::max())
    fail("token count = ", l.tokens, " exceeds the int32 range of cu_seqlens");
  if (l.cu_seqlens == nullptr) fail("cu_seqlens is null (it needs num_docs + 1 entries)");
  if (l.heads_q <= 0 || l.heads_kv <= 0)
    fail("head counts must be positive (heads_q = ", l.heads_q, ", heads_kv = ", l.heads_kv, ")");
  if (l.heads_q % l.heads_kv != 0)
    fail("heads_q = ", l.heads_q, " is not a multiple of heads_kv = ", l.heads_kv,
         " (GQA needs query heads = g x key/value heads)");
  if (std::find(std::begin(kSupportedHeadDims), std::end(kSupportedHeadDims), l.head_dim) ==
      std::end(kSupportedHeadDims))
    fail("head_dim = ", l.head_dim, " is not supported (supported: 64, 128)");
  if (l.cu_seqlens[0] != 0) fail("cu_seqlens[0] = ", l.cu_seqlens[0], " must be 0");
  for (int b = 0; b < l.num_docs; ++b) {
    if (l.cu_seqlens[b + 1] < l.cu_seqlens[b])
      fail("cu_seqlens[", b + 1, "] = ", l.cu_seqlens[b + 1], " < cu_seqlens[", b,
           "] = ", l.cu_seqlens[b], ": offsets must be non-decreasing");
    if (l.cu_seqlens[b + 1] > l.tokens)
      fail("cu_seqlens[", b + 1, "] = ", l.cu_seqlens[b + 1], " is past the token count ",
           l.tokens);
  }
  if (l.cu_seqlens[l.num_docs] != l.tokens)
    fail("cu_seqlens[", l.num_docs, "] = ", l.cu_seqlens[l.num_docs],
         " must equal the token count ", l.tokens);
}

std::vector<int32_t> cu_seqlens_from_lengths(const std::vector<int64_t>& lengths) {
  std::vector<int32_t> cu(lengths.size() + 1, 0);
  int64_t total = 0;
  for (size_t b = 0; b < lengths.size(); ++b) {
    if (lengths[b] < 0) fail("document ", b, " has negative length ", lengths[b]);
    total += lengths[b];
    if (total > std::numeric_limits<int32_t>::max())
      fail("documents total more than 2^31 - 1 tokens");
    cu[b + 1] = int32_t(total);
  }
  return cu;
}

void validate_view(const char* name, const void* data, int64_t stride_token, int64_t stride_head,
                   int64_t tokens, int heads, int dim) {
  if (tokens > 0 && data == nullptr) fail(name, " is null");
  if (stride_token < 0 || stride_head < 0)
    fail(name, " has negative strides (token ", stride_token, ", head ", stride_head, ")");
  if (tokens <= 1 && heads <= 1) return;
  // Rows of `dim` elements start at t * stride_token + h * stride_head. They are disjoint iff the
  // smaller stride spans a row and the larger one spans all rows of the smaller axis.
  int64_t small = stride_head, large = stride_token, small_count = heads;
  if (heads <= 1) {
    small = stride_token;
    small_count = tokens;
    large = 0;
  } else if (tokens > 1 && stride_token < stride_head) {
    small = stride_token;
    large = stride_head;
    small_count = tokens;
  }
  bool two_axes = heads > 1 && tokens > 1;
  if (small < dim || (two_axes && large < small * small_count))
    fail(name, " has overlapping rows: token stride ", stride_token, ", head stride ", stride_head,
         " for ", heads, " heads of dim ", dim);
}

}  // namespace flamia
