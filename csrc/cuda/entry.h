// The CUDA implementations behind the op entry points of csrc/cuda/ops_cuda.cpp. They expect
// input that has already been validated: every user-facing check happens in ops_cuda.cpp and
// csrc/arg_checks.cpp, before any work is queued. (The split was made after a crash blamed on
// exceptions unwinding through nvcc-compiled frames; the one recorded backtrace, taken after it,
// crashed in host-compiled arg_checks.cpp while formatting a number: see the note there.)
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>

#include <optional>
#include <string>

#include "vlseq/algo.h"
#include "vlseq/limits.h"

namespace vlseq {

void flatten_run(const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef numels, const at::Tensor& out,
                 double scale);
void unflatten_run(const at::Tensor& flat, at::TensorList tensors, double scale);
void all_reduce_run(at::TensorList buffers, bool mean, Algo algo);
void all_reduce_tensors_run(at::TensorList tensors, int64_t num_devices, double scale, Algo algo);
void reduce_tensors_run(at::TensorList tensors, int64_t num_devices, double scale, bool zero_others);
void broadcast_run(const char* op, at::TensorList srcs, at::TensorList dsts);
std::string p2p_status_run(at::TensorList buffers);

}  // namespace vlseq
