// mm_tf32 on the CPU: the exact float32 product (TF32 is a tensor-core format; torch's CPU matmul
// has no such mode either).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "vlseq/arg_checks.h"

namespace vlseq {

at::Tensor mm_tf32_cpu(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias) {
  check_mm(a, b, bias);
  return bias ? at::addmm(*bias, a, b) : at::mm(a, b);
}

TORCH_LIBRARY_IMPL(vlseq_ext, CPU, m) { m.impl("mm_tf32", &mm_tf32_cpu); }

}  // namespace vlseq
