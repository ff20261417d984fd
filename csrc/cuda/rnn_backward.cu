// The backward kernels' instantiations, one translation unit per direction so that the build compiles
// them in parallel (rnn_kernels.cuh holds the code; rnn.cu launches them).
#include "rnn_kernels.cuh"

namespace vlseq::rnn {

VLSEQ_RNN_KERNEL_TABLE(backward_kernel, rnn_backward_kernel)

}  // namespace vlseq::rnn
