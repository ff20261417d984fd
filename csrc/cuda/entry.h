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
#include <tuple>

#include "vlseq/algo.h"
#include "vlseq/limits.h"
#include "vlseq/rnn.h"

namespace vlseq {

void flatten_run(const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef numels, const at::Tensor& out,
                 double scale);
void unflatten_run(const at::Tensor& flat, at::TensorList tensors, double scale);
void all_reduce_run(at::TensorList buffers, bool mean, Algo algo);
void all_reduce_tensors_run(at::TensorList tensors, int64_t num_devices, double scale, Algo algo);
void reduce_tensors_run(at::TensorList tensors, int64_t num_devices, double scale, bool zero_others);
void broadcast_run(const char* op, at::TensorList srcs, at::TensorList dsts);
std::string p2p_status_run(at::TensorList buffers);

namespace rnn {

// How one recurrent layer runs on a GPU (rnn.cu chooses it; rnn_kernels.cuh explains the terms).
// The forward and the backward launch share only global tensors (the outputs, the saved fields, the
// gate gradients, all indexed by sample, step and unit), so each has its own layout.
struct LaunchPlan {
  int sync = 0;  // Sync: 0 local, 1 cluster, 2 grid
  int nc = 0, hs = 0, bs = 0, chunk = 0, groups = 0, bt = 0;
  // The kernel: fused (rnn_fused_kernels.cuh: W_hh in registers, the cell in the product lanes) or
  // generic; a backward may instead be the fused one with a reduce-scatter (rnn_scatter_kernel.cuh).
  // On the grid layout, fused: W_hh in registers (rnn_forward_grid_regs_kernel,
  // rnn_backward_grid_regs_kernel).
  bool fused = false, scatter = false;
  bool wide = false;  // cluster, fused: the kernels with twice the chunks per lane (fused_chunks)
  int64_t smem = 0;
  int regs_rows = 0, regs_chunks = 0;  // grid forward, fused: rows and float4 chunks of W_hh per thread
  // Grid forward, weights tf32: the TF32 products on the tensor cores (rnn_grid_tf32_kernels.cuh; then
  // fused is set too: W_hh is in registers).
  bool tf32 = false;
  // Grid, weights tf32: W_hh and h (forward) or the gate gradients (backward) in 16 bits, fp16 MMAs
  // (rnn_forward_grid_half_kernel, rnn_backward_grid_half_kernel; fused is set too).
  bool half = false;
  bool same_layout(const LaunchPlan& o) const {
    return sync == o.sync && nc == o.nc && hs == o.hs && bs == o.bs && groups == o.groups;
  }
};

struct LayerPlan {
  bool ok = false;
  std::string why_not;  // when !ok: why the kernels cannot hold this layer
  LaunchPlan forward, backward;
  // Weights bf16 on the tf32 plan: W_hh rounded to bfloat16 once a call, then the tf32 kernels (which
  // measured faster than those holding W_hh in bfloat16 wherever both held the layer).
  bool bf16_as_tf32 = false;
  std::string describe() const;
};

// Never throws: a layer the kernels cannot hold is a plan with ok = false. max_blocks > 0: the plan
// uses at most that many SMs (one block per SM), so that another launch can run beside it.
LayerPlan plan_layer(Cell cell, Weights weights, int64_t hidden, int64_t batch, int device, int64_t max_blocks = 0);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_run(
    const LayerPlan& plan, const Sizes& sizes, const at::Tensor& xproj, const at::Tensor& w_hh,
    const std::optional<at::Tensor>& b_hh, const at::Tensor& h0, const std::optional<at::Tensor>& c0,
    const at::Tensor& lengths, bool reverse);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_run(
    const LayerPlan& plan, const Sizes& sizes, const at::Tensor& w_hh, const at::Tensor& y, const at::Tensor& saved,
    const at::Tensor& cs, const at::Tensor& h0, const std::optional<at::Tensor>& c0, const at::Tensor& lengths,
    const std::optional<at::Tensor>& dy, const std::optional<at::Tensor>& dh_n, const std::optional<at::Tensor>& dc_n,
    bool reverse);

}  // namespace rnn

}  // namespace vlseq
