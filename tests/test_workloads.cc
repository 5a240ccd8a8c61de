#include <gtest/gtest.h>

#include <cmath>

#include "flamia/common.h"
#include "flamia/workloads.h"

namespace flamia {
namespace {

TEST(Workloads, NineNamedWorkloadsOf65536Tokens) {
  const auto all = standard_workloads();
  ASSERT_EQ(all.size(), 9u);
  for (const Workload& w : all) {
    EXPECT_EQ(w.tokens(), kWorkloadTokens) << w.name;
    EXPECT_EQ(w.heads_q, 16);
    EXPECT_EQ(w.head_dim, 128);
    EXPECT_TRUE(w.causal);
    for (int64_t d : w.docs) EXPECT_GE(d, 1) << w.name;
  }
  EXPECT_EQ(workload_by_name("4x16384-gqa").heads_kv, 4);
  EXPECT_EQ(workload_by_name("8192+224x256").docs.size(), 225u);
  EXPECT_THROW(workload_by_name("3x100"), Error);
}

TEST(Workloads, GeneratedLengthsFollowTheirDistributions) {
  const Workload tiny = workload_by_name("tiny-unaligned");
  for (size_t i = 0; i + 1 < tiny.docs.size(); ++i) {
    EXPECT_GE(tiny.docs[i], 17);
    EXPECT_LE(tiny.docs[i], 496);
  }
  EXPECT_GT(tiny.docs.size(), 200u);  // about 65536 / 256.5
  const Workload ln = workload_by_name("lognormal");
  double mean_log = 0;
  for (size_t i = 0; i + 1 < ln.docs.size(); ++i) mean_log += std::log(double(ln.docs[i]));
  mean_log /= double(ln.docs.size() - 1);
  EXPECT_NEAR(mean_log, 7.0, 0.6);  // few documents: a loose check of the draw
  // Fixed seeds: the same lengths every time.
  EXPECT_EQ(workload_by_name("lognormal").docs, ln.docs);
}

TEST(Workloads, FlopsCountVisiblePairsOnly) {
  Workload w;
  w.docs = {4, 2};
  w.heads_q = 2;
  w.head_dim = 8;
  EXPECT_DOUBLE_EQ(w.visible_pairs(), 10 + 3);
  EXPECT_DOUBLE_EQ(w.forward_flops(), 4.0 * 13 * 8 * 2);
  EXPECT_DOUBLE_EQ(w.backward_flops(), 2.5 * w.forward_flops());
  w.causal = false;
  EXPECT_DOUBLE_EQ(w.visible_pairs(), 16 + 4);
  // 1 x 65536 causal at 16 heads, d 128: 4 * 65536 * 65537 / 2 * 128 * 16 = 17.59 TFLOP.
  EXPECT_NEAR(workload_by_name("1x65536").forward_flops(), 1.7593e13, 1e10);
}

}  // namespace
}  // namespace flamia
