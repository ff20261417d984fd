#include "job_tables.cuh"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <type_traits>

#include "reduce_kernels.cuh"

namespace vlseq {
namespace {

template <int R>
void launch_r(const Job& job, int device, int rank, int nranks, double scale, bool divide) {
  using reduce::Seg;
  std::vector<Seg<R>> segs(job.segs.size());
  for (size_t i = 0; i < segs.size(); ++i) {
    const HostSeg& h = job.segs[i];
    bool ok = true;
    for (int j = 0; j < R; ++j) {
      segs[i].src[j] = h.src[j];
      segs[i].dst[j] = h.dst[j];
      if (j < job.nsrc) ok = ok && is_aligned(reinterpret_cast<const void*>(h.src[j]), 16);
      if (j < job.ndst) ok = ok && is_aligned(reinterpret_cast<const void*>(h.dst[j]), 16);
    }
    segs[i].numel = h.numel;
    segs[i].vec_ok = ok;
  }
  // Every rank splits the same concatenation at the same points (cut() in multi_tensor.cuh), so
  // rank r's share is the same element range of every buffer.
  const int64_t total = assign_begins(segs);
  const int64_t lo = total * rank / nranks;
  const int64_t hi = total * (rank + 1) / nranks;
  if (hi <= lo) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, job.dtype, "vlseq_reduce", [&] {
    with_table<reduce::kInlineSegments>(segs, device, [&](const auto& table) {
      const auto kernel = reduce::reduce_kernel<scalar_t, R, std::decay_t<decltype(table)>>;
      static const int per_sm = blocks_per_sm(kernel, reduce::kThreads);
      const Split split = split_for(device, per_sm, hi - lo, reduce::kMinWindow, reduce::kMaxWindow);
      kernel<<<split.grid, reduce::kThreads, 0, stream>>>(table, job.nsrc, job.ndst, job.nresult, lo, hi,
                                                          split.window, scale, divide);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace

void launch(const Job& job, int device, int rank, int nranks, double scale, bool divide,
            c10::cuda::OptionalCUDAGuard& guard) {
  guard.set_index(static_cast<c10::DeviceIndex>(device));
  const int r = std::max(job.nsrc, job.ndst);
  if (r <= 1) launch_r<1>(job, device, rank, nranks, scale, divide);
  else if (r <= 2) launch_r<2>(job, device, rank, nranks, scale, divide);
  else if (r <= 4) launch_r<4>(job, device, rank, nranks, scale, divide);
  else launch_r<kMaxRanks>(job, device, rank, nranks, scale, divide);
}

void add_segment(std::vector<Job>& jobs, at::ScalarType dtype, const HostSeg& s, int nsrc, int ndst, int nresult) {
  for (Job& job : jobs) {
    if (job.dtype == dtype) {
      job.segs.push_back(s);
      return;
    }
  }
  Job job;
  job.dtype = dtype;
  job.nsrc = nsrc;
  job.ndst = ndst;
  job.nresult = nresult;
  job.segs.push_back(s);
  jobs.push_back(std::move(job));
}

std::vector<Job> list_jobs(at::TensorList tensors, int N, int64_t P, int ndst, int nresult) {
  std::vector<Job> jobs;
  for (int64_t p = 0; p < P; ++p) {
    if (tensors[p].numel() == 0) continue;
    HostSeg s;
    s.numel = tensors[p].numel();
    for (int d = 0; d < N; ++d) s.src[d] = s.dst[d] = addr(tensors[d * P + p]);
    add_segment(jobs, tensors[p].scalar_type(), s, N, ndst, nresult);
  }
  return jobs;
}

std::vector<int> devices_of(at::TensorList bufs) {
  std::vector<int> devs;
  for (const auto& b : bufs) devs.push_back(b.get_device());
  return devs;
}

}  // namespace vlseq
