// The reduce-scatter fused backward's instantiations, in a translation unit of their own so that the
// build compiles them beside the other kernels (rnn_scatter_kernel.cuh holds the code).
#include "rnn_scatter_kernel.cuh"

namespace vlseq::rnn {

VLSEQ_RNN_SCATTER_TABLE(backward_scatter_kernel)

}  // namespace vlseq::rnn
