#include "accuracy.h"

#include <chrono>
#include <iostream>

#include "commands.h"
#include "flamia/metrics.h"
#include "flamia/reference.h"

namespace flamia::cli {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

std::vector<Table> accuracy_tables(const Problem& problem, const AccuracyRun& run) {
  require_backend(problem);
  const AttentionBatch batch = make_batch(problem);
  auto t0 = std::chrono::steady_clock::now();
  const AttentionOutputs<double> ref = reference_attention(batch, problem.attention);
  const double ref_seconds = seconds_since(t0);

  Table acc, diag;
  acc.title = "accuracy vs FP64 (cosine / relative L2), " + describe(problem) + ", policy " +
              to_string(run.policy) + (run.hadamard ? ", Hadamard-rotated Q/K" : "");
  acc.columns = {"recipe", "cos O",  "cos dQ", "cos dK",  "cos dV", "rL2 O",
                 "rL2 dQ", "rL2 dK", "rL2 dV", "LSE err", "time s"};
  diag.title =
      "diagnostics (fractions of nonzero entries rounded to zero; row residual "
      "|sum_j dS| / sum_j |dS|)";
  diag.columns = {"recipe",    "P~->0", "dS->0 dQ", "dS->0 dK", "resid p50", "resid p99",
                  "resid max", "Q->0",  "K->0",     "V->0",     "dO->0",     "max P~"};
  for (Recipe r : run.recipes) {
    EmulatorConfig cfg;
    cfg.recipe = r;
    cfg.policy = run.policy;
    cfg.hadamard = run.hadamard;
    cfg.attention = problem.attention;
    cfg.forward = problem.forward;
    cfg.backward = problem.backward;
    t0 = std::chrono::steady_clock::now();
    const EmulatorResult res = emulate(batch, cfg);
    const double secs = seconds_since(t0);
    const AccuracyReport a = accuracy_report(res, ref);
    acc.add_row({to_string(r), fmt(a.o.cosine, 5), fmt(a.dq.cosine, 5), fmt(a.dk.cosine, 5),
                 fmt(a.dv.cosine, 5), fmt_sci(a.o.rel_l2), fmt_sci(a.dq.rel_l2),
                 fmt_sci(a.dk.rel_l2), fmt_sci(a.dv.rel_l2), fmt_sci(a.lse_max_err), fmt(secs, 2)});
    const bool fp8 = r != Recipe::kBf16;
    auto frac = [&](double x) { return fp8 ? fmt_sci(x) : std::string("-"); };
    diag.add_row({to_string(r), frac(a.p_underflow_fraction), frac(a.ds_zero_fraction_dq),
                  frac(a.ds_zero_fraction_dk), fmt_sci(a.residual_p50), fmt_sci(a.residual_p99),
                  fmt_sci(a.residual_max), frac(a.operand_underflow_fraction[0]),
                  frac(a.operand_underflow_fraction[1]), frac(a.operand_underflow_fraction[2]),
                  frac(a.operand_underflow_fraction[3]), fmt(res.stats.p_max, 1)});
  }
  acc.notes.push_back("FP64 reference: " + fmt(ref_seconds, 2) + " s; backend " + problem.backend +
                      ", tiles fwd " + std::to_string(problem.forward.block_m) + "x" +
                      std::to_string(problem.forward.block_n) + ", bwd " +
                      std::to_string(problem.backward.block_m) + "x" +
                      std::to_string(problem.backward.block_n));
  return {acc, diag};
}

int cmd_accuracy(int argc, char** argv, int first) {
  std::vector<OptionSpec> specs = problem_options("4096,4096,4096,4096", 16, 128);
  specs.push_back({"recipes", "bf16,mxfp8,mxfp8-qk16,nvfp4-mixed",
                   "recipes to emulate: bf16, mxfp8, mxfp8-qk16, nvfp4-mixed"});
  specs.push_back({"policy", "token", "scale policy: token, block32, tensor, floor, vgroup16"});
  specs.push_back({"hadamard", "", "rotate Q and K along the head dim before quantizing", true});
  specs.push_back({"json", "", "print the tables as JSON", true});
  Args args("accuracy",
            "Runs each recipe through the CPU emulator of the microscaled algorithm and compares "
            "O, dQ, dK, dV and LSE with an FP64 reference on the same BF16 inputs.",
            specs, argc, argv, first);
  if (args.help_requested()) {
    std::cout << args.usage();
    return 0;
  }
  const Problem problem = parse_problem(args);
  AccuracyRun run;
  for (const std::string& r : args.strings("recipes")) run.recipes.push_back(parse_recipe(r));
  run.policy = parse_scale_policy(args.str("policy"));
  run.hadamard = args.flag("hadamard");
  const std::vector<Table> tables = accuracy_tables(problem, run);
  if (args.flag("json")) {
    print_json(std::cout, tables);
  } else {
    for (const Table& t : tables) {
      t.print_text(std::cout);
      std::cout << "\n";
    }
  }
  return 0;
}

}  // namespace flamia::cli
