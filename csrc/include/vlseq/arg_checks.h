// Input checks shared by the CPU and CUDA kernels. Every check runs before any write, and every
// message names the op, the argument and what was wrong. Tensors an op writes may not share memory
// with anything else it reads or writes (compared by address range, per device, in O(n log n)).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <string>
#include <vector>

namespace vlseq {

// flatten_: returns the total number of elements written. Inputs may overlap each other, not out.
int64_t check_flatten(const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef numels,
                      const at::Tensor& out);
int64_t check_unflatten(const at::Tensor& flat, at::TensorList tensors);
// all_reduce_ / broadcast_: one buffer per device (CUDA: distinct devices; CPU: distinct memory),
// same numel and dtype, contiguous.
void check_device_buffers(const char* op, const char* arg, at::TensorList buffers);
// "sum" -> false, "mean" -> true.
bool parse_reduce_op(const char* op, const std::string& name);
// all_reduce_tensors_ / reduce_tensors_: device-major lists; returns P (tensors per list). With
// one_list_per_device, two CUDA lists may not share a device.
int64_t check_device_lists(const char* op, at::TensorList tensors, int64_t num_devices, bool one_list_per_device);
// broadcast_ / broadcast_tensors_: dsts is device-major, len(dsts) a multiple of len(srcs).
void check_broadcast_lists(const char* op, at::TensorList srcs, at::TensorList dsts);
// mm_tf32: float32 matrices a (m, k), b (k, n) and bias (n) or none, on one device.
void check_mm(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias);

}  // namespace vlseq
