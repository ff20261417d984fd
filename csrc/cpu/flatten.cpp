// CPU kernels for flatten_ / unflatten_. Same conversion rule as the CUDA kernels (dtypes.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vlseq/dtypes.h"
#include "vlseq/arg_checks.h"

namespace vlseq {
namespace {

constexpr int64_t kGrain = 1 << 15;

template <typename Dst, typename Src>
void convert_scale(const Src* src, Dst* dst, int64_t n, double scale) {
  using Op = opmath_t<Dst, Src>;
  const Op s = static_cast<Op>(scale);
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) dst[k] = cvt<Dst>(cvt<Op>(src[k]) * s);
  });
}

// dst[0:n] = src[0:n] * scale for any pair of supported dtypes.
void copy_scaled(const at::Tensor& src, void* dst, at::ScalarType dst_type, double scale) {
  const int64_t n = src.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dst_type, "vlseq_copy_scaled_dst", [&] {
    using Dst = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "vlseq_copy_scaled_src", [&] {
      convert_scale<Dst, scalar_t>(src.const_data_ptr<scalar_t>(), static_cast<Dst*>(dst), n, scale);
    });
  });
}

void flatten_cpu(const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef numels, at::Tensor out,
                 double scale) {
  check_flatten(tensors, numels, out);
  char* base = static_cast<char*>(out.data_ptr());
  const int64_t esize = out.element_size();
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::optional<at::Tensor> t = tensors.get(i);
    if (t.has_value() && t->defined()) {
      copy_scaled(t->contiguous(), base + offset * esize, out.scalar_type(), scale);
    } else {
      out.view(-1).narrow(0, offset, numels[i]).zero_();
    }
    offset += numels[i];
  }
}

void unflatten_cpu(const at::Tensor& flat, at::TensorList tensors, double scale) {
  check_unflatten(flat, tensors);
  const char* base = static_cast<const char*>(flat.const_data_ptr());
  int64_t offset = 0;
  for (const at::Tensor& t : tensors) {
    const int64_t n = t.numel();
    // Contiguous destinations are written in place; others through a contiguous temporary.
    at::Tensor dst = t.is_contiguous() ? t : at::empty(t.sizes(), t.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "vlseq_unflatten_src", [&] {
      using Src = scalar_t;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "vlseq_unflatten_dst", [&] {
        convert_scale<scalar_t, Src>(reinterpret_cast<const Src*>(base) + offset, dst.mutable_data_ptr<scalar_t>(), n,
                                     scale);
      });
    });
    if (!t.is_contiguous()) t.copy_(dst);
    offset += n;
  }
}

}  // namespace

}  // namespace vlseq

TORCH_LIBRARY_IMPL(vlseq_ext, CPU, m) {
  m.impl("flatten_", &vlseq::flatten_cpu);
  m.impl("unflatten_", &vlseq::unflatten_cpu);
}
