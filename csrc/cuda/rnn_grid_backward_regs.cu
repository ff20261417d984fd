// The grid layout's backward with W_hh^T in registers (rnn_grid_kernels.cuh), in its own translation unit so
// that the build compiles it beside the others.
#include "rnn_grid_kernels.cuh"

namespace vlseq::rnn {

VLSEQ_RNN_GRID_REGS_TABLE(grid_backward_regs_kernel, rnn_backward_grid_regs_kernel)

}  // namespace vlseq::rnn
