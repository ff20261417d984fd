// Single-process multi-GPU all-reduce and broadcast over direct peer loads/stores (NVLink).
//
// Cross-GPU protocol (who waits on whom, and why every buffer is safe to reuse)
// ------------------------------------------------------------------------------
// All ordering uses one CUDA event per device on each device's *current* stream; the host never
// blocks. `barrier(devs)` = every stream records its event, then every stream waits on every
// other's. After a barrier, no stream runs ahead of work that any other stream queued before it.
//
// two_shot (large buffers; also the fused multi-tensor all_reduce_tensors_):
//   The element range is cut into chunks and chunk range r is *owned* by rank r. Rank r reads
//   range r of every buffer (in rank order 0..N-1), and writes the result into range r of every
//   buffer (peer stores). Range r of any buffer is touched by rank r alone, so the in-place update
//   needs no scratch space and no mid-way sync.
//     barrier #1 (entry): no rank reads a buffer before its producer on that device's stream
//                         finished.
//     kernels
//     barrier #2 (exit):  a device's stream proceeds only when every peer has finished writing
//                         into its buffer and reading from it, so the caller's next kernel (or
//                         our next call) can read or overwrite the buffer at once.
// one_shot (small buffers):
//   Rank r reads all of every buffer and writes the sum into its own scratch S_r, which no peer
//   touches; then copies S_r into its buffer.
//     barrier #1 (entry) as above; kernels; barrier #2: every peer finished reading buffer r
//     before rank r overwrites it with S_r. S_r is freed to the caching allocator on rank r's
//     stream, which only reuses it for work ordered after the copy.
// copy_engine (no peer access, or VLSEQ_DISABLE_P2P=1):
//   barrier #1; rank r pulls every peer buffer into local staging with cudaMemcpyPeerAsync;
//   barrier #2 (every peer finished copying buffer r out); rank r reduces locally, in place, in
//   the same order 0..N-1. No work of a peer touches buffer r afterwards, so no exit barrier.
// broadcast: destinations wait on the source's event; the source's stream then waits on every
//   destination, so the source is never overwritten while a peer still reads it.
//
// Every algorithm sums in rank order 0..N-1 in fp32 (fp64 for double) and rounds once, so all
// ranks, all algorithms and all runs give identical bits.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "peer.h"
#include "vlseq/algo.h"
#include "vlseq/dtypes.h"
#include "vlseq/multi_tensor.cuh"
#include "vlseq/validate.h"

namespace vlseq {
namespace {

constexpr int kMaxRanks = 8;
constexpr int kThreads = 512;
constexpr int kBlocksPerSm = 4;
constexpr int kInlineSegments = 12;

// One tensor position: `src` are summed in order, the result goes to every `dst`.
struct ReduceSegment {
  int64_t src[kMaxRanks];
  int64_t dst[kMaxRanks];
  int64_t numel;
  int64_t chunk_begin;
  int32_t vec_ok;
};

template <typename T>
struct Epilogue {
  using Acc = opmath_t<T, T>;
  Acc scale;
  Acc count;
  bool divide;  // mean: divide by the number of sources rather than multiply by scale
  __device__ __forceinline__ T operator()(Acc a) const { return cvt<T>(divide ? a / count : a * scale); }
};

// Sums `nsrc` (<= kMaxSrc) sources in order into every destination, for elements
// [begin, begin + n) of a segment. The vector path issues the loads of kU vectors from every
// source before the first add and store: stores may alias the sources (in-place), so the
// compiler could not hoist later loads above them by itself.
template <typename T, int kMaxSrc>
__device__ __forceinline__ void reduce_chunk(const ReduceSegment& seg, int64_t begin, int64_t n, int nsrc, int ndst,
                                             const Epilogue<T>& epi) {
  using Acc = typename Epilogue<T>::Acc;
  constexpr int VEC = 16 / sizeof(T);
  constexpr int kU = kMaxSrc >= 4 ? 1 : 4 / kMaxSrc;  // about 4 vectors in flight per thread
  using V = Vec<T, VEC>;
  const T* src[kMaxSrc];
#pragma unroll
  for (int j = 0; j < kMaxSrc; ++j) src[j] = reinterpret_cast<const T*>(seg.src[j < nsrc ? j : 0]) + begin;
  int64_t done = 0;
  if (seg.vec_ok) {
    const int64_t nv = n / VEC;
    for (int64_t base = threadIdx.x; base < nv; base += int64_t{kThreads} * kU) {
      V x[kU][kMaxSrc];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t v = base + u * kThreads;
#pragma unroll
        for (int j = 0; j < kMaxSrc; ++j)
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
        for (int j = 1; j < kMaxSrc; ++j)
          if (j < nsrc) {
#pragma unroll
            for (int k = 0; k < VEC; ++k) acc[k] += cvt<Acc>(x[u][j].v[k]);
          }
        V out;
#pragma unroll
        for (int k = 0; k < VEC; ++k) out.v[k] = epi(acc[k]);
        for (int j = 0; j < ndst; ++j) reinterpret_cast<V*>(reinterpret_cast<T*>(seg.dst[j]) + begin)[v] = out;
      }
    }
    done = nv * VEC;
  }
  for (int64_t k = done + threadIdx.x; k < n; k += kThreads) {
    Acc acc = cvt<Acc>(src[0][k]);
    for (int j = 1; j < nsrc; ++j) acc += cvt<Acc>(reinterpret_cast<const T*>(seg.src[j])[begin + k]);
    const T r = epi(acc);
    for (int j = 0; j < ndst; ++j) reinterpret_cast<T*>(seg.dst[j])[begin + k] = r;
  }
}

// Processes chunks [chunk_lo, chunk_hi) of the table; every segment has element type T.
template <typename T, int kMaxSrc, typename Table>
__global__ void __launch_bounds__(kThreads)
    reduce_kernel(const __grid_constant__ Table table, int nsrc, int ndst, int64_t chunk_lo, int64_t chunk_hi,
                  double scale, bool divide) {
  using Acc = typename Epilogue<T>::Acc;
  const Epilogue<T> epi{static_cast<Acc>(scale), static_cast<Acc>(nsrc), divide};
  for (int64_t chunk = chunk_lo + blockIdx.x; chunk < chunk_hi; chunk += gridDim.x) {
    const ReduceSegment& seg = table[find_segment(table, chunk)];
    const int64_t begin = (chunk - seg.chunk_begin) * table.chunk;
    reduce_chunk<T, kMaxSrc>(seg, begin, min(table.chunk, seg.numel - begin), nsrc, ndst, epi);
  }
}

// A reduce/copy job: one segment table, launched on one or several devices, each taking a
// range of its chunks. Built once per call (chunking and alignment) and shared by all launches.
struct Job {
  at::ScalarType dtype = at::kFloat;  // of every segment
  std::vector<ReduceSegment> segs;
  int nsrc = 0;
  int ndst = 0;
  int64_t chunk = 0;
  int64_t chunks = 0;
};

// Computes alignment flags and the chunking; `ranks` devices will share the chunks.
void plan(Job& job, int device, int ranks) {
  int64_t total = 0;
  for (auto& s : job.segs) {
    bool ok = true;
    for (int j = 0; j < job.nsrc; ++j) ok = ok && is_aligned(reinterpret_cast<const void*>(s.src[j]), 16);
    for (int j = 0; j < job.ndst; ++j) ok = ok && is_aligned(reinterpret_cast<const void*>(s.dst[j]), 16);
    s.vec_ok = ok;
    total += s.numel;
  }
  job.chunk = pick_chunk(total, int64_t{sm_count(device)} * kBlocksPerSm * ranks, 1024, 16384);
  job.chunks = assign_chunks(job.segs, job.chunk);
}

// Launches chunks [rank/nranks, (rank+1)/nranks) of `job` on `device`'s current stream.
void launch(const Job& job, int device, int rank, int nranks, double scale, bool divide,
            c10::cuda::OptionalCUDAGuard& guard) {
  const int64_t lo = job.chunks * rank / nranks;
  const int64_t hi = job.chunks * (rank + 1) / nranks;
  if (hi <= lo) return;
  guard.set_index(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  const int grid = grid_for(device, hi - lo, kBlocksPerSm);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, job.dtype, "vlseq_reduce", [&] {
    with_table<kInlineSegments>(job.segs, job.chunk, job.chunks, device, [&](const auto& table) {
      using Table = std::decay_t<decltype(table)>;
      const auto go = [&](auto kernel) {
        kernel<<<grid, kThreads, 0, stream>>>(table, job.nsrc, job.ndst, lo, hi, scale, divide);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if (job.nsrc <= 1) go(reduce_kernel<scalar_t, 1, Table>);
      else if (job.nsrc <= 2) go(reduce_kernel<scalar_t, 2, Table>);
      else if (job.nsrc <= 4) go(reduce_kernel<scalar_t, 4, Table>);
      else go(reduce_kernel<scalar_t, kMaxRanks, Table>);
    });
  });
}

// Appends a segment to the job of its element type (one launch per type; a model's gradients
// usually share one type, so usually one job).
void add_segment(std::vector<Job>& jobs, at::ScalarType dtype, const ReduceSegment& s, int nsrc, int ndst) {
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
  job.segs.push_back(s);
  jobs.push_back(std::move(job));
}

// Plans and launches a job that one device runs whole.
void run_local(Job& job, int device, double scale, bool divide, c10::cuda::OptionalCUDAGuard& guard) {
  plan(job, device, 1);
  launch(job, device, 0, 1, scale, divide, guard);
}

ReduceSegment segment(int64_t numel) {
  ReduceSegment s{};
  s.numel = numel;
  return s;
}

int64_t addr(const at::Tensor& t) { return reinterpret_cast<int64_t>(t.data_ptr()); }

std::vector<int> devices_of(at::TensorList bufs) {
  std::vector<int> devs;
  for (const auto& b : bufs) devs.push_back(b.get_device());
  return devs;
}

// Largest buffer (bytes) for which `auto` picks one_shot, per rank count. Measured on 2xH200
// (BENCHMARKS.md, "one-shot / two-shot crossover"); VLSEQ_ONE_SHOT_MAX_BYTES overrides.
int64_t one_shot_max_bytes(int nranks) {
  static const int64_t from_env = [] {
    const char* env = std::getenv("VLSEQ_ONE_SHOT_MAX_BYTES");
    return env != nullptr ? std::atoll(env) : int64_t{-1};
  }();
  if (from_env >= 0) return from_env;
  return nranks <= 2 ? (64 << 10) : (256 << 10);
}

// Resolves `auto` and degrades peer algorithms to copy_engine when peer access is missing.
Algo resolve_algo(Algo algo, const std::vector<int>& devs, int64_t bytes) {
  std::string why;
  const bool p2p = peer::all_can_access(devs, &why);
  if (!p2p && algo != Algo::kCopyEngine) {
    TORCH_WARN_ONCE("vlseq_ext: peer access unavailable (", why,
                    "); multi-GPU reductions use copy-engine transfers (cudaMemcpyPeerAsync) plus a local add");
    return Algo::kCopyEngine;
  }
  if (algo != Algo::kAuto) return algo;
  return bytes <= one_shot_max_bytes(static_cast<int>(devs.size())) ? Algo::kOneShot : Algo::kTwoShot;
}

// The flat all-reduce behind all_reduce_ and the copy-engine path of all_reduce_tensors_.
// Caller holds peer::op_mutex(). result = divide ? sum / N : sum * scale.
void flat_all_reduce(const std::vector<at::Tensor>& bufs, Algo algo, bool divide, double scale) {
  c10::cuda::OptionalCUDAGuard guard;
  const int N = static_cast<int>(bufs.size());
  const std::vector<int> devs = devices_of(bufs);
  const int64_t n = bufs[0].numel();
  const int64_t bytes = n * bufs[0].element_size();
  if (n == 0) return;
  if (N == 1) {
    if (!divide && scale == 1.0) return;
    Job job;
    job.dtype = bufs[0].scalar_type();
    job.nsrc = job.ndst = 1;
    job.segs.push_back(segment(n));
    job.segs[0].src[0] = job.segs[0].dst[0] = addr(bufs[0]);
    run_local(job, devs[0], scale, divide, guard);
    return;
  }
  algo = resolve_algo(algo, devs, bytes);

  ReduceSegment all = segment(n);
  for (int r = 0; r < N; ++r) all.src[r] = addr(bufs[r]);

  switch (algo) {
    case Algo::kTwoShot: {
      Job job;
      job.dtype = bufs[0].scalar_type();
      job.nsrc = job.ndst = N;
      ReduceSegment s = all;
      for (int r = 0; r < N; ++r) s.dst[r] = addr(bufs[r]);
      job.segs.push_back(s);
      plan(job, devs[0], N);
      peer::barrier(devs, guard);
      for (int r = 0; r < N; ++r) launch(job, devs[r], r, N, scale, divide, guard);
      peer::barrier(devs, guard);
      return;
    }
    case Algo::kOneShot: {
      std::vector<at::Tensor> scratch(N);
      peer::barrier(devs, guard);
      for (int r = 0; r < N; ++r) {
        guard.set_index(static_cast<c10::DeviceIndex>(devs[r]));
        scratch[r] = at::empty_like(bufs[r]);
        Job job;
        job.dtype = bufs[0].scalar_type();
        job.nsrc = N;
        job.ndst = 1;
        ReduceSegment s = all;
        s.dst[0] = addr(scratch[r]);
        job.segs.push_back(s);
        run_local(job, devs[r], scale, divide, guard);
      }
      peer::barrier(devs, guard);
      for (int r = 0; r < N; ++r) {
        guard.set_index(static_cast<c10::DeviceIndex>(devs[r]));
        C10_CUDA_CHECK(cudaMemcpyAsync(bufs[r].data_ptr(), scratch[r].data_ptr(), bytes, cudaMemcpyDeviceToDevice,
                                       c10::cuda::getCurrentCUDAStream(devs[r])));
      }
      return;
    }
    default: {  // copy engine
      std::vector<at::Tensor> staging(N);
      peer::barrier(devs, guard);
      for (int r = 0; r < N; ++r) {
        guard.set_index(static_cast<c10::DeviceIndex>(devs[r]));
        staging[r] = at::empty({N - 1, n}, bufs[r].options());
        int slot = 0;
        for (int j = 0; j < N; ++j) {
          if (j == r) continue;
          C10_CUDA_CHECK(cudaMemcpyPeerAsync(staging[r][slot++].data_ptr(), devs[r], bufs[j].data_ptr(), devs[j],
                                             bytes, c10::cuda::getCurrentCUDAStream(devs[r])));
        }
      }
      peer::barrier(devs, guard);
      for (int r = 0; r < N; ++r) {
        Job job;
        job.dtype = bufs[0].scalar_type();
        job.nsrc = N;
        job.ndst = 1;
        ReduceSegment s = segment(n);
        int slot = 0;
        for (int j = 0; j < N; ++j) s.src[j] = j == r ? addr(bufs[r]) : addr(staging[r][slot++]);
        s.dst[0] = addr(bufs[r]);
        job.segs.push_back(s);
        run_local(job, devs[r], scale, divide, guard);
      }
      return;
    }
  }
}

void check_rank_count(const char* op, size_t n) {
  TORCH_CHECK(n <= static_cast<size_t>(kMaxRanks), op, ": at most ", kMaxRanks, " devices are supported, got ", n);
}

void all_reduce_cuda(at::TensorList buffers, c10::string_view op, c10::string_view algo) {
  check_device_buffers("all_reduce_", "buffers", buffers);
  check_rank_count("all_reduce_", buffers.size());
  const bool mean = parse_reduce_op("all_reduce_", std::string(op));
  const Algo a = parse_algo("all_reduce_", std::string(algo));
  if (buffers.size() == 1) return;  // sum or mean of one buffer is the buffer
  std::lock_guard<std::mutex> lock(peer::op_mutex());
  flat_all_reduce(buffers.vec(), a, mean, 1.0);
}

// Fallback for all_reduce_tensors_ without peer access: per dtype, flatten every device's
// tensors, copy-engine all-reduce (same order and epilogue, hence the same bits), unflatten.
void all_reduce_tensors_copy_engine(at::TensorList tensors, int64_t N, int64_t P, double scale) {
  std::set<at::ScalarType> types;
  for (int64_t p = 0; p < P; ++p) types.insert(tensors[p].scalar_type());
  for (at::ScalarType type : types) {
    std::vector<at::Tensor> flats;
    for (int64_t d = 0; d < N; ++d) {
      std::vector<at::Tensor> group;
      for (int64_t p = 0; p < P; ++p)
        if (tensors[p].scalar_type() == type) group.push_back(tensors[d * P + p]);
      c10::cuda::CUDAGuard g(group[0].device());
      std::vector<at::Tensor> views;
      for (auto& t : group) views.push_back(t.view(-1));
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

void all_reduce_tensors_cuda(at::TensorList tensors, int64_t num_devices, double scale) {
  const int64_t P = check_device_lists("all_reduce_tensors_", tensors, num_devices);
  check_rank_count("all_reduce_tensors_", num_devices);
  const int N = static_cast<int>(num_devices);
  std::vector<int> devs;
  for (int d = 0; d < N; ++d) devs.push_back(tensors[d * P].get_device());
  std::lock_guard<std::mutex> lock(peer::op_mutex());
  if (N > 1 && resolve_algo(Algo::kTwoShot, devs, 0) == Algo::kCopyEngine) {
    all_reduce_tensors_copy_engine(tensors, N, P, scale);
    return;
  }
  if (N == 1 && scale == 1.0) return;
  c10::cuda::OptionalCUDAGuard guard;
  std::vector<Job> jobs;
  for (int64_t p = 0; p < P; ++p) {
    if (tensors[p].numel() == 0) continue;
    ReduceSegment s = segment(tensors[p].numel());
    for (int d = 0; d < N; ++d) s.src[d] = s.dst[d] = addr(tensors[d * P + p]);
    add_segment(jobs, tensors[p].scalar_type(), s, N, N);
  }
  if (jobs.empty()) return;
  for (Job& job : jobs) plan(job, devs[0], N);
  if (N > 1) peer::barrier(devs, guard);
  for (int r = 0; r < N; ++r)
    for (const Job& job : jobs) launch(job, devs[r], r, N, scale, false, guard);
  if (N > 1) peer::barrier(devs, guard);
}

// Copies srcs (on the root device) into each destination list. Protocol: see the file comment.
void broadcast_lists(const char* op, at::TensorList srcs, at::TensorList dsts) {
  const int64_t P = static_cast<int64_t>(srcs.size());
  const int64_t lists = static_cast<int64_t>(dsts.size()) / P;
  const int root = srcs[0].get_device();
  std::lock_guard<std::mutex> lock(peer::op_mutex());
  c10::cuda::OptionalCUDAGuard guard;
  std::vector<int> touched;
  for (int64_t d = 0; d < lists; ++d) {
    const int dev = dsts[d * P].get_device();
    std::string why;
    const bool direct = peer::can_access(dev, root, &why);
    if (!direct) {
      TORCH_WARN_ONCE("vlseq_ext: ", op, ": peer access unavailable (", why, "); using copy-engine transfers");
    }
    peer::wait_for(dev, root, guard);  // leaves `dev` current
    if (direct) {
      std::vector<Job> jobs;
      for (int64_t p = 0; p < P; ++p) {
        const at::Tensor& dst = dsts[d * P + p];
        if (dst.numel() == 0 || dst.data_ptr() == srcs[p].data_ptr()) continue;
        ReduceSegment s = segment(dst.numel());
        s.src[0] = addr(srcs[p]);
        s.dst[0] = addr(dst);
        add_segment(jobs, dst.scalar_type(), s, 1, 1);
      }
      for (Job& job : jobs) run_local(job, dev, 1.0, false, guard);
    } else {
      for (int64_t p = 0; p < P; ++p) {
        const at::Tensor& dst = dsts[d * P + p];
        if (dst.numel() == 0) continue;
        C10_CUDA_CHECK(cudaMemcpyPeerAsync(dst.data_ptr(), dev, srcs[p].data_ptr(), root,
                                           dst.numel() * dst.element_size(), c10::cuda::getCurrentCUDAStream(dev)));
      }
    }
    touched.push_back(dev);
  }
  for (int dev : touched) peer::wait_for(root, dev, guard);
}

void broadcast_cuda(const at::Tensor& src, at::TensorList dsts) {
  TORCH_CHECK(src.defined(), "broadcast_: src is undefined");
  check_broadcast_lists("broadcast_", {src}, dsts);
  broadcast_lists("broadcast_", {src}, dsts);
}

void broadcast_tensors_cuda(at::TensorList srcs, at::TensorList dsts) {
  check_broadcast_lists("broadcast_tensors_", srcs, dsts);
  broadcast_lists("broadcast_tensors_", srcs, dsts);
}

std::string p2p_status_cuda(at::TensorList buffers) {
  check_device_buffers("p2p_status", "buffers", buffers);
  if (buffers.size() == 1) return "single";
  std::string why;
  std::lock_guard<std::mutex> lock(peer::op_mutex());
  if (peer::all_can_access(devices_of(buffers), &why)) return "p2p";
  return "copy_engine: " + why;
}

}  // namespace
}  // namespace vlseq

TORCH_LIBRARY_IMPL(vlseq_ext, CUDA, m) {
  m.impl("all_reduce_", &vlseq::all_reduce_cuda);
  m.impl("all_reduce_tensors_", &vlseq::all_reduce_tensors_cuda);
  m.impl("broadcast_", &vlseq::broadcast_cuda);
  m.impl("broadcast_tensors_", &vlseq::broadcast_tensors_cuda);
  m.impl("p2p_status", &vlseq::p2p_status_cuda);
}
