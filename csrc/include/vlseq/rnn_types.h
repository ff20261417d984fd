// What the recurrent ops' host code and their CUDA kernels share, without torch's tensor headers
// (the kernels' translation units compile faster without them; the ops: vlseq/rnn.h).
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

namespace vlseq::rnn {

enum class Cell { kLSTM, kGRU };
// The precision of the recurrent products; state and accumulation are fp32 either way. kTF32: W_hh
// is stored as fp32 and the grid layout's products run on the tensor cores in TF32 (W_hh and the
// products' other operand rounded to TF32) where a kernel for the shape exists, else as kFP32; the CPU
// kernels compute it as kFP32 (as torch's CPU matmul ignores allow_tf32).
enum class Weights { kFP32, kBF16, kTF32 };
// The precision W_hh is held in on chip (kTF32 holds fp32 except in its tensor-core kernels).
inline Weights stored_weights(Weights w) { return w == Weights::kTF32 ? Weights::kFP32 : w; }

inline int num_gates(Cell c) { return c == Cell::kLSTM ? 4 : 3; }

// Lengths are read on the device, so they cannot be checked without a host sync: every kernel
// clamps them to [0, T] (vlseq_ext.nn checks lengths that are on the CPU).
C10_HOST_DEVICE inline int64_t clamp_length(int64_t len, int64_t T) { return len < 0 ? 0 : (len > T ? T : len); }

}  // namespace vlseq::rnn
