// The grid layout's backward kernels (rnn_grid_kernels.cuh), one translation unit per direction so that the
// build compiles them in parallel.
#include "rnn_grid_kernels.cuh"

namespace vlseq::rnn {

const void* grid_backward_kernel(Cell c, Weights w, int bt) {
  const bool lstm = c == Cell::kLSTM, fp32 = w == Weights::kFP32;
  if (lstm && fp32) VLSEQ_RNN_GRID_SWITCH(rnn_backward_grid_kernel, Cell::kLSTM, float)
  if (fp32) VLSEQ_RNN_GRID_SWITCH(rnn_backward_grid_kernel, Cell::kGRU, float)
  if (lstm) VLSEQ_RNN_GRID_SWITCH(rnn_backward_grid_kernel, Cell::kLSTM, __nv_bfloat16)
  VLSEQ_RNN_GRID_SWITCH(rnn_backward_grid_kernel, Cell::kGRU, __nv_bfloat16)
}

}  // namespace vlseq::rnn
