// The backward kernels' instantiations, one translation unit per direction so that the build compiles
// them in parallel (rnn_kernels.cuh and rnn_fused_kernels.cuh hold the code; rnn.cu launches them).
#include "rnn_fused_kernels.cuh"

namespace vlseq::rnn {

VLSEQ_RNN_KERNEL_TABLE(backward_kernel, rnn_backward_kernel, rnn_backward_fused_kernel)

}  // namespace vlseq::rnn
