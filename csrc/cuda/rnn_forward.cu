// The forward kernels' instantiations, one translation unit per direction so that the build compiles
// them in parallel (rnn_kernels.cuh and rnn_fused_kernels.cuh hold the code; rnn.cu launches them).
#include "rnn_fused_kernels.cuh"

namespace vlseq::rnn {

VLSEQ_RNN_KERNEL_TABLE(forward_kernel, rnn_forward_kernel, rnn_forward_fused_kernel)

}  // namespace vlseq::rnn
