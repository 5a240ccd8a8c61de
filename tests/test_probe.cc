// The causality contract (DESIGN §5) on the emulator: the token policy is bitwise isolated for
// every control; the baselines leak on their positive controls; block32 leaks only within its
// 31-token residue.
#include <gtest/gtest.h>

#include <cmath>

#include "flamia/probe.h"

namespace flamia {
namespace {

// Documents at unaligned offsets, GQA 4/2; the probed (longest) document starts at token 377.
AttentionBatch probe_batch() {
  return generate_batch({300, 77, 650}, 4, 2, 64, InputSpec{});
}

std::vector<ProbeControl> all_controls() {
  return {std::begin(kAllProbeControls), std::end(kAllProbeControls)};
}

ProbeConfig config(ScalePolicy p, Recipe r = Recipe::kMxfp8, bool hadamard = false) {
  ProbeConfig c;
  c.emulator.policy = p;
  c.emulator.recipe = r;
  c.emulator.hadamard = hadamard;
  c.emulator.forward = {64, 64};
  c.emulator.backward = {64, 64};
  return c;
}

class TokenPolicyProbe : public ::testing::TestWithParam<std::tuple<Recipe, bool>> {};

TEST_P(TokenPolicyProbe, PrefixIsBitwiseUnchangedByEveryControl) {
  const auto [recipe, hadamard] = GetParam();
  for (const ProbeOutcome& o :
       run_probe(probe_batch(), config(ScalePolicy::kToken, recipe, hadamard), all_controls())) {
    EXPECT_TRUE(o.o_exact) << to_string(o.control) << " changed O by " << o.o_change;
    EXPECT_TRUE(o.lse_exact) << to_string(o.control) << " changed LSE by " << o.lse_change;
    EXPECT_TRUE(o.dq_exact) << to_string(o.control) << " changed dQ by " << o.dq_change;
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, TokenPolicyProbe,
                         ::testing::Values(std::make_tuple(Recipe::kMxfp8, false),
                                           std::make_tuple(Recipe::kMxfp8, true),
                                           std::make_tuple(Recipe::kMxfp8Qk16, false),
                                           std::make_tuple(Recipe::kNvfp4Mixed, false)));

ProbeOutcome outcome(const std::vector<ProbeOutcome>& all, ProbeControl c) {
  for (const ProbeOutcome& o : all)
    if (o.control == c) return o;
  ADD_FAILURE() << "control missing";
  return {};
}

TEST(Probe, Block32LeaksOnlyWithinItsResidue) {
  const auto out = run_probe(probe_batch(), config(ScalePolicy::kBlock32), all_controls());
  const ProbeOutcome spike = outcome(out, ProbeControl::kSuffixSpike);
  EXPECT_TRUE(spike.leaks());
  for (const ProbeOutcome& o : out) {
    EXPECT_LE(o.leak_reach, kBlockTokens - 1) << to_string(o.control);
    if (!is_suffix_control(o.control)) EXPECT_FALSE(o.leaks()) << to_string(o.control);
  }
}

TEST(Probe, BaselinesLeakOnTheirPositiveControls) {
  const AttentionBatch batch = probe_batch();
  const auto tensor = run_probe(batch, config(ScalePolicy::kTensor), all_controls());
  EXPECT_TRUE(outcome(tensor, ProbeControl::kSuffixSpike).leaks());
  EXPECT_TRUE(outcome(tensor, ProbeControl::kOtherDocument).leaks());  // even across documents
  EXPECT_GT(outcome(tensor, ProbeControl::kSuffixSpike).leak_reach, kBlockTokens);

  const auto floor = run_probe(batch, config(ScalePolicy::kFloor), all_controls());
  EXPECT_TRUE(outcome(floor, ProbeControl::kSuffixSpike).leaks());

  const auto vgroup = run_probe(batch, config(ScalePolicy::kVGroup16), all_controls());
  const ProbeOutcome v = outcome(vgroup, ProbeControl::kSuffixSpike);
  EXPECT_TRUE(v.leaks());
  EXPECT_TRUE(v.lse_exact);  // V's scales reach O and dQ, never the scores
  EXPECT_LE(v.leak_reach, kVGroupTokens - 1);
}

// The runner is a parameter (the GPU forward plugs in here): the emulator passed as a runner gives
// the default's outcomes; a runner without dQ (the GPU forward's shape) reports dQ as not probed,
// never as exact, and still finds block32's leak through O and LSE; malformed outputs throw.
TEST(Probe, RunnerIsAParameter) {
  const AttentionBatch batch = probe_batch();
  const ProbeConfig block = config(ScalePolicy::kBlock32);
  const auto direct = run_probe(batch, block, all_controls());
  const auto through = run_probe(batch, block, all_controls(), emulator_runner(block.emulator));
  ASSERT_EQ(direct.size(), through.size());
  for (size_t i = 0; i < direct.size(); ++i) {
    const ProbeOutcome &a = direct[i], &b = through[i];
    EXPECT_EQ(a.control, b.control);
    EXPECT_EQ(a.o_change, b.o_change) << to_string(a.control);
    EXPECT_EQ(a.lse_change, b.lse_change) << to_string(a.control);
    EXPECT_EQ(a.dq_change, b.dq_change) << to_string(a.control);
    EXPECT_EQ(a.leaks(), b.leaks()) << to_string(a.control);
    EXPECT_EQ(a.leak_reach, b.leak_reach) << to_string(a.control);
    EXPECT_TRUE(b.dq_probed);
  }

  // Forward only: O and LSE probed, dQ not.
  ProbeConfig token = config(ScalePolicy::kToken);
  EmulatorConfig forward_only = token.emulator;
  forward_only.backward_pass = false;
  for (const ProbeOutcome& o :
       run_probe(batch, token, all_controls(), emulator_runner(forward_only))) {
    EXPECT_FALSE(o.dq_probed) << to_string(o.control);
    EXPECT_FALSE(o.dq_exact) << to_string(o.control) << ": an unprobed dQ is never exact";
    EXPECT_TRUE(std::isnan(o.dq_change)) << to_string(o.control);
    EXPECT_TRUE(o.o_exact && o.lse_exact) << to_string(o.control);
    EXPECT_FALSE(o.leaks()) << to_string(o.control);
  }
  forward_only.policy = ScalePolicy::kBlock32;
  const auto fwd_block = run_probe(batch, block, all_controls(), emulator_runner(forward_only));
  const ProbeOutcome spike = outcome(fwd_block, ProbeControl::kSuffixSpike);
  EXPECT_TRUE(spike.leaks());
  EXPECT_GT(spike.leak_reach, 0);
  EXPECT_LE(spike.leak_reach, kBlockTokens - 1);

  // The default runner needs dQ; a runner's outputs must have the batch's shapes, and dQ for
  // every batch or for none.
  token.emulator.backward_pass = false;
  EXPECT_THROW(run_probe(batch, token, all_controls()), Error);
  const ProbeRunner truncated = [&](const AttentionBatch& b) {
    AttentionOutputs<float> out = emulate(b, forward_only).out;
    out.lse.pop_back();
    return out;
  };
  EXPECT_THROW(run_probe(batch, block, all_controls(), truncated), Error);
  int calls = 0;
  const ProbeRunner inconsistent = [&](const AttentionBatch& b) {
    AttentionOutputs<float> out = emulate(b, block.emulator).out;
    if (calls++ > 0) out.dq.clear();
    return out;
  };
  EXPECT_THROW(run_probe(batch, block, all_controls(), inconsistent), Error);
}

TEST(Probe, RejectsDocumentsTooShortToProbe) {
  const AttentionBatch batch = generate_batch({1, 5}, 1, 1, 64, InputSpec{});
  ProbeConfig c = config(ScalePolicy::kToken);
  c.target_doc = 0;
  EXPECT_THROW(run_probe(batch, c, all_controls()), Error);
  c.target_doc = 1;
  c.prefix_end = 4;
  EXPECT_THROW(run_probe(batch, c, all_controls()), Error);
}

}  // namespace
}  // namespace flamia
