// A probe of DESIGN §4's "S recomputed from the same codes": does the backward kernel's
// recomputation of the score product reproduce the forward's FP32 bits?
//
// The forward (mainloop_fwd.cuh, issue_score_product) computes S[64 queries][128 keys] = Q K^T per
// consumer warpgroup as one m64n128 wgmma per k step, Q as A; the backward (mainloop_bwd.cuh,
// issue_score_products) computes S^T[64 keys][64 queries] = K Q^T, keys as A, one m64n64 product
// per k step and warpgroup. The probe runs both on the real operands with the kernels' instruction
// shapes, operand roles and k-step order, for every (64-query tile, 128-key block) pair of every
// document with a visible entry and every query head, and counts the visible entries (query i and
// key j inside the document, j <= i when causal) whose two FP32 results differ in any bit.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "flamia/attention.h"
#include "flamia/quantize_gpu.h"

namespace flamia::sm90 {

struct ScoreConsistency {
  int64_t entries = 0;    // visible (query head, query, key) entries compared
  int64_t differing = 0;  // of which the two orientations' FP32 bits differ
};

// Fault injection, for tests of the probe itself: a replacement of Q that only the backward
// orientation reads (the forward keeps the regular Q), so a perturbed copy must surface as
// differing entries. Set the member of the recipe, laid out like the operand it replaces: `codes`
// for mxfp8 (E4M3 [T][Hq][D], like DeviceE4M3Operand::codes), `bf16` for mxfp8-qk16 (a view like
// DeviceAttentionInputs::q).
struct BackwardQueryOverride {
  const uint8_t* codes = nullptr;
  TokenTensor<const uint16_t> bf16;
};

// Counts on `stream`, then synchronises it. `layout` holds the host cu_seqlens (the grid of pairs
// is built from them), `device_cu_seqlens` the same offsets in device memory. The operands: for
// mxfp8, quant.q.codes and quant.k.codes; for mxfp8-qk16, the BF16 views in.q and in.k (strides
// multiples of 16 bytes); nothing else of `in` or `quant` is read. GQA: query head h reads key head
// h / layout.group(). Throws flamia::Error before enqueuing anything on an invalid layout, a head
// dim other than 128, a recipe other than mxfp8 / mxfp8-qk16, or a null or misaligned pointer.
ScoreConsistency score_consistency_gpu(const PackedLayout& layout, const int32_t* device_cu_seqlens,
                                       Recipe recipe, bool causal, const DeviceAttentionInputs& in,
                                       const DeviceQuantizedAttention& quant, cudaStream_t stream,
                                       const BackwardQueryOverride* backward_q = nullptr);

}  // namespace flamia::sm90
