#include "vlseq/validate.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <set>

#include "vlseq/dtypes.h"

namespace vlseq {

namespace {

void check_dtype(const char* op, const std::string& what, const at::Tensor& t) {
  TORCH_CHECK(is_supported(t.scalar_type()), op, ": ", what, " has unsupported dtype ", t.scalar_type(),
              " (supported: float32, float16, bfloat16, float64)");
}

std::string item(const char* arg, size_t i) { return std::string(arg) + "[" + std::to_string(i) + "]"; }

}  // namespace

int64_t check_flatten(const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef numels,
                      const at::Tensor& out) {
  const char* op = "flatten_";
  TORCH_CHECK(tensors.size() > 0, op, ": tensors must be a non-empty list");
  TORCH_CHECK(numels.size() == tensors.size(), op, ": numels has ", numels.size(), " entries but tensors has ",
              tensors.size());
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  check_dtype(op, "out", out);
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(numels[i] >= 0, op, ": numels[", i, "] is negative (", numels[i], ")");
    const std::optional<at::Tensor> maybe = tensors.get(i);
    if (maybe.has_value() && maybe->defined()) {
      const at::Tensor& t = *maybe;
      TORCH_CHECK(t.device() == out.device(), op, ": tensors[", i, "] is on ", t.device(), " but out is on ",
                  out.device());
      check_dtype(op, item("tensors", i), t);
      TORCH_CHECK(t.numel() == numels[i], op, ": tensors[", i, "] has ", t.numel(), " elements but numels[", i,
                  "] is ", numels[i]);
    }
    total += numels[i];
  }
  TORCH_CHECK(out.numel() >= total, op, ": out is too small: it has ", out.numel(),
              " elements but the tensors need ", total);
  return total;
}

int64_t check_unflatten(const at::Tensor& flat, at::TensorList tensors) {
  const char* op = "unflatten_";
  TORCH_CHECK(!tensors.empty(), op, ": tensors must be a non-empty list");
  TORCH_CHECK(flat.is_contiguous(), op, ": flat must be contiguous");
  check_dtype(op, "flat", flat);
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), op, ": tensors[", i, "] is undefined");
    TORCH_CHECK(t.device() == flat.device(), op, ": tensors[", i, "] is on ", t.device(), " but flat is on ",
                flat.device());
    check_dtype(op, item("tensors", i), t);
    total += t.numel();
  }
  TORCH_CHECK(flat.numel() >= total, op, ": flat is too small: it has ", flat.numel(),
              " elements but the tensors need ", total);
  return total;
}

void check_device_buffers(const char* op, const char* arg, at::TensorList buffers) {
  TORCH_CHECK(!buffers.empty(), op, ": ", arg, " must be a non-empty list");
  const at::Tensor& b0 = buffers[0];
  std::set<int> cuda_devices;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const at::Tensor& b = buffers[i];
    TORCH_CHECK(b.defined(), op, ": ", arg, "[", i, "] is undefined");
    TORCH_CHECK(b.is_cuda() || b.is_cpu(), op, ": ", arg, "[", i, "] must be a CPU or CUDA tensor, got ",
                b.device());
    TORCH_CHECK(b.is_cuda() == b0.is_cuda(), op, ": ", arg, " mixes CPU and CUDA tensors (", arg, "[0] is on ",
                b0.device(), ", ", arg, "[", i, "] is on ", b.device(), ")");
    TORCH_CHECK(b.is_contiguous(), op, ": ", arg, "[", i, "] must be contiguous");
    check_dtype(op, item(arg, i), b);
    TORCH_CHECK(b.scalar_type() == b0.scalar_type(), op, ": ", arg, "[", i, "] has dtype ", b.scalar_type(),
                " but ", arg, "[0] has ", b0.scalar_type());
    TORCH_CHECK(b.numel() == b0.numel(), op, ": ", arg, "[", i, "] has ", b.numel(), " elements but ", arg,
                "[0] has ", b0.numel());
    if (b.is_cuda()) {
      TORCH_CHECK(cuda_devices.insert(b.get_device()).second, op, ": ", arg, "[", i, "] is on ", b.device(),
                  ", which another buffer already uses; give one buffer per device");
    } else {
      for (size_t j = 0; j < i; ++j) {
        TORCH_CHECK(at::get_overlap_status(b, buffers[j]) == at::MemOverlapStatus::No, op, ": ", arg, "[", i,
                    "] aliases another buffer; give distinct buffers (it overlaps ", arg, "[", j, "] in memory)");
      }
    }
  }
}

bool parse_reduce_op(const char* op, const std::string& name) {
  TORCH_CHECK(name == "sum" || name == "mean", op, ": op must be \"sum\" or \"mean\", got \"", name, "\"");
  return name == "mean";
}

int64_t check_device_lists(const char* op, at::TensorList tensors, int64_t num_devices) {
  TORCH_CHECK(num_devices >= 1, op, ": num_devices must be >= 1, got ", num_devices);
  TORCH_CHECK(!tensors.empty(), op, ": tensors must be a non-empty list");
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) % num_devices == 0, op, ": tensors has ", tensors.size(),
              " entries, which is not a multiple of num_devices=", num_devices);
  const int64_t P = static_cast<int64_t>(tensors.size()) / num_devices;
  std::set<int> devices;
  for (int64_t d = 0; d < num_devices; ++d) {
    const at::Tensor& first = tensors[d * P];
    for (int64_t p = 0; p < P; ++p) {
      const at::Tensor& t = tensors[d * P + p];
      const at::Tensor& ref = tensors[p];
      const size_t i = static_cast<size_t>(d * P + p);
      TORCH_CHECK(t.defined(), op, ": tensors[", i, "] is undefined");
      TORCH_CHECK(t.is_cuda() || t.is_cpu(), op, ": tensors[", i, "] must be a CPU or CUDA tensor, got ",
                  t.device());
      TORCH_CHECK(t.is_cuda() == tensors[0].is_cuda(), op, ": tensors mixes CPU and CUDA tensors (tensors[0] is on ",
                  tensors[0].device(), ", tensors[", i, "] is on ", t.device(), ")");
      TORCH_CHECK(t.device() == first.device(), op, ": device list ", d, " mixes devices: tensors[", i, "] is on ",
                  t.device(), " but tensors[", d * P, "] is on ", first.device());
      TORCH_CHECK(t.is_contiguous(), op, ": tensors[", i, "] must be contiguous");
      check_dtype(op, item("tensors", i), t);
      TORCH_CHECK(t.scalar_type() == ref.scalar_type() && t.numel() == ref.numel(), op, ": tensors[", i, "] (",
                  t.scalar_type(), ", ", t.numel(), " elements) does not match tensors[", p, "] (",
                  ref.scalar_type(), ", ", ref.numel(), " elements) of device list 0");
    }
    if (first.is_cuda()) {
      TORCH_CHECK(devices.insert(first.get_device()).second, op, ": device list ", d, " is on ", first.device(),
                  ", which another list already uses; give one list per device");
    }
  }
  return P;
}

void check_broadcast_lists(const char* op, at::TensorList srcs, at::TensorList dsts) {
  TORCH_CHECK(!srcs.empty(), op, ": srcs must be a non-empty list");
  TORCH_CHECK(dsts.size() % srcs.size() == 0, op, ": dsts has ", dsts.size(),
              " entries, which is not a multiple of len(srcs)=", srcs.size());
  const size_t P = srcs.size();
  for (size_t p = 0; p < P; ++p) {
    const at::Tensor& s = srcs[p];
    TORCH_CHECK(s.defined(), op, ": srcs[", p, "] is undefined");
    TORCH_CHECK(s.device() == srcs[0].device(), op, ": srcs[", p, "] is on ", s.device(), " but srcs[0] is on ",
                srcs[0].device());
    TORCH_CHECK(s.is_contiguous(), op, ": srcs[", p, "] must be contiguous");
    check_dtype(op, item("srcs", p), s);
  }
  for (size_t i = 0; i < dsts.size(); ++i) {
    const at::Tensor& t = dsts[i];
    const at::Tensor& s = srcs[i % P];
    TORCH_CHECK(t.defined(), op, ": dsts[", i, "] is undefined");
    TORCH_CHECK(t.is_cuda() == s.is_cuda(), op, ": dsts[", i, "] is on ", t.device(), " but srcs are on ",
                s.device(), "; CPU and CUDA cannot be mixed");
    TORCH_CHECK(t.device() == dsts[i - i % P].device(), op, ": destination list ", i / P,
                " mixes devices: dsts[", i, "] is on ", t.device(), " but dsts[", i - i % P, "] is on ",
                dsts[i - i % P].device());
    TORCH_CHECK(t.is_contiguous(), op, ": dsts[", i, "] must be contiguous");
    TORCH_CHECK(t.scalar_type() == s.scalar_type() && t.numel() == s.numel(), op, ": dsts[", i, "] (",
                t.scalar_type(), ", ", t.numel(), " elements) does not match srcs[", i % P, "] (", s.scalar_type(),
                ", ", s.numel(), " elements)");
  }
}

}  // namespace vlseq
