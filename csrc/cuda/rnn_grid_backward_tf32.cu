// The grid layout's TF32 backward (rnn_grid_tf32_kernels.cuh), in its own translation unit so that the
// build compiles it beside the others.
#include "rnn_grid_tf32_kernels.cuh"

namespace vlseq::rnn {

VLSEQ_RNN_GRID_TF32_BWD_TABLE(grid_backward_tf32_kernel, rnn_backward_grid_tf32_kernel)

}  // namespace vlseq::rnn
