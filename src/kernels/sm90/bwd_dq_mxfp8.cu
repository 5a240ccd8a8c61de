// Instantiations of the split backward's dQ pass (dq_kernel.cuh) for mxfp8's deterministic mode.
#include "dq_kernel.cuh"

namespace flamia::sm90::bwd::dqpass {

template <>
void launch_dq_pass<ScoreOperand::kE4m3, true>(const DqParams& p, int ctas, cudaStream_t stream) {
  launch_dq_pass_impl<ScoreOperand::kE4m3, true>(p, ctas, stream);
}
template <>
void launch_dq_pass<ScoreOperand::kE4m3, false>(const DqParams& p, int ctas, cudaStream_t stream) {
  launch_dq_pass_impl<ScoreOperand::kE4m3, false>(p, ctas, stream);
}

}  // namespace flamia::sm90::bwd::dqpass
