#include "flamia/workloads.h"

#include <cmath>
#include <random>

#include "flamia/common.h"
#include "flamia/inputs.h"
#include "flamia/packed.h"

namespace flamia {
namespace {

constexpr uint64_t kLognormalSeed = 7, kTinySeed = 17;
constexpr double kLognormalMeanLog = 7.0, kLognormalSigma = 1.2;
constexpr int64_t kTinyMin = 17, kTinyMax = 496;

Workload equal(const std::string& name, int docs) {
  Workload w;
  w.name = name;
  w.docs.assign(docs, kWorkloadTokens / docs);
  return w;
}

// Draws lengths until they fill kWorkloadTokens; the last one is cut to fit.
template <typename Draw>
std::vector<int64_t> fill_tokens(Draw draw) {
  std::vector<int64_t> docs;
  int64_t total = 0;
  for (uint64_t i = 0; total < kWorkloadTokens; ++i) {
    const int64_t len = std::min<int64_t>(std::max<int64_t>(draw(i), 1), kWorkloadTokens - total);
    docs.push_back(len);
    total += len;
  }
  return docs;
}

}  // namespace

int64_t Workload::tokens() const {
  int64_t t = 0;
  for (int64_t d : docs) t += d;
  return t;
}

double Workload::visible_pairs() const {
  double p = 0;
  for (int64_t d : docs) p += flamia::visible_pairs(d, causal);
  return p;
}

std::vector<Workload> standard_workloads() {
  std::vector<Workload> w = {equal("16x4096", 16), equal("8x8192", 8), equal("4x16384", 4),
                             equal("2x32768", 2), equal("1x65536", 1)};
  Workload skew;
  skew.name = "8192+224x256";
  skew.docs.push_back(8192);
  skew.docs.insert(skew.docs.end(), 224, 256);
  w.push_back(skew);

  Workload lognormal;
  lognormal.name = "lognormal";
  lognormal.docs = fill_tokens([](uint64_t i) {
    return int64_t(std::llround(
        std::exp(kLognormalMeanLog + kLognormalSigma * normal_deviate(kLognormalSeed, 0, i))));
  });
  w.push_back(lognormal);

  Workload tiny;
  tiny.name = "tiny-unaligned";
  std::mt19937_64 rng(kTinySeed);
  std::uniform_int_distribution<int64_t> len(kTinyMin, kTinyMax);
  tiny.docs = fill_tokens([&](uint64_t) { return len(rng); });
  w.push_back(tiny);

  Workload gqa = equal("4x16384-gqa", 4);
  gqa.heads_kv = 4;
  w.push_back(gqa);
  return w;
}

Workload workload_by_name(const std::string& name) {
  std::string names;
  for (const Workload& w : standard_workloads()) {
    if (w.name == name) return w;
    names += (names.empty() ? "" : ", ") + w.name;
  }
  throw Error("unknown workload '" + name + "' (valid: " + names + ")");
}

}  // namespace flamia
