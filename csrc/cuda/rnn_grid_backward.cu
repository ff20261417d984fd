// The grid layout's backward kernels (rnn_grid_kernels.cuh), one translation unit per direction so that the
// build compiles them in parallel.
#include "rnn_grid_kernels.cuh"

namespace vlseq::rnn {

VLSEQ_RNN_GRID_TABLE(grid_backward_kernel, rnn_backward_grid_kernel)

}  // namespace vlseq::rnn
