// What the recurrent ops' host code and their CUDA kernels share, without torch's tensor headers
// (the kernels' translation units compile faster without them; the ops: vlseq/rnn.h).
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

namespace vlseq::rnn {

enum class Cell { kLSTM, kGRU };
// The precision of W_hh in the recurrent products; state and accumulation are fp32 either way.
enum class Weights { kFP32, kBF16 };

inline int num_gates(Cell c) { return c == Cell::kLSTM ? 4 : 3; }

// Lengths are read on the device, so they cannot be checked without a host sync: every kernel
// clamps them to [0, T] (vlseq_ext.nn checks lengths that are on the CPU).
C10_HOST_DEVICE inline int64_t clamp_length(int64_t len, int64_t T) { return len < 0 ? 0 : (len > T ? T : len); }

}  // namespace vlseq::rnn
