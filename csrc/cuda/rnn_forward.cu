// The forward kernels' instantiations, one translation unit per direction so that the build compiles
// them in parallel (rnn_kernels.cuh holds the code; rnn.cu launches them).
#include "rnn_kernels.cuh"

namespace vlseq::rnn {

VLSEQ_RNN_KERNEL_TABLE(forward_kernel, rnn_forward_kernel)

}  // namespace vlseq::rnn
