// The fused GPU quantizer (DESIGN §3, §6): writes exactly the bytes of quantize_cpu (the oracle in
// flamia/quantize.h, whose header comment defines every layout below) into device buffers.
//
// One launch quantizes the present operands of Q, K, V and dO (those whose input pointer is
// non-null: the forward passes Q, K and V, the training call's backward dO alone) under any scale
// policy, with the optional Hadamard rotation and NVFP4 Q/K; the `tensor` policy adds one launch
// before it for the tensor maxima (of the present operands only). Its tiles are packed or cut from
// each document's start (QuantizerTiling, quantize_gpu_tiling; the document tiling adds a small
// launch that lists the tiles). K's and V's tile codes come from that launch where its tiles are
// the documents' key tiles (quantize_gpu_fuses_tile_codes), else from one launch each after it
// (they re-read the codes it wrote). quantize_gpu validates on the host, then only enqueues work
// on `stream`: it never synchronises with the host.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "flamia/quantize.h"

namespace flamia {

// Device views of E4M3Operand's arrays (T tokens, H heads, head dim D, Tp = QuantLayout's padded
// token count). Every pointer is device memory aligned to kDeviceAlignment.
struct DeviceE4M3Operand {
  uint8_t* codes = nullptr;              // [T][H][D]
  uint8_t* codes_t = nullptr;            // [H][D][Tt]: QuantLayout::tokens_t positions, documents
                                         // 16-aligned and permuted (quantize.h); needed when
                                         // QuantizeOptions::transposed
  uint8_t* exponents = nullptr;          // [H][Tp]
  uint8_t* channel_exponents = nullptr;  // [T][H][D]; needed for V under vgroup16 only
  uint8_t* codes_t_tiles = nullptr;      // [H][D][Tt]; needed for V where writes_codes_t_tiles
  uint8_t* codes_tiles = nullptr;        // [T][H][D]; needed for K where writes_codes_tiles
};

// Device views of Nvfp4Operand's arrays; needed when QuantizeOptions::nvfp4_qk.
struct DeviceNvfp4Operand {
  uint8_t* packed = nullptr;        // [T][H][D/2]
  uint8_t* local_scales = nullptr;  // [T][H][D/16]
  uint8_t* exponents = nullptr;     // [H][Tp]
};

struct DeviceQuantizedAttention {
  // A skipped operand's arrays (and q4's without Q, k4's without K) may be null; if not, they are
  // left untouched, not even zeroed.
  DeviceE4M3Operand q, k, v, dout;
  DeviceNvfp4Operand q4, k4;
  // [kNumOperands], Q, K, V, dO order: NonFiniteReport::first_index (flat index of the first
  // non-finite input element, -1 if none, -1 for a skipped operand). Reset by every call, then
  // filled by the kernel.
  int64_t* non_finite_first = nullptr;
};

struct DeviceAttentionInputs {
  PackedLayout layout;                  // layout.cu_seqlens is host memory (validated on the host)
  const int32_t* cu_seqlens = nullptr;  // the same num_docs + 1 offsets in device memory
  // Device BF16 bits; an operand whose data is null is skipped (at least one must be present).
  TokenTensor<const uint16_t> q, k, v, dout;
};

// Inputs over dense [T][H][D] device buffers (a null buffer: that operand is skipped).
inline DeviceAttentionInputs dense_device_inputs(const PackedLayout& layout,
                                                 const int32_t* cu_seqlens, const uint16_t* q,
                                                 const uint16_t* k, const uint16_t* v,
                                                 const uint16_t* dout = nullptr) {
  DeviceAttentionInputs in;
  in.layout = layout;
  in.cu_seqlens = cu_seqlens;
  in.q = dense_view(q, layout.heads_q, layout.head_dim);
  in.k = dense_view(k, layout.heads_kv, layout.head_dim);
  in.v = dense_view(v, layout.heads_kv, layout.head_dim);
  in.dout = dense_view(dout, layout.heads_q, layout.head_dim);
  return in;
}

// Alignment of every device pointer (16-byte vector accesses); input token and head strides must
// be multiples of kDeviceAlignment bytes too. cudaMalloc's allocations satisfy it.
constexpr int kDeviceAlignment = 16;

// Quantizes the present operands, writing exactly what quantize_cpu writes for them; a skipped
// operand's outputs are neither read, checked nor written. Throws flamia::Error (layout, the
// present operands' views, null or misaligned pointers, no operand present) before enqueuing
// anything.
void quantize_gpu(const DeviceAttentionInputs& in, const QuantizeOptions& options,
                  const DeviceQuantizedAttention& out, cudaStream_t stream);

// The tiling quantize_gpu takes on `layout` (kPacked or kDocument). kAuto takes the packed tiles
// where every document starts at a multiple of kKeyTileTokens (none empty before a non-empty one):
// there they are the document tiles already. Elsewhere it takes the document tiles unless they
// would be more than 3/2 as many as the packed ones (documents too short to fill them).
QuantizerTiling quantize_gpu_tiling(const PackedLayout& layout, const QuantizeOptions& options);

// Whether quantize_gpu's fused launch writes the tile codes itself on `layout`: head dim 128, and
// tiles that are the documents' key tiles (the document tiling, or the packed one where it
// coincides). Otherwise two more launches make them from the codes.
bool quantize_gpu_fuses_tile_codes(const PackedLayout& layout, const QuantizeOptions& options);

// For tests and tools: uploads host inputs (any valid strides), quantizes on the current device,
// and returns the result in quantize_cpu's form (non_finite filled; skipped operands empty).
// Synchronises.
QuantizedAttention quantize_gpu_to_host(const AttentionInputs& host_inputs,
                                        const QuantizeOptions& options);

}  // namespace flamia
