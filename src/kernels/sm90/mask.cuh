// Masks of the forward's key tiles. Only a work item's first tiles (processed first: the two the
// causal diagonal of its 192 rows crosses, or the tile holding the document's end) are masked;
// every other tile is fully visible to every row and runs code without any mask (MaskKind::kNone).
#pragma once

#include "fwd_params.h"

namespace flamia::sm90::fwd {

enum class MaskKind {
  kNone,    // every key visible to every row
  kCausal,  // key j visible to row i iff j <= i (document-relative)
  kLength,  // non-causal: key j visible iff j < L
};

// The last visible key column of the tile (tile-relative), for a row `row` of the work item's
// query tile; keys 0..last are visible. The tile starts `diagonal` = m0 - n0 keys before the
// item's first row and holds `keys_left` = L - n0 keys of the document.
template <MaskKind kMask>
__device__ __forceinline__ int last_visible_key(int row, int diagonal, int keys_left) {
  static_assert(kMask != MaskKind::kNone, "unmasked tiles have no last visible key");
  if constexpr (kMask == MaskKind::kCausal) {
    return min(row + diagonal, kBlockN - 1);
  } else {
    return min(keys_left, kBlockN) - 1;
  }
}

}  // namespace flamia::sm90::fwd
