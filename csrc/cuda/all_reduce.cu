// Single-process multi-GPU reductions over direct peer loads/stores (NVLink): all_reduce_,
// all_reduce_tensors_, reduce_tensors_ and p2p_status. Kernel: reduce_kernels.cuh; job tables:
// job_tables.cu; broadcasts: broadcast.cu.
//
// Cross-GPU protocol (who waits on whom, and why every buffer is safe to reuse)
// ------------------------------------------------------------------------------
// All ordering uses one CUDA event per device, recorded on and waited by each device's *current*
// stream; the host never blocks (peer.h). Each takes a device list and visits every distinct
// device once (reduce_tensors_ lists may share a device).
//   barrier(devs):      every stream waits until every other stream reached this point.
//   gather(root, devs): root's stream waits for every other stream.
//   release(root, devs): every other stream waits for root's stream.
//
// root (small buffers; the default for a model's gradients): ONE kernel, on the first device,
//   reads every buffer in rank order 0..N-1 and stores the result into every buffer (peer stores).
//     gather:  the root reads no buffer before the work that produced it (on its device's
//              stream) finished.
//     release: no device reads or overwrites its buffer before the root finished reading and
//              writing it. One launch and 2(N-1) event operations in all: the cheapest on the
//              host, which is what bounds small reductions.
// two_shot (large buffers): element range r is *owned* by rank r, which reads range r of every
//   buffer and writes the result into range r of every buffer. Range r of any buffer is touched
//   by rank r alone, so the in-place update needs no scratch and no mid-way sync.
//     barrier (entry): no rank reads a buffer before its producer finished.
//     barrier (exit):  a device proceeds only when every peer finished writing into and reading
//                      from its buffer.
// one_shot: rank r reads all of every buffer and writes the sum into its own scratch S_r (no peer
//   touches it); barrier; then copies S_r into its buffer. Entry barrier as above; the middle
//   barrier guarantees every peer finished reading buffer r before rank r overwrites it. S_r
//   goes back to the caching allocator on r's stream, which reuses it only for later work there.
// copy_engine (no peer access, or VLSEQ_DISABLE_P2P=1): barrier; rank r pulls every peer buffer
//   into local staging with cudaMemcpyPeerAsync; barrier (every peer finished copying buffer r
//   out); rank r reduces locally, in place, in the same order. Nothing of a peer touches buffer r
//   afterwards, so no exit barrier.
// reduce_tensors_: as root, but the result goes to the root's tensors only and the other
//   lists' tensors are zeroed (the trainer's merge: the master steps, replicas restart at 0).
//   Several lists may be on one device (e.g. the gradients of several streams): the kernel reads
//   every list; gather/release order each distinct device's current stream once, so work of
//   other streams must be ordered with the current one by the caller.
//
// Every algorithm sums in rank order 0..N-1 in fp32 (fp64 for double) and rounds once, so all
// ranks, all algorithms and all runs give identical bits.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "entry.h"
#include "env.h"
#include "job_tables.cuh"
#include "peer.h"
#include "vlseq/algo.h"

namespace vlseq {
namespace {

// Crossover for `auto`, in bytes per buffer: root up to root_max, two_shot above. For 2 GPUs it
// is measured on 2xH200 (BENCHMARKS.md, "crossover": root wins up to 1 MB, two_shot from 4 MB).
// For more GPUs the root reads and writes N-1 peers alone, so the crossover comes earlier; 256 KB
// is an estimate until a 4/8-GPU run measures it. VLSEQ_ROOT_MAX_BYTES overrides.
int64_t root_max_bytes(int nranks) {
  const int64_t from_env = env::root_max_bytes();
  if (from_env >= 0) return from_env;
  return nranks <= 2 ? (1 << 20) : (256 << 10);
}

// Resolves `auto` and degrades the peer algorithms to copy_engine when peer access is missing.
Algo resolve_algo(Algo algo, const std::vector<int>& devs, int64_t bytes) {
  std::string why;
  if (!peer::all_can_access(devs, &why)) {
    if (algo != Algo::kCopyEngine) {
      TORCH_WARN_ONCE("vlseq_ext: peer access unavailable (", why,
                      "); multi-GPU reductions use copy-engine transfers (cudaMemcpyPeerAsync) plus a local add");
    }
    return Algo::kCopyEngine;
  }
  if (algo != Algo::kAuto) return algo;
  return bytes <= root_max_bytes(static_cast<int>(devs.size())) ? Algo::kRoot : Algo::kTwoShot;
}

// The all-reduce of per-device segment lists behind every reduce op. `jobs` hold N sources and N
// destinations (the same tensors). Caller holds peer::op_mutex(). Result: divide ? sum/N : sum*scale.
void all_reduce_jobs(const std::vector<Job>& jobs, const std::vector<int>& devs, Algo algo, bool divide,
                     double scale, c10::cuda::OptionalCUDAGuard& guard) {
  const int N = static_cast<int>(devs.size());
  const int root = devs[0];
  switch (algo) {
    case Algo::kRoot:
      peer::gather(root, devs, guard);
      for (const Job& job : jobs) run_on(job, root, scale, divide, guard);
      peer::release(root, devs, guard);
      return;
    case Algo::kTwoShot:
      peer::barrier(devs, guard);
      for (int r = 0; r < N; ++r)
        for (const Job& job : jobs) launch(job, devs[r], r, N, scale, divide, guard);
      peer::barrier(devs, guard);
      return;
    default:
      TORCH_CHECK(false, "vlseq_ext: internal error: all_reduce_jobs got an unsupported algorithm");
  }
}

// Flat buffers: every algorithm. Caller holds peer::op_mutex().
void flat_all_reduce(const std::vector<at::Tensor>& bufs, Algo algo, bool divide, double scale) {
  c10::cuda::OptionalCUDAGuard guard;
  const int N = static_cast<int>(bufs.size());
  const std::vector<int> devs = devices_of(bufs);
  const int64_t n = bufs[0].numel();
  if (n == 0) return;
  Job all;
  all.dtype = bufs[0].scalar_type();
  all.nsrc = all.ndst = all.nresult = N;
  HostSeg s;
  s.numel = n;
  for (int r = 0; r < N; ++r) s.src[r] = s.dst[r] = addr(bufs[r]);
  all.segs.push_back(s);
  if (N == 1) {
    if (divide || scale != 1.0) run_on(all, devs[0], scale, divide, guard);
    return;
  }
  algo = resolve_algo(algo, devs, n * bufs[0].element_size());
  if (algo == Algo::kRoot || algo == Algo::kTwoShot) {
    all_reduce_jobs({all}, devs, algo, divide, scale, guard);
    return;
  }
  const int64_t bytes = n * bufs[0].element_size();
  if (algo == Algo::kOneShot) {
    std::vector<at::Tensor> scratch(N);
    peer::barrier(devs, guard);
    for (int r = 0; r < N; ++r) {
      guard.set_index(static_cast<c10::DeviceIndex>(devs[r]));
      scratch[r] = at::empty_like(bufs[r]);
      Job job = all;
      job.ndst = job.nresult = 1;
      job.segs[0].dst[0] = addr(scratch[r]);
      run_on(job, devs[r], scale, divide, guard);
    }
    peer::barrier(devs, guard);
    for (int r = 0; r < N; ++r) {
      guard.set_index(static_cast<c10::DeviceIndex>(devs[r]));
      C10_CUDA_CHECK(cudaMemcpyAsync(bufs[r].data_ptr(), scratch[r].data_ptr(), bytes, cudaMemcpyDeviceToDevice,
                                     c10::cuda::getCurrentCUDAStream(devs[r])));
    }
    return;
  }
  // copy engine
  std::vector<at::Tensor> staging(N);
  peer::barrier(devs, guard);
  for (int r = 0; r < N; ++r) {
    guard.set_index(static_cast<c10::DeviceIndex>(devs[r]));
    staging[r] = at::empty({N - 1, n}, bufs[r].options());
    int slot = 0;
    for (int j = 0; j < N; ++j) {
      if (j == r) continue;
      C10_CUDA_CHECK(cudaMemcpyPeerAsync(staging[r][slot++].data_ptr(), devs[r], bufs[j].data_ptr(), devs[j], bytes,
                                         c10::cuda::getCurrentCUDAStream(devs[r])));
    }
  }
  peer::barrier(devs, guard);
  for (int r = 0; r < N; ++r) {
    Job job = all;
    job.ndst = job.nresult = 1;
    int slot = 0;
    for (int j = 0; j < N; ++j) job.segs[0].src[j] = j == r ? addr(bufs[r]) : addr(staging[r][slot++]);
    job.segs[0].dst[0] = addr(bufs[r]);
    run_on(job, devs[r], scale, divide, guard);
  }
}

// Without peer access: per dtype, concatenate every list's tensors, copy-engine all-reduce
// (same order and epilogue, hence the same bits), copy back.
void all_reduce_tensors_copy_engine(at::TensorList tensors, int64_t N, int64_t P, double scale) {
  std::set<at::ScalarType> types;
  for (int64_t p = 0; p < P; ++p) types.insert(tensors[p].scalar_type());
  for (at::ScalarType type : types) {
    std::vector<at::Tensor> flats;
    for (int64_t d = 0; d < N; ++d) {
      std::vector<at::Tensor> views;
      for (int64_t p = 0; p < P; ++p)
        if (tensors[p].scalar_type() == type) views.push_back(tensors[d * P + p].view(-1));
      c10::cuda::CUDAGuard g(views[0].device());
      flats.push_back(at::cat(views));
    }
    flat_all_reduce(flats, Algo::kCopyEngine, false, scale);
    for (int64_t d = 0; d < N; ++d) {
      c10::cuda::CUDAGuard g(flats[d].device());
      int64_t off = 0;
      for (int64_t p = 0; p < P; ++p) {
        if (tensors[p].scalar_type() != type) continue;
        const at::Tensor& t = tensors[d * P + p];
        t.view(-1).copy_(flats[d].narrow(0, off, t.numel()));
        off += t.numel();
      }
    }
  }
}

std::vector<int> list_devices(at::TensorList tensors, int N, int64_t P) {
  std::vector<int> devs;
  for (int d = 0; d < N; ++d) devs.push_back(tensors[d * P].get_device());
  return devs;
}

}  // namespace

void all_reduce_run(at::TensorList buffers, bool mean, Algo algo) {
  if (buffers.size() == 1) return;  // sum or mean of one buffer is the buffer
  std::lock_guard<std::mutex> lock(peer::op_mutex());
  flat_all_reduce(buffers.vec(), algo, mean, 1.0);
}

void all_reduce_tensors_run(at::TensorList tensors, int64_t num_devices, double scale, Algo a) {
  const int64_t P = static_cast<int64_t>(tensors.size()) / num_devices;
  const int N = static_cast<int>(num_devices);
  const std::vector<int> devs = list_devices(tensors, N, P);
  if (N == 1 && scale == 1.0) return;
  std::lock_guard<std::mutex> lock(peer::op_mutex());
  int64_t bytes = 0;
  for (int64_t p = 0; p < P; ++p) bytes += tensors[p].numel() * tensors[p].element_size();
  if (N > 1) a = resolve_algo(a, devs, bytes);
  if (a == Algo::kCopyEngine) {
    all_reduce_tensors_copy_engine(tensors, N, P, scale);
    return;
  }
  const std::vector<Job> jobs = list_jobs(tensors, N, P, N, N);
  if (jobs.empty()) return;
  c10::cuda::OptionalCUDAGuard guard;
  if (N == 1) {
    for (const Job& job : jobs) run_on(job, devs[0], scale, false, guard);
    return;
  }
  all_reduce_jobs(jobs, devs, a, false, scale, guard);
}

void reduce_tensors_run(at::TensorList tensors, int64_t num_devices, double scale, bool zero_others) {
  const int64_t P = static_cast<int64_t>(tensors.size()) / num_devices;
  const int N = static_cast<int>(num_devices);
  const std::vector<int> devs = list_devices(tensors, N, P);
  std::lock_guard<std::mutex> lock(peer::op_mutex());
  std::string why;
  if (N > 1 && !peer::all_can_access(devs, &why)) {
    // Same bits the slow way: all-reduce over the copy engine, then zero the others.
    TORCH_WARN_ONCE("vlseq_ext: reduce_tensors_: peer access unavailable (", why, "); using copy-engine transfers");
    all_reduce_tensors_copy_engine(tensors, N, P, scale);
    if (zero_others) {
      for (int64_t i = P; i < static_cast<int64_t>(tensors.size()); ++i) {
        c10::cuda::CUDAGuard g(tensors[i].device());
        tensors[i].zero_();
      }
    }
    return;
  }
  const std::vector<Job> jobs = list_jobs(tensors, N, P, zero_others ? N : 1, 1);
  if (jobs.empty() || (N == 1 && scale == 1.0)) return;
  c10::cuda::OptionalCUDAGuard guard;
  peer::gather(devs[0], devs, guard);
  for (const Job& job : jobs) run_on(job, devs[0], scale, false, guard);
  peer::release(devs[0], devs, guard);
}

std::string p2p_status_run(at::TensorList buffers) {
  if (buffers.size() == 1) return "single";
  std::string why;
  std::lock_guard<std::mutex> lock(peer::op_mutex());
  if (peer::all_can_access(devices_of(buffers), &why)) return "p2p";
  return "copy_engine: " + why;
}

}  // namespace vlseq
