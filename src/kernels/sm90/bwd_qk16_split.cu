// Instantiations of the backward main kernel for the mxfp8-qk16 recipe (score product recomputed on
// the BF16 inputs) without dQ: the split backward's dK/dV pass (mxfp8-qk16's deterministic mode;
// dQ: bwd_dq_qk16.cu).
#include "bwd_kernel.cuh"

namespace flamia::sm90::bwd {

template <>
void launch_backward<ScoreOperand::kBf16, true, DqAddition::kNone>(const Params& p, int ctas,
                                                                   cudaStream_t stream) {
  launch_backward_impl<ScoreOperand::kBf16, true, false, DqAddition::kNone>(p, ctas, stream);
}
template <>
void launch_backward<ScoreOperand::kBf16, false, DqAddition::kNone>(const Params& p, int ctas,
                                                                    cudaStream_t stream) {
  launch_backward_impl<ScoreOperand::kBf16, false, false, DqAddition::kNone>(p, ctas, stream);
}

}  // namespace flamia::sm90::bwd
