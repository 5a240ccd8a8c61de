#include "timing.h"

#include <algorithm>
#include <vector>

#include "check.h"

namespace flamia::bench {
namespace {

// Captures one call per set; returns no graphs (and leaves the stream usable) if capture fails.
std::vector<cudaGraphExec_t> capture(const std::function<void(int)>& enqueue, cudaStream_t stream,
                                     int sets) {
  std::vector<cudaGraphExec_t> execs;
  for (int s = 0; s < sets; ++s) {
    cudaGraph_t graph = nullptr;
    bool ok = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
    if (ok) {
      try {
        enqueue(s);
      } catch (const std::exception&) {
        ok = false;
      }
      ok = cudaStreamEndCapture(stream, &graph) == cudaSuccess && ok;
    }
    cudaGraphExec_t exec = nullptr;
    ok = ok && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (!ok) {
      cudaGetLastError();  // capture errors are not sticky; clear them
      for (cudaGraphExec_t e : execs) cudaGraphExecDestroy(e);
      return {};
    }
    execs.push_back(exec);
  }
  return execs;
}

}  // namespace

Timing time_reps(const std::function<void(int)>& enqueue, cudaStream_t stream, int warmup, int reps,
                 int sets, bool use_graphs, double warmup_ms) {
  std::vector<cudaGraphExec_t> graphs;
  if (use_graphs) graphs = capture(enqueue, stream, sets);
  auto run = [&](int rep) {
    if (graphs.empty()) {
      enqueue(rep % sets);
    } else {
      FLAMIA_CUDA_CHECK(cudaGraphLaunch(graphs[size_t(rep % sets)], stream));
    }
  };
  int rep = 0;
  for (; rep < warmup; ++rep) run(rep);
  if (warmup_ms > 0) {
    // One call at a time, each waited for (a host round trip of idle GPU per call is nothing
    // against the chip's heat), until the elapsed GPU time reaches warmup_ms.
    cudaEvent_t begin, end;
    FLAMIA_CUDA_CHECK(cudaEventCreate(&begin));
    FLAMIA_CUDA_CHECK(cudaEventCreate(&end));
    FLAMIA_CUDA_CHECK(cudaEventRecord(begin, stream));
    for (float elapsed = 0; elapsed < warmup_ms; ++rep) {
      run(rep);
      FLAMIA_CUDA_CHECK(cudaEventRecord(end, stream));
      FLAMIA_CUDA_CHECK(cudaEventSynchronize(end));
      FLAMIA_CUDA_CHECK(cudaEventElapsedTime(&elapsed, begin, end));
    }
    FLAMIA_CUDA_CHECK(cudaEventDestroy(begin));
    FLAMIA_CUDA_CHECK(cudaEventDestroy(end));
  }
  std::vector<cudaEvent_t> start(reps), stop(reps);
  for (int i = 0; i < reps; ++i) {
    FLAMIA_CUDA_CHECK(cudaEventCreate(&start[i]));
    FLAMIA_CUDA_CHECK(cudaEventCreate(&stop[i]));
  }
  for (int i = 0; i < reps; ++i) {
    FLAMIA_CUDA_CHECK(cudaEventRecord(start[i], stream));
    run(rep + i);
    FLAMIA_CUDA_CHECK(cudaEventRecord(stop[i], stream));
  }
  FLAMIA_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> ms(reps);
  for (int i = 0; i < reps; ++i) {
    FLAMIA_CUDA_CHECK(cudaEventElapsedTime(&ms[i], start[i], stop[i]));
    FLAMIA_CUDA_CHECK(cudaEventDestroy(start[i]));
    FLAMIA_CUDA_CHECK(cudaEventDestroy(stop[i]));
  }
  for (cudaGraphExec_t e : graphs) FLAMIA_CUDA_CHECK(cudaGraphExecDestroy(e));
  std::sort(ms.begin(), ms.end());
  Timing t;
  t.median_ms =
      reps % 2 ? ms[size_t(reps / 2)] : 0.5 * (ms[size_t(reps / 2 - 1)] + ms[size_t(reps / 2)]);
  t.min_ms = ms.front();
  t.max_ms = ms.back();
  t.graph = !graphs.empty();
  return t;
}

}  // namespace flamia::bench
