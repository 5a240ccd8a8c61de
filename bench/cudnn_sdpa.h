// cuDNN fused attention (SDPA) through the cuDNN frontend: the benchmark's peers. cuDNN is loaded
// at run time (dlopen of libcudnn.so.9), so flamia starts and runs its own jobs without it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace flamia::bench {

// Opens libcudnn.so.9 once. Returns "" when usable, else why not (missing library, no handle).
std::string cudnn_status();
std::string cudnn_version();

enum class CudnnPrecision { kBf16, kFp8 };
enum class CudnnLayout {
  kRagged,  // packed [tokens][heads][dim] with ragged offsets (THD)
  kPadded,  // [docs][max_len][heads][dim] with sequence lengths
};
const char* to_string(CudnnLayout l);

struct SdpaProblem {
  std::vector<int64_t> docs;
  int heads_q = 0, heads_kv = 0, dim = 0;
  bool causal = true;
  float softmax_scale = 0.0f;

  int64_t tokens() const;
  int64_t max_len() const;
  // Rows a tensor needs in `layout`: tokens (ragged) or docs x max_len (padded).
  int64_t rows(CudnnLayout layout) const;
};

// Device buffers. q/k/v/o/dout/dq/dk/dv hold BF16 or E4M3 in the layout's shape; stats are FP32
// [docs][heads_q][max_len]. seq_len: int32 [docs]; ragged_*: int64 [docs + 1] element offsets.
// FP8 only: the per-tensor scale and descale scalars and the amax outputs, FP32 each.
struct SdpaBuffers {
  void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr, *dout = nullptr;
  void *dq = nullptr, *dk = nullptr, *dv = nullptr;
  float* stats = nullptr;
  int32_t* seq_len = nullptr;
  int64_t *ragged_q = nullptr, *ragged_kv = nullptr;
  float* descale_q = nullptr;  // 1 / scale_q, and so on
  float *descale_k = nullptr, *descale_v = nullptr, *descale_o = nullptr, *descale_do = nullptr;
  float *descale_s = nullptr, *scale_s = nullptr, *descale_dp = nullptr, *scale_dp = nullptr;
  float *scale_o = nullptr, *scale_dq = nullptr, *scale_dk = nullptr, *scale_dv = nullptr;
  float* amax = nullptr;  // [6]: S, O (forward); dQ, dK, dV, dP (backward)
};

// The forward and backward graphs of one problem, built once (outside any timed region).
class CudnnSdpa {
 public:
  // Returns null and sets *reason (cuDNN's message) when cuDNN refuses the configuration.
  static std::unique_ptr<CudnnSdpa> build(const SdpaProblem& p, CudnnPrecision precision,
                                          CudnnLayout layout, cudaStream_t stream,
                                          std::string* reason);
  ~CudnnSdpa();
  CudnnSdpa(const CudnnSdpa&) = delete;
  CudnnSdpa& operator=(const CudnnSdpa&) = delete;

  CudnnLayout layout() const;
  size_t workspace_bytes() const;
  // Enqueue on the stream given to build(); throw flamia::Error with cuDNN's message on failure.
  void forward(const SdpaBuffers& b, void* workspace) const;
  void backward(const SdpaBuffers& b, void* workspace) const;

 private:
  struct Impl;
  explicit CudnnSdpa(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace flamia::bench
