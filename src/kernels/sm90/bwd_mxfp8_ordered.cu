// Instantiations of the backward main kernel for the mxfp8 recipe (E4M3 score product),
// deterministic dQ.
#include "bwd_kernel.cuh"

namespace flamia::sm90::bwd {

template <>
void launch_backward<ScoreOperand::kE4m3, true, DqAddition::kOrdered>(const Params& p, int ctas,
                                                                      cudaStream_t stream) {
  launch_backward_impl<ScoreOperand::kE4m3, true, false, DqAddition::kOrdered>(p, ctas, stream);
}
template <>
void launch_backward<ScoreOperand::kE4m3, false, DqAddition::kOrdered>(const Params& p, int ctas,
                                                                       cudaStream_t stream) {
  launch_backward_impl<ScoreOperand::kE4m3, false, false, DqAddition::kOrdered>(p, ctas, stream);
}

}  // namespace flamia::sm90::bwd
