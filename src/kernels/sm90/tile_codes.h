// Host interface of the tile-code passes (tile_codes.cu), launched by quantize_gpu after the fused
// quantizer has written V's codes_t, K's codes and their exponents.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace flamia::sm90::quant {

struct TileCodesArgs {
  const uint8_t* codes_t = nullptr;    // [H][D][Tt]
  const uint8_t* exponents = nullptr;  // [H][Tp]
  uint8_t* tiles = nullptr;            // [H][D][Tt]: codes_t_tiles
  const int32_t* cu_seqlens = nullptr;
  int num_docs = 0, heads = 0, dim = 0;
  int64_t tokens_padded = 0, tokens_t = 0;
};

void launch_tile_codes(const TileCodesArgs& args, cudaStream_t stream);

// K's codes_tiles from its codes ([T][H][D]) and exponents.
struct KeyTileCodesArgs {
  const uint8_t* codes = nullptr;      // [T][H][D]
  const uint8_t* exponents = nullptr;  // [H][Tp]
  uint8_t* tiles = nullptr;            // [T][H][D]: codes_tiles
  const int32_t* cu_seqlens = nullptr;
  int num_docs = 0, heads = 0, dim = 0;
  int64_t tokens = 0, tokens_padded = 0;
};

void launch_key_tile_codes(const KeyTileCodesArgs& args, cudaStream_t stream);

}  // namespace flamia::sm90::quant
