// Owning device outputs of the GPU quantizer, shaped exactly like quantize_cpu's result, for host
// code that runs it: quantize_gpu_to_host, the GPU tests, `flamia bench quantize`.
#pragma once

#include <cstdint>
#include <vector>

#include "device_buffer.h"
#include "flamia/quantize_gpu.h"

namespace flamia::cuda {

class QuantizeOutputs {
 public:
  // Arrays for the operands and options quantize_gpu writes (dO only when `backward`).
  QuantizeOutputs(const PackedLayout& layout, const QuantizeOptions& options, bool backward);

  const DeviceQuantizedAttention& view() const { return view_; }
  void fill(uint8_t byte) const;        // every array, the status included (to poison them)
  int64_t array_bytes() const;          // bytes of every output array, the status excluded
  QuantizedAttention download() const;  // synchronous
  NonFiniteReport non_finite() const;   // the status alone, synchronous

 private:
  struct E4M3 {
    QuantLayout layout;
    DeviceBuffer codes, codes_t, exponents, channel_exponents, codes_t_tiles, codes_tiles;
  };
  struct Nvfp4 {
    QuantLayout layout;
    DeviceBuffer packed, local_scales, exponents;
  };
  static E4M3 make_e4m3(const QuantLayout& l, bool codes, bool transposed, bool channel,
                        bool tiles_t, bool tiles);
  static Nvfp4 make_nvfp4(const QuantLayout& l);
  std::vector<const DeviceBuffer*> arrays() const;

  bool backward_ = false, nvfp4_ = false;
  E4M3 q_, k_, v_, dout_;
  Nvfp4 q4_, k4_;
  DeviceBuffer status_;
  DeviceQuantizedAttention view_;
};

}  // namespace flamia::cuda
