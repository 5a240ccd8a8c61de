// The per-tensor FP8 preparation a cuDNN FP8 peer needs before each call: an amax pass (fresh
// scales) and the BF16 -> E4M3 cast with scale 448 / amax. Part of the peer's timed call.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace flamia::bench {

// *amax = max |src[i]| over n BF16 values (zeroes *amax first).
void amax_bf16(const uint16_t* src, int64_t n, float* amax, cudaStream_t stream);

// dst = E4M3(src * 448 / *amax) row by row; row r of src (row_elems values) goes to row
// dst_row[r] of dst (identity when dst_row is null: packed to packed). Writes *descale =
// *amax / 448 for cuDNN.
void cast_bf16_to_e4m3(const uint16_t* src, int64_t rows, int64_t row_elems, const int64_t* dst_row,
                       uint8_t* dst, const float* amax, float* descale, cudaStream_t stream);

}  // namespace flamia::bench
