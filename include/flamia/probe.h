// The causality contract probe (DESIGN §5). For a query at position i of document d, with dO fixed,
// O_i, LSE_i and dQ_i must be bitwise unchanged when
//   (a) K/V rows of d after i change  -- the positive controls below cross scale exponents and the
//       E4M3 subnormal boundary, so a leaky scale policy shows its leak;
//   (b) another document changes      -- a negative control;
//   (c) d moves to another offset in the packed buffer, aligned or not.
// dK and dV legitimately depend on later queries and are not probed.
//
// The runner is a parameter: the CPU emulator by default, or any implementation of the same
// contract (the GPU forward, which returns O and LSE only: dQ is then reported as not probed).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "flamia/emulator.h"
#include "flamia/inputs.h"

namespace flamia {

enum class ProbeControl {
  kSuffixRandom,   // K, V rows after the prefix redrawn
  kSuffixDouble,   // the first suffix row becomes 2x the prefix's largest row: one exponent step
  kSuffixSpike,    // the first suffix row scaled by 2^6: several exponent steps
  kOtherDocument,  // another document redrawn, with one row scaled by 2^6
  kMoveAligned,    // a 64-token document inserted before the target
  kMoveUnaligned,  // a 13-token document inserted before the target
};
constexpr ProbeControl kAllProbeControls[] = {
    ProbeControl::kSuffixRandom,  ProbeControl::kSuffixDouble, ProbeControl::kSuffixSpike,
    ProbeControl::kOtherDocument, ProbeControl::kMoveAligned,  ProbeControl::kMoveUnaligned};
const char* to_string(ProbeControl c);
bool is_suffix_control(ProbeControl c);

struct ProbeConfig {
  EmulatorConfig emulator;  // the default runner's recipe, policy, tiles; backward_pass stays on
  int target_doc = -1;      // -1: the longest document
  int prefix_end = -1;      // last prefix row (document-relative); -1: see default_prefix_end
  uint64_t perturbation_seed = 12345;
};

// Default last prefix row: 30 modulo 32 near the middle of the document, so the first suffix row
// closes a 32-token block (and a 16-key group) holding 31 (15) prefix rows: the whole residue a
// block policy can leak into.
int default_prefix_end(int doc_length);

// The probed document and last prefix row: `doc` < 0 picks the longest document, `prefix_end` < 0
// the default above. Throws Error when the document does not exist or has no prefix and suffix.
struct ProbeTarget {
  int doc = 0;
  int prefix_end = 0;
};
ProbeTarget resolve_probe_target(const PackedLayout& layout, int doc, int prefix_end);

struct ProbeOutcome {
  ProbeControl control;
  // max |changed - base| / max |base| over the probed rows (the prefix for suffix controls, the
  // whole document otherwise), all heads.
  double o_change = 0, lse_change = 0, dq_change = 0;
  bool o_exact = true, lse_exact = true;  // bitwise equal
  // dQ is probed only when the runner returns it; when not probed, dq_exact is false (never
  // claimed exact) and dq_change is NaN.
  bool dq_probed = true;
  bool dq_exact = true;
  int leak_reach = 0;  // suffix controls: first suffix row - earliest changed prefix row (0: none)

  // A change of any probed output.
  bool leaks() const { return !(o_exact && lse_exact && (!dq_probed || dq_exact)); }
};

// Computes the outputs of one batch: O ([T][Hq][D]) and LSE ([Hq][T]) always, dQ ([T][Hq][D]) or
// nothing (then dQ is not probed). Must be deterministic: the contract is bitwise.
using ProbeRunner = std::function<AttentionOutputs<float>(const AttentionBatch&)>;

// The default runner: emulate(batch, emulator).out.
ProbeRunner emulator_runner(const EmulatorConfig& emulator);

// Runs the base batch and each control through the emulator (config.emulator, which must keep the
// backward pass). Throws Error when the target document is too short to have a prefix and a suffix.
std::vector<ProbeOutcome> run_probe(const AttentionBatch& base, const ProbeConfig& config,
                                    const std::vector<ProbeControl>& controls);

// The same through `runner`; config.emulator is not used. Throws Error when the runner returns
// outputs of the wrong size, or dQ for one batch and not for another.
std::vector<ProbeOutcome> run_probe(const AttentionBatch& base, const ProbeConfig& config,
                                    const std::vector<ProbeControl>& controls,
                                    const ProbeRunner& runner);

}  // namespace flamia
