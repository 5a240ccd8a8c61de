// Instantiations of the backward main kernel for the mxfp8 recipe (E4M3 score product) without
// dQ: the split backward's dK/dV pass (mxfp8's deterministic mode; dQ: bwd_dq_mxfp8.cu).
#include "bwd_kernel.cuh"

namespace flamia::sm90::bwd {

template <>
void launch_backward<ScoreOperand::kE4m3, true, DqAddition::kNone>(const Params& p, int ctas,
                                                                   cudaStream_t stream) {
  launch_backward_impl<ScoreOperand::kE4m3, true, false, DqAddition::kNone>(p, ctas, stream);
}
template <>
void launch_backward<ScoreOperand::kE4m3, false, DqAddition::kNone>(const Params& p, int ctas,
                                                                    cudaStream_t stream) {
  launch_backward_impl<ScoreOperand::kE4m3, false, false, DqAddition::kNone>(p, ctas, stream);
}

}  // namespace flamia::sm90::bwd
