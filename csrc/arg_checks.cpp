#include "vlseq/arg_checks.h"

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <optional>
#include <ostream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "vlseq/dtypes.h"

namespace vlseq {

namespace {

// A list entry's name, e.g. tensors[3]. TORCH_CHECK streams message arguments only when the check
// fails, so the hot path builds no strings for names.
struct Item {
  const char* arg;
  size_t i;
};

std::ostream& operator<<(std::ostream& os, const Item& it) { return os << it.arg << "[" << std::to_string(it.i) << "]"; }

Item item(const char* arg, size_t i) { return {arg, i}; }

// `what`: an argument name or an Item.
template <typename What>
void check_dtype(const char* op, const What& what, const at::Tensor& t) {
  TORCH_CHECK(is_supported(t.scalar_type()), op, ": ", what, " has unsupported dtype ",
              c10::toString(t.scalar_type()), " (supported: float32, float16, bfloat16, float64)");
}

// Numbers go into messages as strings. The crash behind this rule
// (benchmarks/results/cuda-gdb-bad-input-crash.txt) came from the build, not from TORCH_CHECK: that
// extension held its own, exported copy of libstdc++'s stream code (statically linked by the GPU image's
// CXX=/opt/gcc/bin/g++), the dynamic linker bound part of it (the locale facet ids) to the process's
// libstdc++.so.6, and formatting a number fetched the wrong facet (strings do not use it).
// setup.py now lets the extension export nothing but PyInit__C, and tests/test_flatten.py checks
// the built library. to_string stays: it costs nothing.
std::string num(int64_t v) { return std::to_string(v); }

// The bytes a tensor's elements span, [begin, end), first to last element (strided views
// included), on one device. Empty tensors span nothing and are left out.
struct Span {
  uintptr_t begin;
  uintptr_t end;
  int32_t device;  // CUDA index; -1 for CPU
  uint32_t index;  // the caller's numbering
};

// The first `numel` elements of contiguous `t`.
void add_prefix(std::vector<Span>& spans, const at::Tensor& t, size_t index, int64_t numel) {
  if (numel == 0) return;
  const auto begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  spans.push_back({begin, begin + static_cast<uintptr_t>(numel) * t.element_size(), t.is_cpu() ? -1 : t.get_device(),
                   static_cast<uint32_t>(index)});
}

// All of `t`: first to last element, strided or not.
void add_span(std::vector<Span>& spans, const at::Tensor& t, size_t index) {
  if (t.numel() == 0) return;
  int64_t extent = 1;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  const auto begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  spans.push_back({begin, begin + static_cast<uintptr_t>(extent) * t.element_size(), t.is_cpu() ? -1 : t.get_device(),
                   static_cast<uint32_t>(index)});
}

// The first pair (i, j), i < j by the callers' numbering, of spans that share memory on one device
// and that conflict(i, j) does not excuse. Sorting by start makes it O(n log n): while nothing
// overlaps, at most one span is open when the next one starts.
template <typename Conflict>
std::optional<std::pair<size_t, size_t>> find_overlap(std::vector<Span>& spans, Conflict&& conflict) {
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    if (a.device != b.device) return a.device < b.device;
    return a.begin != b.begin ? a.begin < b.begin : a.index < b.index;
  });
  std::vector<const Span*> open;
  for (const Span& s : spans) {
    open.erase(std::remove_if(open.begin(), open.end(),
                              [&](const Span* o) { return o->device != s.device || o->end <= s.begin; }),
               open.end());
    for (const Span* o : open) {
      const size_t i = std::min(o->index, s.index), j = std::max(o->index, s.index);
      if (conflict(i, j)) return std::make_pair(i, j);
    }
    open.push_back(&s);
  }
  return std::nullopt;
}

std::optional<std::pair<size_t, size_t>> find_overlap(std::vector<Span>& spans) {
  return find_overlap(spans, [](size_t, size_t) { return true; });
}

// "tensors[5] (list 1, tensor 2)" for device-major lists of P tensors.
std::string list_item(size_t k, int64_t P) {
  return "tensors[" + std::to_string(k) + "] (list " + num(static_cast<int64_t>(k) / P) + ", tensor " +
         num(static_cast<int64_t>(k) % P) + ")";
}

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
    // Checked entry by entry so the running total never overflows int64: a wrapped total passed
    // the size check and let a huge numels entry move the write before `out`.
    TORCH_CHECK(numels[i] <= out.numel() - total, op, ": out is too small: it has ", num(out.numel()),
                " elements but numels[0..", num(static_cast<int64_t>(i)), "] need more (", num(total), " + ",
                num(numels[i]), ")");
    total += numels[i];
  }
  // Inputs may share memory with each other (they are only read), not with what is written.
  std::vector<Span> spans;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::optional<at::Tensor> maybe = tensors.get(i);
    if (maybe.has_value() && maybe->defined()) add_span(spans, *maybe, i);
  }
  add_prefix(spans, out, tensors.size(), total);
  if (const auto hit = find_overlap(spans, [&](size_t, size_t j) { return j == tensors.size(); })) {
    TORCH_CHECK(false, op, ": ", item("tensors", hit->first),
                " overlaps out in memory; the inputs must not share memory with the part of out that is written");
  }
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
  std::vector<Span> spans;
  for (size_t i = 0; i < tensors.size(); ++i) add_span(spans, tensors[i], i);
  add_prefix(spans, flat, tensors.size(), total);
  if (const auto hit = find_overlap(spans)) {
    const auto [i, j] = *hit;
    if (j == tensors.size()) {
      TORCH_CHECK(false, op, ": ", item("tensors", i),
                  " overlaps flat in memory; the destinations must not share memory with the part of flat that is read");
    }
    TORCH_CHECK(false, op, ": ", item("tensors", j), " overlaps ", item("tensors", i),
                " in memory; give distinct destinations");
  }
  return total;
}

void check_device_buffers(const char* op, const char* arg, at::TensorList buffers) {
  TORCH_CHECK(!buffers.empty(), op, ": ", arg, " must be a non-empty list");
  const at::Tensor& b0 = buffers[0];
  std::set<int> cuda_devices;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const at::Tensor& b = buffers[i];
    const Item name = item(arg, i);
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
    }
  }
  std::vector<Span> spans;
  for (size_t i = 0; i < buffers.size(); ++i) add_span(spans, buffers[i], i);
  if (const auto hit = find_overlap(spans)) {
    TORCH_CHECK(false, op, ": ", item(arg, hit->second), " aliases another buffer; give distinct buffers (it overlaps ",
                item(arg, hit->first), " in memory)");
  }
}

bool parse_reduce_op(const char* op, const std::string& name) {
  TORCH_CHECK(name == "sum" || name == "mean", op, ": op must be \"sum\" or \"mean\", got \"", name, "\"");
  return name == "mean";
}

int64_t check_device_lists(const char* op, at::TensorList tensors, int64_t num_devices, bool one_list_per_device) {
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
      const Item name = item("tensors", static_cast<size_t>(d * P + p));
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
    if (first.is_cuda() && one_list_per_device) {
      TORCH_CHECK(devices.insert(first.get_device()).second, op, ": device list ", num(d), " is on ",
                  first.device().str(), ", which another list already uses; give one list per device");
    }
  }
  // Every tensor is read and written (or zeroed): none may share memory with another, in any list.
  std::vector<Span> spans;
  for (size_t k = 0; k < tensors.size(); ++k) add_span(spans, tensors[k], k);
  if (const auto hit = find_overlap(spans)) {
    TORCH_CHECK(false, op, ": ", list_item(hit->second, P), " overlaps ", list_item(hit->first, P),
                " in memory; every tensor needs its own memory");
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
    const Item name = item("srcs", p);
    TORCH_CHECK(s.defined(), op, ": ", name, " is undefined");
    TORCH_CHECK(s.device() == srcs[0].device(), op, ": ", name, " is on ", s.device().str(), " but srcs[0] is on ",
                srcs[0].device().str());
    TORCH_CHECK(s.is_contiguous(), op, ": ", name, " must be contiguous");
    check_dtype(op, name, s);
  }
  for (size_t i = 0; i < dsts.size(); ++i) {
    const at::Tensor& t = dsts[i];
    const at::Tensor& s = srcs[i % P];
    const Item name = item("dsts", i);
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
  // Numbering: srcs 0..P-1, then dsts. Sources may share memory (they are only read), and a
  // destination may be its own source (same address; both are contiguous with the same numel and
  // dtype, so the same memory: nothing to copy). Any other sharing is refused.
  std::vector<Span> spans;
  for (size_t p = 0; p < P; ++p) add_span(spans, srcs[p], p);
  for (size_t i = 0; i < dsts.size(); ++i) add_span(spans, dsts[i], P + i);
  const auto hit = find_overlap(spans, [&](size_t a, size_t b) {
    if (b < P) return false;
    if (a >= P) return true;
    return (b - P) % P != a || dsts[b - P].const_data_ptr() != srcs[a].const_data_ptr();
  });
  if (hit) {
    const auto [a, b] = *hit;
    if (a >= P) {
      TORCH_CHECK(false, op, ": ", item("dsts", b - P), " overlaps ", item("dsts", a - P),
                  " in memory; give distinct destinations");
    }
    TORCH_CHECK(false, op, ": ", item("dsts", b - P), " overlaps ", item("srcs", a),
                " in memory; a destination may be its own source, but share memory with no other source");
  }
}

void check_mm(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "vlseq_ext::mm_tf32: a and b must be matrices, got ", a.dim(), "-d and ",
              b.dim(), "-d");
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat,
              "vlseq_ext::mm_tf32: a and b must be float32, got ", c10::toString(a.scalar_type()), " and ",
              c10::toString(b.scalar_type()));
  TORCH_CHECK(a.device() == b.device(), "vlseq_ext::mm_tf32: a is on ", a.device().str(), " but b is on ",
              b.device().str());
  TORCH_CHECK(a.size(1) == b.size(0), "vlseq_ext::mm_tf32: a is ", a.sizes(), " and b is ", b.sizes(),
              ": a's columns must equal b's rows");
  if (!bias) return;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == b.size(1) && bias->scalar_type() == at::kFloat,
              "vlseq_ext::mm_tf32: bias must be float32 of shape (", b.size(1), "), got ",
              c10::toString(bias->scalar_type()), " of shape ", bias->sizes());
  TORCH_CHECK(bias->device() == a.device(), "vlseq_ext::mm_tf32: bias is on ", bias->device().str(), " but a is on ",
              a.device().str());
}

}  // namespace vlseq
