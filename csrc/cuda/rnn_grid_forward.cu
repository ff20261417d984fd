// The grid layout's forward kernels (rnn_grid_kernels.cuh), one translation unit per direction so that the
// build compiles them in parallel.
#include "rnn_grid_kernels.cuh"

namespace vlseq::rnn {

VLSEQ_RNN_GRID_TABLE(grid_forward_kernel, rnn_forward_grid_kernel)

}  // namespace vlseq::rnn
