#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "flamia/metrics.h"

namespace flamia {
namespace {

TEST(Metrics, CosineAndRelativeL2) {
  const std::vector<double> ref = {3, 4, 0};
  Similarity same = compare(std::vector<double>{3, 4, 0}, ref);
  EXPECT_DOUBLE_EQ(same.cosine, 1.0);
  EXPECT_DOUBLE_EQ(same.rel_l2, 0.0);
  Similarity ortho = compare(std::vector<double>{4, -3, 0}, ref);
  EXPECT_NEAR(ortho.cosine, 0.0, 1e-15);
  EXPECT_NEAR(ortho.rel_l2, std::sqrt(2.0), 1e-15);
  Similarity scaled = compare(std::vector<float>{6, 8, 0}, ref);
  EXPECT_DOUBLE_EQ(scaled.cosine, 1.0);
  EXPECT_DOUBLE_EQ(scaled.rel_l2, 1.0);
  EXPECT_DOUBLE_EQ(scaled.max_abs_err, 4.0);
  EXPECT_THROW(compare(std::vector<double>{1}, ref), Error);
}

TEST(Metrics, NaNNeverPasses) {
  const std::vector<double> ref = {1, 2};
  Similarity s = compare(std::vector<float>{1, std::numeric_limits<float>::quiet_NaN()}, ref);
  EXPECT_TRUE(std::isnan(s.cosine));
  EXPECT_TRUE(std::isnan(s.rel_l2));
  EXPECT_TRUE(std::isnan(s.max_abs_err));
}

TEST(Metrics, Quantiles) {
  EXPECT_DOUBLE_EQ(quantile({5, 1, 3}, 0.5), 3);
  EXPECT_DOUBLE_EQ(quantile({1, 2}, 0.5), 1.5);
  EXPECT_DOUBLE_EQ(quantile({1, 2, 3, 4, 5}, 1.0), 5);
  EXPECT_DOUBLE_EQ(quantile({1, 2, 3, 4, 5}, 0.0), 1);
  EXPECT_TRUE(std::isnan(quantile({}, 0.5)));
}

}  // namespace
}  // namespace flamia
