// Host interface of the tile-code passes (tile_codes.cu), launched by quantize_gpu after the fused
// quantizer has written V's codes_t, K's codes and their exponents, on layouts whose quantizer
// tiles are not the key tiles (on the others the quantizer writes the tile codes itself).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace flamia::sm90::quant {

// One operand's pass: `codes` are K's codes [T][H][D] or V's codes_t [H][D][Tt], `tiles` the
// array of the same shape that receives the tile codes.
struct TileCodesArgs {
  const uint8_t* codes = nullptr;
  const uint8_t* exponents = nullptr;  // [H][Tp]
  uint8_t* tiles = nullptr;
  const int32_t* cu_seqlens = nullptr;
  int num_docs = 0, heads = 0, dim = 0;
  int64_t tokens = 0, tokens_padded = 0, tokens_t = 0;
};

void launch_key_tile_codes(const TileCodesArgs& args, cudaStream_t stream);    // K's codes_tiles
void launch_value_tile_codes(const TileCodesArgs& args, cudaStream_t stream);  // V's codes_t_tiles

}  // namespace flamia::sm90::quant
