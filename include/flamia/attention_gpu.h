// The GPU attention forward and backward (sm_90a, DESIGN §2, §4, §6): microscaled FP8 flash
// attention over packed documents, computing exactly the CPU emulator's algorithm
// (flamia/emulator.h) with the kernels' tile sizes (kGpuForwardTiles, kGpuBackwardTiles) and the
// hardware exp2.
//
// Each pass has two entry points: one takes the quantizer's device outputs (quantize_gpu with
// transposed codes), the other BF16 inputs and quantizes inside the call — together the training
// call: forward(BF16 Q, K, V) then backward(BF16 dO). All only enqueue work on the stream; nothing
// synchronises with the host.
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
constexpr TileShape kGpuForwardTiles{192, 128};
// The backward's: 64 query rows per step, 128 keys per work item (EmulatorConfig::backward).
constexpr TileShape kGpuBackwardTiles{64, 128};

// The backward's form. kFused: one main kernel for dK, dV and dQ, whose dQ partials an FP32
// accumulator sums by unordered atomics (cleared before, converted to BF16 after). kSplit: a dK/dV
// pass, then a query-stationary dQ pass that keeps dQ in registers and sums it in key-block order
// (bitwise reproducible, no accumulator). kAuto: the split where it is the faster form — layouts
// whose query tiles see few key blocks (causal documents of up to about 1K tokens with mxfp8, 512
// with mxfp8-qk16; backward_runs_split) — and whenever dQ must be deterministic; fused otherwise.
enum class BackwardForm { kAuto, kFused, kSplit };

struct GpuAttentionOptions {
  Recipe recipe = Recipe::kMxfp8;            // kMxfp8 or kMxfp8Qk16
  ScalePolicy policy = ScalePolicy::kToken;  // any but kVGroup16 (per-channel V cannot be folded)
  // Rotate Q, K along the head dim before quantizing (mxfp8 only); dQ and dK are rotated back.
  bool hadamard = false;
  AttentionConfig attention;
  BackwardForm backward_form = BackwardForm::kAuto;
  // Backward: dQ summed over the key blocks in ascending order instead of by unordered atomics, so
  // dQ is bitwise reproducible run to run (and a prefix's dQ bitwise independent of its suffix).
  // The backward runs split for it (BackwardForm::kFused is refused): about 1.05-1.15x the fused
  // backward's time where kAuto would take the fused kernel (docs/PERF.md items 227, 228).
  bool deterministic = false;
  // Backward: also gather DESIGN §4's statistics (dS zero fractions, row residuals, P^T
  // underflow) for backward_diagnostics(); slower, for `flamia accuracy`. The statistics build is
  // a fused kernel of its own, whatever backward_form says (with `deterministic` it adds dQ in
  // key-block order through turn counters).
  bool diagnostics = false;
};

// Whether the backward of `layout` under `options` runs split (BackwardForm). kAuto splits when
// the layout's backward steps (a 64-row query tile against a 128-key block) average at most a
// recipe's crossover per query tile: there the fused form's fixed costs per query tile (the
// accumulator's clear and its conversion to BF16) outweigh the split's two extra products a step
// (the crossovers measured in docs/PERF.md item 228).
bool backward_runs_split(const PackedLayout& layout, const GpuAttentionOptions& options);

// Throws Error when the GPU kernels do not implement the combination (recipe, policy, rotation,
// head dim), or when deterministic dQ is asked of the fused backward (BackwardForm::kFused).
void check_gpu_support(const PackedLayout& layout, const GpuAttentionOptions& options);

struct DeviceAttentionOutputs {
  TokenTensor<uint16_t> o;  // [T][Hq][D] BF16 bits; only rows inside documents are written
  float* lse = nullptr;     // [Hq][T] natural log; only tokens inside documents are written
};

struct DeviceAttentionGradients {
  TokenTensor<uint16_t> dq;      // [T][Hq][D] BF16 bits; every row inside a document is written
  TokenTensor<uint16_t> dk, dv;  // [T][Hkv][D]; GQA: summed over the group's query heads
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
  // spread across the masks). Once a backward has run on this object, the kernel also zeroes its
  // dQ accumulator for the next one.
  void forward(const DeviceAttentionInputs& in, const DeviceAttentionOutputs& out,
               cudaStream_t stream);

  // Backward from quantized operands (Q, K, V and dO, all with codes_t) and the forward's O (BF16)
  // and LSE. `in` as for forward. Throws Error (before enqueuing) on null or misaligned pointers
  // and on a layout other than the constructor's. The first call allocates the workspaces (an
  // FP32 dQ accumulator [T][Hq][D]; with Hadamard rotation also FP32 dK rows [T][Hkv][D]).
  void backward(const DeviceAttentionInputs& in, const DeviceQuantizedAttention& quant,
                TokenTensor<const uint16_t> o, const float* lse,
                const DeviceAttentionGradients& grads, cudaStream_t stream);

  // The training call's backward, after the BF16 forward on this object: quantizes in.dout alone
  // into the owned buffers and reuses the forward's Q, K, V codes (in.q and in.k are read too
  // for mxfp8-qk16). Non-finite dO is reported by quantizer_status().
  void backward(const DeviceAttentionInputs& in, TokenTensor<const uint16_t> o, const float* lse,
                const DeviceAttentionGradients& grads, cudaStream_t stream);

  // Synchronises and returns the statistics of the last backward (GpuAttentionOptions::
  // diagnostics): EmulatorStats' backward fields (ds_*, pt_underflow, row_residual); the rest 0.
  EmulatorStats backward_diagnostics() const;

  // The owned quantizer's outputs of the last BF16 forward (and backward: dO).
  const DeviceQuantizedAttention& quantized() const;
  // Synchronises and returns the non-finite report of the last BF16 call's quantization (the
  // forward's Q, K, V, or the backward's dO).
  NonFiniteReport quantizer_status() const;

  int work_items() const;  // forward (document, head, query tile) items per call
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

// For tests and tools: uploads `batch` (dout required), runs the training call (BF16 forward, then
// backward) on the current device and returns O, LSE, dQ, dK and dV in the emulator's layout
// (BF16 values as floats). Throws Error on non-finite inputs, like emulate(). Synchronises.
// With `diagnostics`, options.diagnostics is implied and the backward's statistics land there.
AttentionOutputs<float> training_gpu_to_host(const AttentionBatch& batch,
                                             const GpuAttentionOptions& options,
                                             EmulatorStats* diagnostics = nullptr);

// DESIGN §4's forward-backward consistency: of the visible S entries (every query head), those
// whose recomputation with the backward kernel's instruction shapes and operand roles has FP32
// bits other than the forward kernel's (target 0). Uploads and quantizes `batch`; synchronises.
struct ScoreConsistencyReport {
  int64_t entries = 0;
  int64_t differing = 0;
};
ScoreConsistencyReport score_consistency_to_host(const AttentionBatch& batch,
                                                 const GpuAttentionOptions& options);

}  // namespace flamia
