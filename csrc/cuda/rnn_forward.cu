// The forward kernels' instantiations, one translation unit per direction so that the build compiles
// them in parallel (rnn_kernels.cuh holds the code; rnn.cu launches them).
#include "rnn_kernels.cuh"

namespace vlseq::rnn {

using bf16 = __nv_bfloat16;

const void* forward_kernel(Cell c, Weights w, int bt) {
#define VLSEQ_FWD(C, WT)                                  \
  switch (bt) {                                           \
    case 1: return (const void*)rnn_forward_kernel<C, 1, WT>; \
    case 2: return (const void*)rnn_forward_kernel<C, 2, WT>; \
    case 4: return (const void*)rnn_forward_kernel<C, 4, WT>; \
    default: return (const void*)rnn_forward_kernel<C, 8, WT>; \
  }
  if (c == Cell::kLSTM) {
    if (w == Weights::kFP32) { VLSEQ_FWD(Cell::kLSTM, float) } else { VLSEQ_FWD(Cell::kLSTM, bf16) }
  } else {
    if (w == Weights::kFP32) { VLSEQ_FWD(Cell::kGRU, float) } else { VLSEQ_FWD(Cell::kGRU, bf16) }
  }
#undef VLSEQ_FWD
}

}  // namespace vlseq::rnn
