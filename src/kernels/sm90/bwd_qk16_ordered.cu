// Instantiations of the backward main kernel for the mxfp8-qk16 recipe (score product recomputed on
// the BF16 inputs), deterministic dQ.
#include "bwd_kernel.cuh"

namespace flamia::sm90::bwd {

template <>
void launch_backward<ScoreOperand::kBf16, true, DqAddition::kOrdered>(const Params& p, int ctas,
                                                                      cudaStream_t stream) {
  launch_backward_impl<ScoreOperand::kBf16, true, false, DqAddition::kOrdered>(p, ctas, stream);
}
template <>
void launch_backward<ScoreOperand::kBf16, false, DqAddition::kOrdered>(const Params& p, int ctas,
                                                                       cudaStream_t stream) {
  launch_backward_impl<ScoreOperand::kBf16, false, false, DqAddition::kOrdered>(p, ctas, stream);
}

}  // namespace flamia::sm90::bwd
