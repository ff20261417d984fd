// The grid layout's forward with W_hh in registers (rnn_grid_kernels.cuh), in its own translation unit so
// that the build compiles it beside the others.
#include "rnn_grid_kernels.cuh"

namespace vlseq::rnn {

VLSEQ_RNN_GRID_FWD_REGS_TABLE(grid_forward_regs_kernel, rnn_forward_grid_regs_kernel)

}  // namespace vlseq::rnn
