// CUDA entry points of the ops: input checks, then the implementations in csrc/cuda/*.cu
// (see entry.h for why the split is here).
#include <torch/library.h>

#include "entry.h"
#include "vlseq/arg_checks.h"

namespace vlseq {
namespace {

// `what`: "devices" or "lists". The one message that streams its numbers instead of formatting
// them with std::to_string (arg_checks.cpp says why the others do): a GPU test
// (test_reduce.py::test_cuda_error_message_with_streamed_numbers) makes it fail, so that a build
// whose number formatting is broken again shows up there.
void check_rank_count(const char* op, const char* what, size_t n) {
  TORCH_CHECK(n <= static_cast<size_t>(kMaxRanks), op, ": at most ", kMaxRanks, " ", what, " are supported, got ", n);
}

void flatten_cuda(const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef numels, at::Tensor out,
                  double scale) {
  check_flatten(tensors, numels, out);
  flatten_run(tensors, numels, out, scale);
}

void unflatten_cuda(const at::Tensor& flat, at::TensorList tensors, double scale) {
  check_unflatten(flat, tensors);
  unflatten_run(flat, tensors, scale);
}

void all_reduce_cuda(at::TensorList buffers, c10::string_view op, c10::string_view algo) {
  check_device_buffers("all_reduce_", "buffers", buffers);
  check_rank_count("all_reduce_", "devices", buffers.size());
  const bool mean = parse_reduce_op("all_reduce_", std::string(op));
  all_reduce_run(buffers, mean, parse_algo("all_reduce_", std::string(algo)));
}

void all_reduce_tensors_cuda(at::TensorList tensors, int64_t num_devices, double scale, c10::string_view algo) {
  check_device_lists("all_reduce_tensors_", tensors, num_devices, /*one_list_per_device=*/true);
  check_rank_count("all_reduce_tensors_", "devices", num_devices);
  const Algo a = parse_algo("all_reduce_tensors_", std::string(algo));
  TORCH_CHECK(a != Algo::kOneShot, "all_reduce_tensors_: algo one_shot is for flat buffers (all_reduce_); "
              "use auto, root, two_shot or copy_engine");
  all_reduce_tensors_run(tensors, num_devices, scale, a);
}

void reduce_tensors_cuda(at::TensorList tensors, int64_t num_devices, double scale, bool zero_others) {
  // Lists may share a device; the kernel reads every list, so the limit is on lists.
  check_device_lists("reduce_tensors_", tensors, num_devices, /*one_list_per_device=*/false);
  check_rank_count("reduce_tensors_", "lists", num_devices);
  reduce_tensors_run(tensors, num_devices, scale, zero_others);
}

void broadcast_cuda(const at::Tensor& src, at::TensorList dsts) {
  TORCH_CHECK(src.defined(), "broadcast_: src is undefined");
  check_broadcast_lists("broadcast_", {src}, dsts);
  check_device_buffers("broadcast_", "dsts", dsts);
  broadcast_run("broadcast_", {src}, dsts);
}

void broadcast_tensors_cuda(at::TensorList srcs, at::TensorList dsts) {
  check_broadcast_lists("broadcast_tensors_", srcs, dsts);
  broadcast_run("broadcast_tensors_", srcs, dsts);
}

std::string p2p_status_cuda(at::TensorList buffers) {
  check_device_buffers("p2p_status", "buffers", buffers);
  return p2p_status_run(buffers);
}

rnn::LayerPlan checked_plan(const char* op, const rnn::Sizes& z, const at::Device& device) {
  rnn::LayerPlan plan = rnn::plan_layer(z.cell, z.weights, z.H, z.B, device.index(), z.max_blocks);
  TORCH_CHECK(plan.ok, op, ": this layer does not fit the kernels: ", plan.why_not,
              " (vlseq_ext.nn falls back to torch's RNN for such layers)");
  return plan;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> rnn_forward_cuda(
    c10::string_view cell, const at::Tensor& xproj, const at::Tensor& w_hh, const std::optional<at::Tensor>& b_hh,
    const at::Tensor& h0, const std::optional<at::Tensor>& c0, const at::Tensor& lengths, bool reverse,
    c10::string_view weights, int64_t max_blocks) {
  const rnn::Sizes z =
      rnn::check_forward(std::string(cell), xproj, w_hh, b_hh, h0, c0, lengths, std::string(weights), max_blocks);
  const rnn::LayerPlan plan = checked_plan("rnn_forward", z, xproj.device());
  return rnn::forward_run(plan, z, xproj, w_hh, b_hh, h0, c0, lengths, reverse);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rnn_backward_cuda(
    c10::string_view cell, const at::Tensor& w_hh, const at::Tensor& y, const at::Tensor& saved, const at::Tensor& cs,
    const at::Tensor& h0, const std::optional<at::Tensor>& c0, const at::Tensor& lengths,
    const std::optional<at::Tensor>& dy, const std::optional<at::Tensor>& dh_n, const std::optional<at::Tensor>& dc_n,
    bool reverse, c10::string_view weights, int64_t max_blocks) {
  const rnn::Sizes z = rnn::check_backward(std::string(cell), w_hh, y, saved, cs, h0, c0, lengths, dy, dh_n, dc_n,
                                           std::string(weights), max_blocks);
  const rnn::LayerPlan plan = checked_plan("rnn_backward", z, y.device());
  return rnn::backward_run(plan, z, w_hh, y, saved, cs, h0, c0, lengths, dy, dh_n, dc_n, reverse);
}

std::string rnn_plan_cuda(c10::string_view cell, int64_t hidden_size, int64_t batch, c10::string_view weights,
                          const at::Tensor& like, int64_t max_blocks) {
  const rnn::Sizes z = rnn::check_plan(std::string(cell), hidden_size, batch, std::string(weights), max_blocks);
  return rnn::plan_layer(z.cell, z.weights, z.H, z.B, like.device().index(), z.max_blocks).describe();
}

}  // namespace
}  // namespace vlseq

TORCH_LIBRARY_IMPL(vlseq_ext, CUDA, m) {
  m.impl("flatten_", &vlseq::flatten_cuda);
  m.impl("unflatten_", &vlseq::unflatten_cuda);
  m.impl("all_reduce_", &vlseq::all_reduce_cuda);
  m.impl("all_reduce_tensors_", &vlseq::all_reduce_tensors_cuda);
  m.impl("reduce_tensors_", &vlseq::reduce_tensors_cuda);
  m.impl("broadcast_", &vlseq::broadcast_cuda);
  m.impl("broadcast_tensors_", &vlseq::broadcast_tensors_cuda);
  m.impl("p2p_status", &vlseq::p2p_status_cuda);
  m.impl("rnn_forward", &vlseq::rnn_forward_cuda);
  m.impl("rnn_backward", &vlseq::rnn_backward_cuda);
  m.impl("rnn_plan", &vlseq::rnn_plan_cuda);
}
