// Instantiations of the backward main kernel for the mxfp8 recipe with Hadamard-rotated Q and K
// (dK out as FP32 rows for the pass that rotates it back) without dQ: the split backward's dK/dV
// pass (the deterministic mode; dQ: bwd_dq_mxfp8.cu, rotated back there).
#include "bwd_kernel.cuh"

namespace flamia::sm90::bwd {

template <>
void launch_backward_rotated<true, DqAddition::kNone>(const Params& p, int ctas,
                                                      cudaStream_t stream) {
  launch_backward_impl<ScoreOperand::kE4m3, true, false, DqAddition::kNone, true>(p, ctas, stream);
}
template <>
void launch_backward_rotated<false, DqAddition::kNone>(const Params& p, int ctas,
                                                       cudaStream_t stream) {
  launch_backward_impl<ScoreOperand::kE4m3, false, false, DqAddition::kNone, true>(p, ctas, stream);
}

}  // namespace flamia::sm90::bwd
