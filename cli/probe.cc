#include "probe.h"

#include <iostream>

#include "commands.h"
#include "flamia/device.h"

namespace flamia::cli {
namespace {

std::string change(double rel, bool exact) {
  return exact ? "0" : fmt_sci(rel);
}

ProbeControl parse_control(const std::string& name) {
  for (ProbeControl c : kAllProbeControls)
    if (name == to_string(c)) return c;
  throw Error("unknown probe control '" + name +
              "' (valid: suffix-random, suffix-double, suffix-spike, other-document, "
              "move-aligned, move-unaligned)");
}

}  // namespace

std::vector<ScalePolicy> resolve_policies(const Problem& problem, const ProbeRun& run) {
  if (!run.policies.empty()) return run.policies;
  std::vector<ScalePolicy> out;
  if (problem.backend == "cuda" && !built_with_cuda()) require_backend(problem, {});  // why not
  std::string why;
  for (ScalePolicy p : kAllScalePolicies) {
    std::string reason;
    if (problem.backend != "cuda" || gpu_supports(problem, {run.recipe, p, run.hadamard}, &reason))
      out.push_back(p);
    else if (why.empty() || p == ScalePolicy::kToken)
      why = reason;  // the default policy's reason names the obstacle best
  }
  if (out.empty())
    throw Error("--backend cuda runs recipe " + std::string(to_string(run.recipe)) +
                " with none of the policies: " + why);
  return out;
}

Table probe_table(const Problem& problem, const ProbeRun& run) {
  const bool gpu = problem.backend == "cuda";
  const std::vector<ScalePolicy> policies = resolve_policies(problem, run);
  std::vector<GpuVariant> variants;
  for (ScalePolicy p : policies) variants.push_back({run.recipe, p, run.hadamard});
  require_backend(problem, variants);
  const AttentionBatch batch = make_batch(problem);
  const PackedLayout layout = batch.layout();
  const ProbeTarget target = resolve_probe_target(layout, run.target_doc, run.prefix_end);
  const int doc = target.doc, p = target.prefix_end;
  const int L = layout.doc_length(doc);

  Table t;
  t.title =
      "causal-leakage probe (max |change| / max |value| over the probed rows; 0 = bitwise "
      "identical), recipe " +
      std::string(to_string(run.recipe)) + (run.hadamard ? " + Hadamard" : "") + ", " +
      describe(problem) + (gpu ? ", GPU training call (deterministic backward)" : "");
  t.columns = {"policy", "control", "dO", "dLSE", "ddQ", "reach", "verdict"};
  for (size_t k = 0; k < policies.size(); ++k) {
    const ScalePolicy policy = policies[k];
    ProbeConfig cfg;
    cfg.emulator.recipe = run.recipe;
    cfg.emulator.policy = policy;
    cfg.emulator.hadamard = run.hadamard;
    cfg.emulator.attention = problem.attention;
    cfg.emulator.forward = problem.forward;
    cfg.emulator.backward = problem.backward;
    cfg.target_doc = doc;
    cfg.prefix_end = p;
    GpuVariant variant = variants[k];
    variant.deterministic = true;  // the bitwise contract needs dQ summed in a fixed order
    const std::vector<ProbeOutcome> outcomes =
        gpu ? run_probe(batch, cfg, run.controls,
                        [&](const AttentionBatch& b) {
                          return gpu_training(b, problem, variant, nullptr);
                        })
            : run_probe(batch, cfg, run.controls);
    for (const ProbeOutcome& o : outcomes) {
      t.add_row({to_string(policy), to_string(o.control), change(o.o_change, o.o_exact),
                 change(o.lse_change, o.lse_exact),
                 o.dq_probed ? change(o.dq_change, o.dq_exact) : std::string("not probed"),
                 is_suffix_control(o.control) ? std::to_string(o.leak_reach) : "-",
                 o.leaks() ? "LEAK" : "none"});
    }
  }
  t.notes.push_back("probed: document " + std::to_string(doc) + " (" + std::to_string(L) +
                    " tokens); suffix controls change K/V rows " + std::to_string(p + 1) +
                    ".. and compare rows 0.." + std::to_string(p) +
                    "; other controls compare the whole document.");
  t.notes.push_back(
      "reach: first perturbed row minus the earliest changed prefix row "
      "(0 = no change; a block policy's residue is at most 31).");
  if (gpu)
    t.notes.push_back(
        "GPU: O, LSE and dQ of the training call probed bitwise, the backward in its "
        "deterministic mode (dQ summed in key-block order).");
  return t;
}

int cmd_probe(int argc, char** argv, int first) {
  std::vector<OptionSpec> specs = problem_options("300,77,650", 2, 64);
  specs.push_back({"policies", "",
                   "scale policies to probe: token, block32, tensor, floor, vgroup16 (default: "
                   "all five on cpu; on cuda, those the kernels implement: all but vgroup16)"});
  specs.push_back({"controls",
                   "suffix-random,suffix-double,suffix-spike,other-document,move-aligned,"
                   "move-unaligned",
                   "perturbations (DESIGN §5)"});
  specs.push_back({"recipe", "mxfp8",
                   "recipe: bf16, mxfp8, mxfp8-qk16, nvfp4-mixed (cuda: mxfp8, mxfp8-qk16)"});
  specs.push_back({"hadamard", "", "rotate Q and K along the head dim before quantizing", true});
  specs.push_back({"target-doc", "-1", "document probed (-1: the longest)"});
  specs.push_back(
      {"prefix-end", "-1", "last prefix row, document-relative (-1: 30 mod 32 near the middle)"});
  specs.push_back({"json", "", "print the table as JSON", true});
  Args args("probe",
            "Perturbs a document's suffix (crossing scale exponents and the E4M3 subnormal "
            "boundary), another document, and the document's offset, and reports whether the "
            "prefix's O, LSE and dQ change, per scale policy. The contract is bitwise: any "
            "change is a LEAK. --backend cuda probes the GPU training call (O, LSE, and dQ from "
            "the deterministic backward).",
            specs, argc, argv, first);
  if (args.help_requested()) {
    std::cout << args.usage();
    return 0;
  }
  const Problem problem = parse_problem(args);
  ProbeRun run;
  for (const std::string& s : args.strings("policies"))
    run.policies.push_back(parse_scale_policy(s));
  for (const std::string& s : args.strings("controls")) run.controls.push_back(parse_control(s));
  run.recipe = parse_recipe(args.str("recipe"));
  run.hadamard = args.flag("hadamard");
  run.target_doc = int(args.integer("target-doc"));
  run.prefix_end = int(args.integer("prefix-end"));
  const Table t = probe_table(problem, run);
  if (args.flag("json")) {
    print_json(std::cout, {t});
  } else {
    t.print_text(std::cout);
  }
  return 0;
}

}  // namespace flamia::cli
