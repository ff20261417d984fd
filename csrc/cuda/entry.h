// The CUDA implementations behind the op entry points of csrc/cuda/ops_cuda.cpp. They expect
// input that has already been validated: every user-facing check (and so every exception a
// caller can provoke) happens in ops_cuda.cpp, compiled by the host compiler. An exception
// unwinding through nvcc-compiled host frames crashed the process (SIGSEGV) with torch 2.11 on
// our GPU machines, instead of reaching Python as a RuntimeError.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>

#include <optional>
#include <string>

#include "vlseq/algo.h"

namespace vlseq {

constexpr int kMaxRanks = 8;  // devices per multi-device op

void flatten_run(const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef numels, const at::Tensor& out,
                 double scale);
void unflatten_run(const at::Tensor& flat, at::TensorList tensors, double scale);
void all_reduce_run(at::TensorList buffers, bool mean, Algo algo);
void all_reduce_tensors_run(at::TensorList tensors, int64_t num_devices, double scale, Algo algo);
void reduce_tensors_run(at::TensorList tensors, int64_t num_devices, double scale, bool zero_others);
void broadcast_run(const char* op, at::TensorList srcs, at::TensorList dsts);
std::string p2p_status_run(at::TensorList buffers);

}  // namespace vlseq
