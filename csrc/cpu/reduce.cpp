// CPU kernels for the multi-device reduce and broadcast ops. Several "devices" are several CPU
// buffers here; the point is the same fixed summation order (0..N-1, widened accumulation) as the
// CUDA kernels, so CI checks the semantics the GPUs must meet.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "vlseq/algo.h"
#include "vlseq/dtypes.h"
#include "vlseq/arg_checks.h"

namespace vlseq {
namespace {

constexpr int64_t kGrain = 1 << 14;

// Sums bufs[0..N-1] in that order (widened accumulation) and writes the result into the first
// `nresult` buffers. `divide` selects the mean.
template <typename T>
void reduce_in_place(const std::vector<T*>& bufs, size_t nresult, int64_t n, bool divide, double scale) {
  using Acc = opmath_t<T, T>;
  const Acc s = static_cast<Acc>(scale);
  const Acc count = static_cast<Acc>(bufs.size());
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      Acc acc = cvt<Acc>(bufs[0][k]);
      for (size_t j = 1; j < bufs.size(); ++j) acc += cvt<Acc>(bufs[j][k]);
      acc = divide ? acc / count : acc * s;
      const T r = cvt<T>(acc);
      for (size_t j = 0; j < nresult; ++j) bufs[j][k] = r;
    }
  });
}

void reduce_tensors(const std::vector<at::Tensor>& group, size_t nresult, bool divide, double scale) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, group[0].scalar_type(), "vlseq_reduce_cpu", [&] {
    std::vector<scalar_t*> ptrs;
    for (auto& t : group) ptrs.push_back(t.mutable_data_ptr<scalar_t>());
    reduce_in_place<scalar_t>(ptrs, nresult, group[0].numel(), divide, scale);
  });
}

void all_reduce_cpu(at::TensorList buffers, c10::string_view op, c10::string_view algo) {
  check_device_buffers("all_reduce_", "buffers", buffers);
  const bool mean = parse_reduce_op("all_reduce_", std::string(op));
  parse_algo("all_reduce_", std::string(algo));
  if (buffers.size() == 1) return;  // sum or mean of one buffer is the buffer
  reduce_tensors(buffers.vec(), buffers.size(), mean, 1.0);
}

void all_reduce_tensors_cpu(at::TensorList tensors, int64_t num_devices, double scale, c10::string_view algo) {
  const int64_t P = check_device_lists("all_reduce_tensors_", tensors, num_devices, /*one_list_per_device=*/true);
  TORCH_CHECK(parse_algo("all_reduce_tensors_", std::string(algo)) != Algo::kOneShot,
              "all_reduce_tensors_: algo one_shot is for flat buffers (all_reduce_); use auto, root, two_shot or "
              "copy_engine");
  for (int64_t p = 0; p < P; ++p) {
    std::vector<at::Tensor> group;
    for (int64_t d = 0; d < num_devices; ++d) group.push_back(tensors[d * P + p]);
    if (group[0].numel() > 0) reduce_tensors(group, group.size(), false, scale);
  }
}

void reduce_tensors_cpu(at::TensorList tensors, int64_t num_devices, double scale, bool zero_others) {
  const int64_t P = check_device_lists("reduce_tensors_", tensors, num_devices, /*one_list_per_device=*/false);
  for (int64_t p = 0; p < P; ++p) {
    std::vector<at::Tensor> group;
    for (int64_t d = 0; d < num_devices; ++d) group.push_back(tensors[d * P + p]);
    if (group[0].numel() == 0) continue;
    if (num_devices > 1 || scale != 1.0) reduce_tensors(group, 1, false, scale);  // same bits as the CUDA root kernel
    if (zero_others)
      for (int64_t d = 1; d < num_devices; ++d) group[d].zero_();
  }
}

void broadcast_cpu(const at::Tensor& src, at::TensorList dsts) {
  TORCH_CHECK(src.defined(), "broadcast_: src is undefined");
  check_broadcast_lists("broadcast_", {src}, dsts);
  // Flat copies, as the CUDA kernel makes them: the contract is same numel and dtype, not same shape.
  for (const at::Tensor& d : dsts) {
    if (d.data_ptr() != src.data_ptr()) d.view(-1).copy_(src.view(-1));
  }
}

void broadcast_tensors_cpu(at::TensorList srcs, at::TensorList dsts) {
  check_broadcast_lists("broadcast_tensors_", srcs, dsts);
  for (size_t i = 0; i < dsts.size(); ++i) {
    const at::Tensor& s = srcs[i % srcs.size()];
    if (dsts[i].data_ptr() != s.data_ptr()) dsts[i].view(-1).copy_(s.view(-1));
  }
}

std::string p2p_status_cpu(at::TensorList buffers) {
  check_device_buffers("p2p_status", "buffers", buffers);
  return "cpu";
}

}  // namespace
}  // namespace vlseq

TORCH_LIBRARY_IMPL(vlseq_ext, CPU, m) {
  m.impl("all_reduce_", &vlseq::all_reduce_cpu);
  m.impl("all_reduce_tensors_", &vlseq::all_reduce_tensors_cpu);
  m.impl("reduce_tensors_", &vlseq::reduce_tensors_cpu);
  m.impl("broadcast_", &vlseq::broadcast_cpu);
  m.impl("broadcast_tensors_", &vlseq::broadcast_tensors_cpu);
  m.impl("p2p_status", &vlseq::p2p_status_cpu);
}
