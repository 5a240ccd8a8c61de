// Instantiations of the forward kernel for the mxfp8 recipe (E4M3 score product).
#include "fwd_kernel.cuh"

namespace flamia::sm90::fwd {

template <>
void launch_forward<ScoreOperand::kE4m3, true>(const Params& p, int ctas, cudaStream_t stream) {
  launch_forward_impl<ScoreOperand::kE4m3, true>(p, ctas, stream);
}
template <>
void launch_forward<ScoreOperand::kE4m3, false>(const Params& p, int ctas, cudaStream_t stream) {
  launch_forward_impl<ScoreOperand::kE4m3, false>(p, ctas, stream);
}
template <>
size_t forward_smem_bytes<ScoreOperand::kE4m3>() {
  return kSmemBytes<ScoreOperand::kE4m3>;
}

}  // namespace flamia::sm90::fwd
