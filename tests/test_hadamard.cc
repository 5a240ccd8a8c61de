#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "flamia/hadamard.h"

namespace flamia {
namespace {

class Hadamard : public ::testing::TestWithParam<int> {};

TEST_P(Hadamard, IsOrthonormalAndSelfInverse) {
  const int n = GetParam();
  std::vector<double> m(size_t(n * n));  // row i = R e_i
  for (int i = 0; i < n; ++i) {
    std::vector<double> e(size_t(n), 0.0);
    e[i] = 1.0;
    hadamard_rotate(e.data(), n);
    for (int j = 0; j < n; ++j) m[i * n + j] = e[j];
  }
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      double dot = 0;
      for (int k = 0; k < n; ++k) dot += m[i * n + k] * m[j * n + k];
      EXPECT_NEAR(dot, i == j ? 1.0 : 0.0, 1e-15);
      EXPECT_EQ(m[i * n + j], m[j * n + i]);  // symmetric
      EXPECT_NEAR(std::fabs(m[i * n + j]), 1.0 / std::sqrt(double(n)), 1e-16);
    }
}

TEST_P(Hadamard, PreservesScoresToRoundoff) {
  const int n = GetParam(), rows = 37;
  std::mt19937 rng(5);
  std::normal_distribution<double> g;
  std::vector<double> q(size_t(rows * n)), k(size_t(rows * n));
  for (auto& x : q) x = g(rng) * 3;
  for (auto& x : k) x = g(rng);
  k[5] = 400.0;  // an outlier channel value
  std::vector<double> qr = q, kr = k;
  for (int r = 0; r < rows; ++r) {
    hadamard_rotate(&qr[r * n], n);
    hadamard_rotate(&kr[r * n], n);
  }
  double max_err = 0, max_abs = 0;
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < rows; ++j) {
      double s = 0, sr = 0;
      for (int d = 0; d < n; ++d) {
        s += q[i * n + d] * k[j * n + d];
        sr += qr[i * n + d] * kr[j * n + d];
      }
      max_err = std::max(max_err, std::fabs(s - sr));
      max_abs = std::max(max_abs, std::fabs(s));
    }
  EXPECT_LT(max_err / max_abs, 64 * n * 1.1e-16);
  // Rotating twice restores the input.
  std::vector<double> back = qr;
  for (int r = 0; r < rows; ++r) hadamard_rotate(&back[r * n], n);
  for (size_t i = 0; i < q.size(); ++i) EXPECT_NEAR(back[i], q[i], 1e-13);
}

INSTANTIATE_TEST_SUITE_P(HeadDims, Hadamard, ::testing::Values(64, 128));

}  // namespace
}  // namespace flamia
