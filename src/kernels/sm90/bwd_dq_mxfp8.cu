// Instantiations of the split backward's dQ pass (dq_kernel.cuh): mxfp8's deterministic mode.
#include "dq_kernel.cuh"

namespace flamia::sm90::bwd::dqpass {

template <>
void launch_dq_pass<true>(const DqParams& p, int ctas, cudaStream_t stream) {
  launch_dq_pass_impl<true>(p, ctas, stream);
}
template <>
void launch_dq_pass<false>(const DqParams& p, int ctas, cudaStream_t stream) {
  launch_dq_pass_impl<false>(p, ctas, stream);
}

}  // namespace flamia::sm90::bwd::dqpass
