// Host-side job tables for the reduction kernel (reduce_kernels.cuh): which tensors a launch
// reads and writes, built per op by all_reduce.cu and broadcast.cu.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <vector>

#include "vlseq/limits.h"

namespace vlseq {

// One tensor position as the host builds it: the addresses of its sources and destinations.
struct HostSeg {
  int64_t src[kMaxRanks] = {};
  int64_t dst[kMaxRanks] = {};
  int64_t numel = 0;
};

// A reduce/copy job of one element type: the same table, launched on one device or split over
// several (two_shot). dst[j] for j >= nresult receive zeros.
struct Job {
  at::ScalarType dtype = at::kFloat;
  std::vector<HostSeg> segs;
  int nsrc = 0;
  int ndst = 0;
  int nresult = 0;
};

inline int64_t addr(const at::Tensor& t) { return reinterpret_cast<int64_t>(t.data_ptr()); }

// Launches the share rank/nranks of `job` on `device`'s current stream (switching through `guard`).
void launch(const Job& job, int device, int rank, int nranks, double scale, bool divide,
            c10::cuda::OptionalCUDAGuard& guard);

// Launches a job that `device` runs whole.
inline void run_on(const Job& job, int device, double scale, bool divide, c10::cuda::OptionalCUDAGuard& guard) {
  launch(job, device, 0, 1, scale, divide, guard);
}

// Adds a segment to the job of its element type (one launch per type present; a model's
// gradients usually share one type).
void add_segment(std::vector<Job>& jobs, at::ScalarType dtype, const HostSeg& s, int nsrc, int ndst, int nresult);

// Jobs for tensors laid out list-major (N lists of P): source and destination j of position p
// is tensors[j * P + p]; empty positions are left out.
std::vector<Job> list_jobs(at::TensorList tensors, int N, int64_t P, int ndst, int nresult);

std::vector<int> devices_of(at::TensorList bufs);

}  // namespace vlseq
