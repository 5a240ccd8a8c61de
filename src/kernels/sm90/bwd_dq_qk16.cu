// Instantiations of the split backward's dQ pass (dq_kernel.cuh) for mxfp8-qk16's deterministic
// mode.
#include "dq_kernel.cuh"

namespace flamia::sm90::bwd::dqpass {

template <>
void launch_dq_pass<ScoreOperand::kBf16, true>(const DqParams& p, int ctas, cudaStream_t stream) {
  launch_dq_pass_impl<ScoreOperand::kBf16, true>(p, ctas, stream);
}
template <>
void launch_dq_pass<ScoreOperand::kBf16, false>(const DqParams& p, int ctas, cudaStream_t stream) {
  launch_dq_pass_impl<ScoreOperand::kBf16, false>(p, ctas, stream);
}

}  // namespace flamia::sm90::bwd::dqpass
