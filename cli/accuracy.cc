#include "accuracy.h"

#include <chrono>
#include <cmath>
#include <iostream>

#include "commands.h"
#include "flamia/device.h"
#include "flamia/metrics.h"
#include "flamia/reference.h"

namespace flamia::cli {
namespace {

const char* kNotBuilt = "\u2014";  // an em dash: a statistic the GPU does not gather

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string tiles(const TileShape& t) {
  return std::to_string(t.block_m) + "x" + std::to_string(t.block_n);
}

// max |got - ref| over the LSE of rows with visible keys (what AccuracyReport::lse_max_err is).
template <typename T>
double lse_max_err(const std::vector<float>& got, const std::vector<T>& ref) {
  double err = 0;
  for (size_t i = 0; i < ref.size(); ++i)
    if (std::isfinite(double(ref[i]))) err = std::max(err, std::fabs(double(got[i]) - ref[i]));
  return err;
}

}  // namespace

std::vector<Recipe> resolve_recipes(const Problem& problem, const AccuracyRun& run) {
  if (!run.recipes.empty()) return run.recipes;
  std::vector<Recipe> out;
  if (problem.backend == "cuda" && !built_with_cuda()) require_backend(problem, {});  // why not
  std::string why;
  for (Recipe r : kAllRecipes) {
    std::string reason;
    if (problem.backend != "cuda" || gpu_supports(problem, {r, run.policy, run.hadamard}, &reason))
      out.push_back(r);
    else if (why.empty() || r == Recipe::kMxfp8)
      why = reason;  // the default recipe's reason names the obstacle best
  }
  if (out.empty())
    throw Error("--backend cuda runs none of the recipes with policy " +
                std::string(to_string(run.policy)) + ": " + why);
  return out;
}

std::vector<Table> accuracy_tables(const Problem& problem, const AccuracyRun& run) {
  const bool gpu = problem.backend == "cuda";
  const std::vector<Recipe> recipes = resolve_recipes(problem, run);
  std::vector<GpuVariant> variants;
  for (Recipe r : recipes) variants.push_back({r, run.policy, run.hadamard});
  require_backend(problem, variants);
  const TileShape forward_tiles = gpu ? gpu_forward_tiles() : problem.forward;
  const TileShape backward_tiles = gpu ? gpu_backward_tiles() : problem.backward;
  const std::string emu_label =
      " [emulator " + tiles(forward_tiles) + "/" + tiles(backward_tiles) + "]";

  const AttentionBatch batch = make_batch(problem);
  auto t0 = std::chrono::steady_clock::now();
  const AttentionOutputs<double> ref = reference_attention(batch, problem.attention);
  const double ref_seconds = seconds_since(t0);

  Table acc, diag, vs;
  acc.title = "accuracy vs FP64 (cosine / relative L2), " + describe(problem) + ", policy " +
              to_string(run.policy) + (run.hadamard ? ", Hadamard-rotated Q/K" : "");
  acc.columns = {"recipe", "cos O",  "cos dQ", "cos dK",  "cos dV", "rL2 O",
                 "rL2 dQ", "rL2 dK", "rL2 dV", "LSE err", "time s"};
  diag.title =
      "diagnostics (fractions of nonzero entries rounded to zero; row residual "
      "|sum_j dS| / sum_j |dS|)";
  diag.columns = {"recipe",    "P~->0", "dS->0 dQ", "dS->0 dK", "resid p50", "resid p99",
                  "resid max", "Q->0",  "K->0",     "V->0",     "dO->0",     "max P~"};
  vs.title = "GPU vs the emulator with the kernels' tiles (" + tiles(forward_tiles) + ", " +
             tiles(backward_tiles) + "): the kernels compute the emulator's algorithm";
  vs.columns = {"recipe",    "cos O",   "rL2 O",    "max |dO|", "O equal",  "max |dLSE|",
                "emu rL2 O", "ratio O", "ratio dQ", "ratio dK", "ratio dV", "S differ"};
  for (size_t k = 0; k < recipes.size(); ++k) {
    const Recipe r = recipes[k];
    AttentionOutputs<float> gpu_out;
    EmulatorStats gpu_stats;
    if (gpu) {
      t0 = std::chrono::steady_clock::now();
      gpu_out = gpu_training(batch, problem, variants[k], &gpu_stats);
      const double secs = seconds_since(t0);
      const std::string label = std::string(to_string(r)) + " [cuda]";
      EmulatorResult as_result;
      as_result.out = gpu_out;
      as_result.stats = gpu_stats;
      const AccuracyReport a = accuracy_report(as_result, ref);
      acc.add_row({label, fmt(a.o.cosine, 5), fmt(a.dq.cosine, 5), fmt(a.dk.cosine, 5),
                   fmt(a.dv.cosine, 5), fmt_sci(a.o.rel_l2), fmt_sci(a.dq.rel_l2),
                   fmt_sci(a.dk.rel_l2), fmt_sci(a.dv.rel_l2), fmt_sci(a.lse_max_err),
                   fmt(secs, 2)});
      diag.add_row({label, kNotBuilt, fmt_sci(a.ds_zero_fraction_dq),
                    fmt_sci(a.ds_zero_fraction_dk), fmt_sci(a.residual_p50),
                    fmt_sci(a.residual_p99), fmt_sci(a.residual_max), kNotBuilt, kNotBuilt,
                    kNotBuilt, kNotBuilt, kNotBuilt});
    }
    EmulatorConfig cfg;
    cfg.recipe = r;
    cfg.policy = run.policy;
    cfg.hadamard = run.hadamard;
    cfg.attention = problem.attention;
    cfg.forward = forward_tiles;
    cfg.backward = backward_tiles;
    t0 = std::chrono::steady_clock::now();
    const EmulatorResult res = emulate(batch, cfg);
    const double secs = seconds_since(t0);
    const AccuracyReport a = accuracy_report(res, ref);
    const std::string label = std::string(to_string(r)) + (gpu ? emu_label : "");
    acc.add_row({label, fmt(a.o.cosine, 5), fmt(a.dq.cosine, 5), fmt(a.dk.cosine, 5),
                 fmt(a.dv.cosine, 5), fmt_sci(a.o.rel_l2), fmt_sci(a.dq.rel_l2),
                 fmt_sci(a.dk.rel_l2), fmt_sci(a.dv.rel_l2), fmt_sci(a.lse_max_err), fmt(secs, 2)});
    const bool fp8 = r != Recipe::kBf16;
    auto frac = [&](double x) { return fp8 ? fmt_sci(x) : std::string("-"); };
    diag.add_row({label, frac(a.p_underflow_fraction), frac(a.ds_zero_fraction_dq),
                  frac(a.ds_zero_fraction_dk), fmt_sci(a.residual_p50), fmt_sci(a.residual_p99),
                  fmt_sci(a.residual_max), frac(a.operand_underflow_fraction[0]),
                  frac(a.operand_underflow_fraction[1]), frac(a.operand_underflow_fraction[2]),
                  frac(a.operand_underflow_fraction[3]), fmt(res.stats.p_max, 1)});
    if (gpu) {
      const std::vector<double> emu_o(res.out.o.begin(), res.out.o.end());
      const Similarity d = compare(gpu_out.o, emu_o);
      size_t equal = 0;
      for (size_t i = 0; i < emu_o.size(); ++i) equal += gpu_out.o[i] == res.out.o[i];
      // GPU-vs-emulator rel L2 as a fraction of the emulator's own error against FP64.
      auto ratio = [&](const std::vector<float>& g, const std::vector<float>& e,
                       const Similarity& own) {
        const double diff = compare(g, std::vector<double>(e.begin(), e.end())).rel_l2;
        return fmt(own.rel_l2 > 0 ? diff / own.rel_l2 : 0.0, 3);
      };
      vs.add_row({to_string(r), fmt(d.cosine, 6), fmt_sci(d.rel_l2), fmt_sci(d.max_abs_err),
                  fmt(emu_o.empty() ? 1.0 : double(equal) / double(emu_o.size()), 4),
                  fmt_sci(lse_max_err(gpu_out.lse, res.out.lse)), fmt_sci(a.o.rel_l2),
                  ratio(gpu_out.o, res.out.o, a.o), ratio(gpu_out.dq, res.out.dq, a.dq),
                  ratio(gpu_out.dk, res.out.dk, a.dk), ratio(gpu_out.dv, res.out.dv, a.dv),
                  fmt_sci(gpu_score_mismatch(batch, problem, variants[k]))});
    }
  }
  acc.notes.push_back("FP64 reference: " + fmt(ref_seconds, 2) + " s; backend " + problem.backend +
                      ", tiles fwd " + tiles(forward_tiles) + ", bwd " + tiles(backward_tiles));
  if (gpu) {
    acc.notes.push_back(
        "[cuda]: the GPU training call, forward then backward (time: upload, quantize, "
        "attention, statistics, download; the first also starts CUDA). [emulator]: the CPU "
        "emulator with the kernels' tiles.");
    if (problem.tiles_given && (problem.forward.block_m != forward_tiles.block_m ||
                                problem.forward.block_n != forward_tiles.block_n ||
                                problem.backward.block_m != backward_tiles.block_m ||
                                problem.backward.block_n != backward_tiles.block_n))
      acc.notes.push_back(
          "--fwd-tile/--bwd-tile ignored: the emulator uses the kernels' tiles "
          "to match them");
    diag.notes.push_back(
        "[cuda] rows: counted by the backward kernel itself (GpuAttentionOptions::diagnostics); "
        "the GPU forward and the quantizer report no underflow statistics (" +
        std::string(kNotBuilt) + ")");
    vs.notes.push_back(
        "O equal: fraction of O elements equal in BF16. ratio X: rL2(X_gpu - X_emu) / "
        "rL2(X_emu - X_fp64), the GPU-vs-emulator difference as a fraction of the algorithm's "
        "own error. They differ only by ex2.approx, summation orders and the tensor cores' "
        "accumulator, which flips the E4M3 rounding of a few P~ and dS~; "
        "tests/gpu/test_gpu_attention_fwd.cu and test_gpu_attention_bwd.cu bound them. S differ: "
        "fraction of the visible scores whose backward recomputation (its wgmma shapes and "
        "operand roles, on the same codes) differs bitwise from the forward's (target 0).");
    return {acc, diag, vs};
  }
  return {acc, diag};
}

int cmd_accuracy(int argc, char** argv, int first) {
  std::vector<OptionSpec> specs = problem_options("4096,4096,4096,4096", 16, 128);
  specs.push_back({"recipes", "",
                   "recipes: bf16, mxfp8, mxfp8-qk16, nvfp4-mixed (default: all four on cpu; "
                   "on cuda, those the kernels implement: mxfp8, mxfp8-qk16)"});
  specs.push_back(
      {"policy", "token", "scale policy: token, block32, tensor, floor, vgroup16 (cpu only)"});
  specs.push_back({"hadamard", "", "rotate Q and K along the head dim before quantizing", true});
  specs.push_back({"json", "", "print the tables as JSON", true});
  Args args("accuracy",
            "Runs each recipe through the CPU emulator of the microscaled algorithm and compares "
            "O, dQ, dK, dV and LSE with an FP64 reference on the same BF16 inputs. With "
            "--backend cuda, each recipe's GPU training call (forward and backward) is compared "
            "too, with FP64 and with the emulator run with the "
            "kernels' tiles, and the backward kernel's own statistics and the forward/backward "
            "score consistency are printed.",
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
