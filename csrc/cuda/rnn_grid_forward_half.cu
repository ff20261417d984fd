// The grid layout's forward with W_hh in 16 bits (rnn_grid_tf32_kernels.cuh), in its own translation
// unit so that the build compiles it beside the others.
#include "rnn_grid_tf32_kernels.cuh"

namespace vlseq::rnn {

VLSEQ_RNN_GRID_HALF_FWD_TABLE(grid_forward_half_kernel, rnn_forward_grid_half_kernel)

}  // namespace vlseq::rnn
