// Instantiations of the backward main kernel for the mxfp8-qk16 recipe (score product recomputed on
// the BF16 inputs).
#include "bwd_kernel.cuh"

namespace flamia::sm90::bwd {

template <>
void launch_backward<ScoreOperand::kBf16, true, DqAddition::kBulk>(const Params& p, int ctas,
                                                                   cudaStream_t stream) {
  launch_backward_impl<ScoreOperand::kBf16, true, false, DqAddition::kBulk>(p, ctas, stream);
}
template <>
void launch_backward<ScoreOperand::kBf16, false, DqAddition::kBulk>(const Params& p, int ctas,
                                                                    cudaStream_t stream) {
  launch_backward_impl<ScoreOperand::kBf16, false, false, DqAddition::kBulk>(p, ctas, stream);
}

}  // namespace flamia::sm90::bwd
