// The GPU attention forward (sm_90a, DESIGN §2, §4, §6): microscaled FP8 flash attention over
// packed documents, computing exactly the CPU emulator's algorithm (flamia/emulator.h) with the
// kernel's tile sizes (kGpuForwardTiles) and the hardware exp2.
//
// Two entry points: one takes the quantizer's device outputs (quantize_gpu with transposed codes),
// the other BF16 inputs and quantizes inside the call. Both only enqueue work on the stream; the
// work list is built on the GPU by every call, so nothing synchronises with the host.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "flamia/attention.h"
#include "flamia/emulator.h"
#include "flamia/inputs.h"
#include "flamia/quantize.h"
#include "flamia/quantize_gpu.h"

namespace flamia {

// The forward kernel's query and key tiles; the emulator reproduces the kernel's numerics when run
// with these (EmulatorConfig::forward).
constexpr TileShape kGpuForwardTiles{128, 128};

struct GpuAttentionOptions {
  Recipe recipe = Recipe::kMxfp8;            // kMxfp8 or kMxfp8Qk16
  ScalePolicy policy = ScalePolicy::kToken;  // any but kVGroup16 (per-channel V cannot be folded)
  bool hadamard = false;                     // rotate Q, K before quantizing (mxfp8 only)
  AttentionConfig attention;
};

// Throws Error when the GPU kernels do not implement the combination (recipe, policy, head dim).
void check_gpu_support(const PackedLayout& layout, const GpuAttentionOptions& options);

struct DeviceAttentionOutputs {
  TokenTensor<uint16_t> o;  // [T][Hq][D] BF16 bits; only rows inside documents are written
  float* lse = nullptr;     // [Hq][T] natural log; only tokens inside documents are written
};

// Reusable state of forward calls on one layout: the work list, its counter and (for the BF16
// entry) the quantizer's buffers. The constructor reads the host cu_seqlens once (sizes only) and
// allocates; calls may run on any stream, one at a time.
class GpuAttention {
 public:
  GpuAttention(const PackedLayout& layout, const GpuAttentionOptions& options);
  ~GpuAttention();
  GpuAttention(const GpuAttention&) = delete;
  GpuAttention& operator=(const GpuAttention&) = delete;

  // Forward from quantized operands (Q, K, V with codes_t). `in` supplies the device cu_seqlens
  // and, for mxfp8-qk16, the BF16 Q and K the score product reads; in.layout must equal the
  // constructor's. Throws Error (before enqueuing) on null or misaligned pointers.
  void forward(const DeviceAttentionInputs& in, const DeviceQuantizedAttention& quant,
               const DeviceAttentionOutputs& out, cudaStream_t stream) const;

  // Forward from BF16 inputs (Q, K, V non-null; dO ignored): quantizes into owned buffers, then
  // runs the kernel. Non-finite inputs are reported by quantizer_status() (they are zeroed, never
  // spread across the masks).
  void forward(const DeviceAttentionInputs& in, const DeviceAttentionOutputs& out,
               cudaStream_t stream);

  // The owned quantizer's outputs of the last BF16 forward.
  const DeviceQuantizedAttention& quantized() const;
  // Synchronises and returns the non-finite report of the last BF16 forward.
  NonFiniteReport quantizer_status() const;

  int work_items() const;  // (document, head, query tile) items per call
  int ctas() const;        // persistent CTAs launched

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// For tests and tools: uploads `batch`, runs the BF16 forward on the current device and returns
// O (BF16 values as floats) and LSE in the emulator's layout. Throws Error on non-finite inputs
// (naming tensor and position), like emulate(). Synchronises.
AttentionOutputs<float> forward_gpu_to_host(const AttentionBatch& batch,
                                            const GpuAttentionOptions& options);

}  // namespace flamia
