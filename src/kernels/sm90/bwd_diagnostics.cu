// Instantiations of the backward main kernel's statistics build (GpuAttentionOptions::diagnostics)
// for both recipes: slower, used by `flamia accuracy`, kept apart from the fast kernels.
#include "bwd_kernel.cuh"

namespace flamia::sm90::bwd {

template <>
void launch_backward_diagnostics<ScoreOperand::kE4m3, true>(const Params& p, int ctas,
                                                            cudaStream_t stream) {
  launch_backward_impl<ScoreOperand::kE4m3, true, true, DqAddition::kByParams>(p, ctas, stream);
}
template <>
void launch_backward_diagnostics<ScoreOperand::kE4m3, false>(const Params& p, int ctas,
                                                             cudaStream_t stream) {
  launch_backward_impl<ScoreOperand::kE4m3, false, true, DqAddition::kByParams>(p, ctas, stream);
}
template <>
void launch_backward_diagnostics<ScoreOperand::kBf16, true>(const Params& p, int ctas,
                                                            cudaStream_t stream) {
  launch_backward_impl<ScoreOperand::kBf16, true, true, DqAddition::kByParams>(p, ctas, stream);
}
template <>
void launch_backward_diagnostics<ScoreOperand::kBf16, false>(const Params& p, int ctas,
                                                             cudaStream_t stream) {
  launch_backward_impl<ScoreOperand::kBf16, false, true, DqAddition::kByParams>(p, ctas, stream);
}

}  // namespace flamia::sm90::bwd
