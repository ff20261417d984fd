// Single-process multi-GPU reductions and broadcasts over direct peer loads/stores (NVLink).
//
// Cross-GPU protocol (who waits on whom, and why every buffer is safe to reuse)
// ------------------------------------------------------------------------------
// All ordering uses one CUDA event per device, recorded on and waited by each device's *current*
// stream; the host never blocks (peer.h).
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
//   devices' tensors are zeroed (the trainer's merge: the master steps, replicas restart at 0).
// broadcast: gather (destinations are not in use), one kernel on the source device stores into
//   every destination, release (destinations are complete; the source may change).
//
// Every algorithm sums in rank order 0..N-1 in fp32 (fp64 for double) and rounds once, so all
// ranks, all algorithms and all runs give identical bits.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "peer.h"
#include "vlseq/algo.h"
#include "vlseq/dtypes.h"
#include "vlseq/multi_tensor.cuh"
#include "entry.h"

namespace vlseq {
namespace {


constexpr int kThreads = 512;
constexpr int kInlineSegments = 16;
constexpr int64_t kMinWindow = 1024;  // elements: smaller windows only add scheduling
constexpr int64_t kMaxWindow = 4096;  // swept 2K-64K on the H200: 4K was best (BENCHMARKS.md)

// Device-side description of one tensor position with up to R sources and R destinations. R is
// the smallest of 1, 2, 4, 8 that fits, so a 2-GPU launch carries 56-byte rows, not 152-byte
// ones (the parameter block is copied on every launch).
template <int R>
struct Seg {
  int64_t src[R];
  int64_t dst[R];
  int64_t numel;
  int64_t begin;  // start in the launch's work split
  int64_t vec_ok;
};

template <typename T>
struct Epilogue {
  using Acc = opmath_t<T, T>;
  Acc scale;
  Acc count;
  bool divide;  // mean: divide by the number of sources rather than multiply by scale
  __device__ __forceinline__ T operator()(Acc a) const { return cvt<T>(divide ? a / count : a * scale); }
};

// Sums `nsrc` (<= R) sources in order for elements [begin, begin + n) of a segment; destinations
// j < nresult get the result, the rest get zeros. The vector path issues the loads of kU vectors
// from every source before the first add and store: stores may alias the sources (in place), so
// the compiler could not hoist later loads above them by itself.
template <typename T, int R>
__device__ __forceinline__ void reduce_piece(const Seg<R>& seg, int64_t begin, int64_t n, int nsrc, int ndst,
                                             int nresult, const Epilogue<T>& epi) {
  using Acc = typename Epilogue<T>::Acc;
  constexpr int VEC = 16 / sizeof(T);
  constexpr int kU = R >= 4 ? 1 : 4 / R;  // about 4 vectors in flight per thread
  using V = Vec<T, VEC>;
  const T* src[R];
#pragma unroll
  for (int j = 0; j < R; ++j) src[j] = reinterpret_cast<const T*>(seg.src[j < nsrc ? j : 0]) + begin;
  int64_t done = 0;
  if (seg.vec_ok) {
    const int64_t nv = n / VEC;
    V zero;
#pragma unroll
    for (int k = 0; k < VEC; ++k) zero.v[k] = T(0);
    for (int64_t base = threadIdx.x; base < nv; base += int64_t{kThreads} * kU) {
      V x[kU][R];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t v = base + u * kThreads;
#pragma unroll
        for (int j = 0; j < R; ++j)
          if (v < nv && j < nsrc) x[u][j] = reinterpret_cast<const V*>(src[j])[v];
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t v = base + u * kThreads;
        if (v >= nv) break;
        Acc acc[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] = cvt<Acc>(x[u][0].v[k]);
#pragma unroll
        for (int j = 1; j < R; ++j)
          if (j < nsrc) {
#pragma unroll
            for (int k = 0; k < VEC; ++k) acc[k] += cvt<Acc>(x[u][j].v[k]);
          }
        V out;
#pragma unroll
        for (int k = 0; k < VEC; ++k) out.v[k] = epi(acc[k]);
#pragma unroll
        for (int j = 0; j < R; ++j)
          if (j < ndst) reinterpret_cast<V*>(reinterpret_cast<T*>(seg.dst[j]) + begin)[v] = j < nresult ? out : zero;
      }
    }
    done = nv * VEC;
  }
  for (int64_t k = done + threadIdx.x; k < n; k += kThreads) {
    Acc acc = cvt<Acc>(src[0][k]);
    for (int j = 1; j < nsrc; ++j) acc += cvt<Acc>(src[j][k]);
    const T r = epi(acc);
    for (int j = 0; j < ndst; ++j) reinterpret_cast<T*>(seg.dst[j])[begin + k] = j < nresult ? r : T(0);
  }
}

// Processes elements [lo, hi) of the table's concatenation; every segment has element type T.
template <typename T, int R, typename Table>
__global__ void __launch_bounds__(kThreads)
    reduce_kernel(const __grid_constant__ Table table, int nsrc, int ndst, int nresult, int64_t lo, int64_t hi,
                  int64_t window, double scale, bool divide) {
  using Acc = typename Epilogue<T>::Acc;
  const Epilogue<T> epi{static_cast<Acc>(scale), static_cast<Acc>(nsrc), divide};
  for_each_piece(table, lo, hi, window, [&](const Seg<R>& seg, int64_t begin, int64_t n) {
    reduce_piece<T, R>(seg, begin, n, nsrc, ndst, nresult, epi);
  });
}

// ---------------------------------------------------------------------------------------------
// Host side

// One tensor position as the host builds it.
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

int64_t addr(const at::Tensor& t) { return reinterpret_cast<int64_t>(t.data_ptr()); }

template <int R>
void launch_r(const Job& job, int device, int rank, int nranks, double scale, bool divide) {
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
    with_table<kInlineSegments>(segs, device, [&](const auto& table) {
      const auto kernel = reduce_kernel<scalar_t, R, std::decay_t<decltype(table)>>;
      static const int per_sm = blocks_per_sm(kernel, kThreads);
      const Split split = split_for(device, per_sm, hi - lo, kMinWindow, kMaxWindow);
      kernel<<<split.grid, kThreads, 0, stream>>>(table, job.nsrc, job.ndst, job.nresult, lo, hi, split.window, scale,
                                                  divide);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

// Launches the share rank/nranks of `job` on `device`'s current stream.
void launch(const Job& job, int device, int rank, int nranks, double scale, bool divide,
            c10::cuda::OptionalCUDAGuard& guard) {
  guard.set_index(static_cast<c10::DeviceIndex>(device));
  const int r = std::max(job.nsrc, job.ndst);
  if (r <= 1) launch_r<1>(job, device, rank, nranks, scale, divide);
  else if (r <= 2) launch_r<2>(job, device, rank, nranks, scale, divide);
  else if (r <= 4) launch_r<4>(job, device, rank, nranks, scale, divide);
  else launch_r<kMaxRanks>(job, device, rank, nranks, scale, divide);
}

// Launches a job that `device` runs whole.
void run_on(const Job& job, int device, double scale, bool divide, c10::cuda::OptionalCUDAGuard& guard) {
  launch(job, device, 0, 1, scale, divide, guard);
}

// Adds a segment to the job of its element type (one launch per type present; a model's
// gradients usually share one type).
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

std::vector<int> devices_of(at::TensorList bufs) {
  std::vector<int> devs;
  for (const auto& b : bufs) devs.push_back(b.get_device());
  return devs;
}

// Crossover for `auto`, in bytes per buffer: root up to root_max, two_shot above. For 2 GPUs it
// is measured on 2xH200 (BENCHMARKS.md, "crossover": root wins up to 1 MB, two_shot from 4 MB).
// For more GPUs the root reads and writes N-1 peers alone, so the crossover comes earlier; 256 KB
// is an estimate until a 4/8-GPU run measures it. VLSEQ_ROOT_MAX_BYTES overrides.
int64_t root_max_bytes(int nranks) {
  static const int64_t from_env = [] {
    const char* env = std::getenv("VLSEQ_ROOT_MAX_BYTES");
    return env != nullptr ? std::atoll(env) : int64_t{-1};
  }();
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

}  // namespace

void all_reduce_run(at::TensorList buffers, bool mean, Algo algo) {
  if (buffers.size() == 1) return;  // sum or mean of one buffer is the buffer
  std::lock_guard<std::mutex> lock(peer::op_mutex());
  flat_all_reduce(buffers.vec(), algo, mean, 1.0);
}

namespace {

// Without peer access: per dtype, concatenate every device's tensors, copy-engine all-reduce
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

// Segment lists for tensors laid out device-major (N lists of P).
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

}  // namespace

void all_reduce_tensors_run(at::TensorList tensors, int64_t num_devices, double scale, Algo a) {
  const int64_t P = static_cast<int64_t>(tensors.size()) / num_devices;
  const int N = static_cast<int>(num_devices);
  std::vector<int> devs;
  for (int d = 0; d < N; ++d) devs.push_back(tensors[d * P].get_device());
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
  std::vector<int> devs;
  for (int d = 0; d < N; ++d) devs.push_back(tensors[d * P].get_device());
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

// Copies srcs (on the root device) into each destination list; protocol in the file comment.
void broadcast_run(const char* op, at::TensorList srcs, at::TensorList dsts) {
  const int64_t P = static_cast<int64_t>(srcs.size());
  const int64_t lists = static_cast<int64_t>(dsts.size()) / P;
  const int root = srcs[0].get_device();
  std::vector<int> devs{root};
  for (int64_t d = 0; d < lists; ++d) {
    const int dev = dsts[d * P].get_device();
    if (std::find(devs.begin(), devs.end(), dev) == devs.end()) devs.push_back(dev);
  }
  std::lock_guard<std::mutex> lock(peer::op_mutex());
  c10::cuda::OptionalCUDAGuard guard;
  std::string why;
  bool direct = true;
  for (int d : devs) direct = direct && peer::can_access(root, d, &why);
  peer::gather(root, devs, guard);
  if (direct) {
    // Up to kMaxRanks destinations per launch, all written by one kernel on the root.
    for (int64_t first = 0; first < lists; first += kMaxRanks) {
      const int64_t count = std::min<int64_t>(kMaxRanks, lists - first);
      std::vector<Job> jobs;
      for (int64_t p = 0; p < P; ++p) {
        if (srcs[p].numel() == 0) continue;
        HostSeg s;
        s.numel = srcs[p].numel();
        s.src[0] = addr(srcs[p]);
        for (int64_t j = 0; j < count; ++j) s.dst[j] = addr(dsts[(first + j) * P + p]);
        add_segment(jobs, srcs[p].scalar_type(), s, 1, static_cast<int>(count), static_cast<int>(count));
      }
      for (const Job& job : jobs) run_on(job, root, 1.0, false, guard);
    }
  } else {
    TORCH_WARN_ONCE("vlseq_ext: ", op, ": peer access unavailable (", why, "); using copy-engine transfers");
    guard.set_index(static_cast<c10::DeviceIndex>(root));
    for (int64_t i = 0; i < static_cast<int64_t>(dsts.size()); ++i) {
      const at::Tensor& src = srcs[i % P];
      if (src.numel() == 0 || dsts[i].data_ptr() == src.data_ptr()) continue;
      C10_CUDA_CHECK(cudaMemcpyPeerAsync(dsts[i].data_ptr(), dsts[i].get_device(), src.data_ptr(), root,
                                         src.numel() * src.element_size(), c10::cuda::getCurrentCUDAStream(root)));
    }
  }
  peer::release(root, devs, guard);
}

std::string p2p_status_run(at::TensorList buffers) {
  if (buffers.size() == 1) return "single";
  std::string why;
  std::lock_guard<std::mutex> lock(peer::op_mutex());
  if (peer::all_can_access(devices_of(buffers), &why)) return "p2p";
  return "copy_engine: " + why;
}

}  // namespace vlseq
