// Instantiations of the forward kernel for the mxfp8-qk16 recipe (BF16 score product).
#include "fwd_kernel.cuh"

namespace flamia::sm90::fwd {

template <>
void launch_forward<ScoreOperand::kBf16, true>(const Params& p, int ctas, cudaStream_t stream) {
  launch_forward_impl<ScoreOperand::kBf16, true>(p, ctas, stream);
}
template <>
void launch_forward<ScoreOperand::kBf16, false>(const Params& p, int ctas, cudaStream_t stream) {
  launch_forward_impl<ScoreOperand::kBf16, false>(p, ctas, stream);
}
template <>
size_t forward_smem_bytes<ScoreOperand::kBf16>() {
  return kSmemBytes<ScoreOperand::kBf16>;
}

}  // namespace flamia::sm90::fwd
