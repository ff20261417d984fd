#include "vlseq/validate.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <set>

#include "vlseq/dtypes.h"

namespace vlseq {

namespace {

void check_dtype(const char* op, const std::string& what, const at::Tensor& t) {
  TORCH_CHECK(is_supported(t.scalar_type()), op, ": ", what, " has unsupported dtype ",
              c10::toString(t.scalar_type()), " (supported: float32, float16, bfloat16, float64)");
}

std::string item(const char* arg, size_t i) { return std::string(arg) + "[" + std::to_string(i) + "]"; }

// Numbers go into messages as strings. Streaming an integer into a TORCH_CHECK message
// segfaulted inside std::ostream on our GPU machines (torch 2.11, g++ 13; backtrace in
// benchmarks/results/cuda-gdb-bad-input-crash.txt), so nothing here streams one.
std::string num(int64_t v) { return std::to_string(v); }

}  // namespace

int64_t check_flatten(const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef numels,
                      const at::Tensor& out) {
  const char* op = "flatten_";
  TORCH_CHECK(tensors.size() > 0, op, ": tensors must be a non-empty list");
  TORCH_CHECK(numels.size() == tensors.size(), op, ": numels has ", num(numels.size()), " entries but tensors has ",
              num(tensors.size()));
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  check_dtype(op, "out", out);
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(numels[i] >= 0, op, ": ", item("numels", i), " is negative (", num(numels[i]), ")");
    const std::optional<at::Tensor> maybe = tensors.get(i);
    if (maybe.has_value() && maybe->defined()) {
      const at::Tensor& t = *maybe;
      TORCH_CHECK(t.device() == out.device(), op, ": ", item("tensors", i), " is on ", t.device().str(),
                  " but out is on ", out.device().str());
      check_dtype(op, item("tensors", i), t);
      TORCH_CHECK(t.numel() == numels[i], op, ": ", item("tensors", i), " has ", num(t.numel()), " elements but ",
                  item("numels", i), " is ", num(numels[i]));
    }
    total += numels[i];
  }
  TORCH_CHECK(out.numel() >= total, op, ": out is too small: it has ", num(out.numel()),
              " elements but the tensors need ", num(total));
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
    TORCH_CHECK(t.defined(), op, ": ", item("tensors", i), " is undefined");
    TORCH_CHECK(t.device() == flat.device(), op, ": ", item("tensors", i), " is on ", t.device().str(),
                " but flat is on ", flat.device().str());
    check_dtype(op, item("tensors", i), t);
    total += t.numel();
  }
  TORCH_CHECK(flat.numel() >= total, op, ": flat is too small: it has ", num(flat.numel()),
              " elements but the tensors need ", num(total));
  return total;
}

void check_device_buffers(const char* op, const char* arg, at::TensorList buffers) {
  TORCH_CHECK(!buffers.empty(), op, ": ", arg, " must be a non-empty list");
  const at::Tensor& b0 = buffers[0];
  std::set<int> cuda_devices;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const at::Tensor& b = buffers[i];
    const std::string name = item(arg, i);
    TORCH_CHECK(b.defined(), op, ": ", name, " is undefined");
    TORCH_CHECK(b.is_cuda() || b.is_cpu(), op, ": ", name, " must be a CPU or CUDA tensor, got ", b.device().str());
    TORCH_CHECK(b.is_cuda() == b0.is_cuda(), op, ": ", arg, " mixes CPU and CUDA tensors (", arg, "[0] is on ",
                b0.device().str(), ", ", name, " is on ", b.device().str(), ")");
    TORCH_CHECK(b.is_contiguous(), op, ": ", name, " must be contiguous");
    check_dtype(op, name, b);
    TORCH_CHECK(b.scalar_type() == b0.scalar_type(), op, ": ", name, " has dtype ", c10::toString(b.scalar_type()),
                " but ", arg, "[0] has ", c10::toString(b0.scalar_type()));
    TORCH_CHECK(b.numel() == b0.numel(), op, ": ", name, " has ", num(b.numel()), " elements but ", arg, "[0] has ",
                num(b0.numel()));
    if (b.is_cuda()) {
      TORCH_CHECK(cuda_devices.insert(b.get_device()).second, op, ": ", name, " is on ", b.device().str(),
                  ", which another buffer already uses; give one buffer per device");
    } else {
      for (size_t j = 0; j < i; ++j) {
        TORCH_CHECK(at::get_overlap_status(b, buffers[j]) == at::MemOverlapStatus::No, op, ": ", name,
                    " aliases another buffer; give distinct buffers (it overlaps ", item(arg, j), " in memory)");
      }
    }
  }
}

bool parse_reduce_op(const char* op, const std::string& name) {
  TORCH_CHECK(name == "sum" || name == "mean", op, ": op must be \"sum\" or \"mean\", got \"", name, "\"");
  return name == "mean";
}

int64_t check_device_lists(const char* op, at::TensorList tensors, int64_t num_devices) {
  TORCH_CHECK(num_devices >= 1, op, ": num_devices must be >= 1, got ", num(num_devices));
  TORCH_CHECK(!tensors.empty(), op, ": tensors must be a non-empty list");
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) % num_devices == 0, op, ": tensors has ", num(tensors.size()),
              " entries, which is not a multiple of num_devices=", num(num_devices));
  const int64_t P = static_cast<int64_t>(tensors.size()) / num_devices;
  std::set<int> devices;
  for (int64_t d = 0; d < num_devices; ++d) {
    const at::Tensor& first = tensors[d * P];
    for (int64_t p = 0; p < P; ++p) {
      const at::Tensor& t = tensors[d * P + p];
      const at::Tensor& ref = tensors[p];
      const std::string name = item("tensors", static_cast<size_t>(d * P + p));
      TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
      TORCH_CHECK(t.is_cuda() || t.is_cpu(), op, ": ", name, " must be a CPU or CUDA tensor, got ", t.device().str());
      TORCH_CHECK(t.is_cuda() == tensors[0].is_cuda(), op, ": tensors mixes CPU and CUDA tensors (tensors[0] is on ",
                  tensors[0].device().str(), ", ", name, " is on ", t.device().str(), ")");
      TORCH_CHECK(t.device() == first.device(), op, ": device list ", num(d), " mixes devices: ", name, " is on ",
                  t.device().str(), " but ", item("tensors", static_cast<size_t>(d * P)), " is on ",
                  first.device().str());
      TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
      check_dtype(op, name, t);
      TORCH_CHECK(t.scalar_type() == ref.scalar_type() && t.numel() == ref.numel(), op, ": ", name, " (",
                  c10::toString(t.scalar_type()), ", ", num(t.numel()), " elements) does not match ",
                  item("tensors", static_cast<size_t>(p)), " (", c10::toString(ref.scalar_type()), ", ",
                  num(ref.numel()), " elements) of device list 0");
    }
    if (first.is_cuda()) {
      TORCH_CHECK(devices.insert(first.get_device()).second, op, ": device list ", num(d), " is on ",
                  first.device().str(), ", which another list already uses; give one list per device");
    }
  }
  return P;
}

void check_broadcast_lists(const char* op, at::TensorList srcs, at::TensorList dsts) {
  TORCH_CHECK(!srcs.empty(), op, ": srcs must be a non-empty list");
  TORCH_CHECK(dsts.size() % srcs.size() == 0, op, ": dsts has ", num(dsts.size()),
              " entries, which is not a multiple of len(srcs)=", num(srcs.size()));
  const size_t P = srcs.size();
  for (size_t p = 0; p < P; ++p) {
    const at::Tensor& s = srcs[p];
    const std::string name = item("srcs", p);
    TORCH_CHECK(s.defined(), op, ": ", name, " is undefined");
    TORCH_CHECK(s.device() == srcs[0].device(), op, ": ", name, " is on ", s.device().str(), " but srcs[0] is on ",
                srcs[0].device().str());
    TORCH_CHECK(s.is_contiguous(), op, ": ", name, " must be contiguous");
    check_dtype(op, name, s);
  }
  for (size_t i = 0; i < dsts.size(); ++i) {
    const at::Tensor& t = dsts[i];
    const at::Tensor& s = srcs[i % P];
    const std::string name = item("dsts", i);
    TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
    TORCH_CHECK(t.is_cuda() == s.is_cuda(), op, ": ", name, " is on ", t.device().str(), " but srcs are on ",
                s.device().str(), "; CPU and CUDA cannot be mixed");
    TORCH_CHECK(t.device() == dsts[i - i % P].device(), op, ": destination list ", num(i / P), " mixes devices: ",
                name, " is on ", t.device().str(), " but ", item("dsts", i - i % P), " is on ",
                dsts[i - i % P].device().str());
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
    TORCH_CHECK(t.scalar_type() == s.scalar_type() && t.numel() == s.numel(), op, ": ", name, " (",
                c10::toString(t.scalar_type()), ", ", num(t.numel()), " elements) does not match ",
                item("srcs", i % P), " (", c10::toString(s.scalar_type()), ", ", num(s.numel()), " elements)");
  }
}

}  // namespace vlseq
