// Timing of enqueued GPU work for the benchmarks: warm-up, then one CUDA event pair per rep, no
// host synchronisation between reps, medians.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <string>

namespace flamia::bench {

struct Timing {
  double median_ms = 0, min_ms = 0, max_ms = 0;
  bool graph = false;  // replayed from a captured CUDA graph
};

// `enqueue(rep)` enqueues one call on `stream`; rep selects the input set. With `use_graphs`, the
// call of each of `sets` input sets is captured once into a CUDA graph and replayed, which removes
// launch gaps between the call's kernels; if capture fails the calls run directly. The warm-up is
// `warmup` calls, then more until `warmup_ms` of GPU time have passed: at its power cap the GPU's
// clock falls as the chip heats, so a stage timed right after idle time or a lighter stage reads
// faster than it runs sustained (docs/PERF.md, item 93).
Timing time_reps(const std::function<void(int rep)>& enqueue, cudaStream_t stream, int warmup,
                 int reps, int sets = 1, bool use_graphs = false, double warmup_ms = 0);

// The benches' default warm-up time: after a host-side pause the H200's board power climbs back
// to its cap over ~0.5-1 s of load, at boost clock meanwhile; stages timed after 500 ms read
// within 1-3 % of those after 2000 (docs/PERF.md, item 93).
constexpr double kSustainedWarmupMs = 500;

}  // namespace flamia::bench
