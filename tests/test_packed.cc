#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "flamia/packed.h"

namespace flamia {
namespace {

PackedLayout layout_of(const std::vector<int32_t>& cu, int64_t tokens, int hq = 4, int hkv = 2,
                       int dim = 128) {
  return {cu.data(), int(cu.size()) - 1, tokens, hq, hkv, dim};
}

void expect_error(const PackedLayout& l, const std::string& needle) {
  try {
    validate(l);
    ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Packed, AcceptsZeroLengthAndOneTokenDocuments) {
  std::vector<int32_t> cu = {0, 0, 1, 32, 32, 65, 194};
  EXPECT_NO_THROW(validate(layout_of(cu, 194)));
  std::vector<int32_t> empty = {0};
  EXPECT_NO_THROW(validate(layout_of(empty, 0)));
  EXPECT_EQ(layout_of(cu, 194).doc_length(2), 31);
  EXPECT_EQ(layout_of(cu, 194).group(), 2);
}

TEST(Packed, RejectsBadOffsetsWithClearMessages) {
  std::vector<int32_t> decreasing = {0, 10, 5, 20};
  expect_error(layout_of(decreasing, 20), "cu_seqlens[2] = 5 < cu_seqlens[1] = 10");
  std::vector<int32_t> past = {0, 30, 20};
  expect_error(layout_of(past, 20), "cu_seqlens[1] = 30 is past the token count 20");
  std::vector<int32_t> short_end = {0, 10, 15};
  expect_error(layout_of(short_end, 20), "cu_seqlens[2] = 15 must equal the token count 20");
  std::vector<int32_t> nonzero = {3, 10};
  expect_error(layout_of(nonzero, 10), "cu_seqlens[0] = 3 must be 0");
  PackedLayout null_cu{nullptr, 1, 10, 2, 2, 64};
  expect_error(null_cu, "cu_seqlens is null");
  std::vector<int32_t> neg = {0, -1, 10};
  expect_error(layout_of(neg, 10), "non-decreasing");
}

TEST(Packed, RejectsBadHeadsAndDims) {
  std::vector<int32_t> cu = {0, 8};
  expect_error(layout_of(cu, 8, 6, 4), "heads_q = 6 is not a multiple of heads_kv = 4");
  expect_error(layout_of(cu, 8, 0, 1), "head counts must be positive");
  expect_error(layout_of(cu, 8, 4, 4, 96), "head_dim = 96 is not supported");
  expect_error(layout_of(cu, 8, 4, 4, 0), "head_dim = 0 is not supported");
}

TEST(Packed, LengthsToOffsets) {
  EXPECT_EQ(cu_seqlens_from_lengths({3, 0, 1}), (std::vector<int32_t>{0, 3, 3, 4}));
  EXPECT_THROW(cu_seqlens_from_lengths({3, -1}), Error);
  EXPECT_THROW(cu_seqlens_from_lengths({int64_t(1) << 30, int64_t(1) << 30}), Error);
}

TEST(Packed, ViewValidation) {
  int x = 0;
  // Dense [T, H, D] and head-major [H, T, D] are both valid.
  EXPECT_NO_THROW(validate_view("Q", &x, 4 * 64, 64, 10, 4, 64));
  EXPECT_NO_THROW(validate_view("Q", &x, 64, 10 * 64, 10, 4, 64));
  EXPECT_THROW(validate_view("Q", nullptr, 256, 64, 10, 4, 64), Error);
  EXPECT_THROW(validate_view("Q", &x, 4 * 64, 32, 10, 4, 64), Error);  // heads overlap
  EXPECT_THROW(validate_view("Q", &x, 128, 64, 10, 4, 64), Error);     // tokens overlap heads
  EXPECT_THROW(validate_view("Q", &x, -1, 64, 10, 4, 64), Error);
  try {
    validate_view("K", &x, 4 * 64, 32, 10, 4, 64);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("K has overlapping rows"), std::string::npos);
  }
}

}  // namespace
}  // namespace flamia
