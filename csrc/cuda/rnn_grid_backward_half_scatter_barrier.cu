// The grid layout's backward with W_hh and the gate gradients in 16 bits by reduce-scatter, a barrier a step (up
// to 16 samples a group; rnn_grid_tf32_kernels.cuh), in its own translation unit so that the build compiles it
// beside the others.
#include "rnn_grid_tf32_kernels.cuh"

namespace vlseq::rnn {

VLSEQ_RNN_GRID_HALF_BWD_TABLE(grid_backward_half_scatter_barrier_kernel, rnn_backward_grid_half_scatter_barrier_kernel)

}  // namespace vlseq::rnn
