// Multi-tensor launch machinery, after apex's multi_tensor_apply.cuh, with two differences that
// fit our ops better:
//  * One launch covers the whole list as one stream of elements, whatever the tensor
//    boundaries: a grid of resident blocks (sized from the kernel's occupancy) takes fixed
//    windows of that stream in turn, so the grid sweeps memory front to back together and no
//    partial last wave is left (fixed per-tensor chunks ran flatten of 256 MB / 200 tensors at
//    70% of a copy's bandwidth; 4K-element windows at 94%, BENCHMARKS.md). A block finds a
//    window's segment by binary search over the segments' start positions.
//  * The table travels by value as a __grid_constant__ parameter when it is small (the common
//    case: a model's handful of gradients), and through device memory otherwise (cached by
//    content, so a loop that repeats a list uploads it once), so a list of any length is still
//    one launch.
// Sizes and offsets are 64-bit throughout.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "vlseq/dtypes.h"
#include "vlseq/limits.h"

namespace vlseq {

// Window boundaries inside a segment are rounded down to kQuantum elements, a multiple of every
// vector width, so every piece starts with the segment's own alignment.
constexpr int64_t kQuantum = 256;

// Vectors are at most 16 bytes wide per access; wider ones are split by the compiler into
// 16-byte accesses, which is why the alignment is capped at 16.
template <typename T, int N>
struct alignas(sizeof(T) * N > 16 ? 16 : sizeof(T) * N) Vec {
  T v[N];
};

inline bool is_aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename Seg, int kCap>
struct InlineTable {
  static constexpr int kCapacity = kCap;
  int32_t n;
  Seg seg[kCap];
  __device__ __forceinline__ const Seg& operator[](int i) const { return seg[i]; }
};

template <typename Seg>
struct GlobalTable {
  int32_t n;
  const Seg* seg;
  __device__ __forceinline__ const Seg& operator[](int i) const { return seg[i]; }
};

// Index of the segment that holds element x of the concatenation: the last one whose
// begin <= x. Empty segments share their successor's begin and so are never returned.
template <typename Table>
__device__ __forceinline__ int find_segment(const Table& t, int64_t x) {
  int lo = 0, hi = t.n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (t[mid].begin <= x) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Where a block boundary at element x of the concatenation falls inside segment s. A pure
// function of (x, s), so neighbouring blocks (and ranks splitting one job) agree on it, and the
// pieces tile every segment exactly.
template <typename Seg>
__device__ __forceinline__ int64_t cut(int64_t x, const Seg& s) {
  const int64_t local = x - s.begin;
  if (local <= 0) return 0;
  if (local >= s.numel) return s.numel;
  return local / kQuantum * kQuantum;
}

// Calls f(segment, first element, count) for each piece of this block's windows of [lo, hi):
// block b takes windows b, b + G, b + 2G, ... of `window` elements, so the grid sweeps the list
// front to back together and a block that runs slow delays the end by one window at most.
template <typename Table, typename F>
__device__ __forceinline__ void for_each_piece(const Table& t, int64_t lo, int64_t hi, int64_t window, F&& f) {
  const int64_t stride = int64_t{gridDim.x} * window;
  for (int64_t start = lo + int64_t{blockIdx.x} * window; start < hi; start += stride) {
    const int64_t end = min(start + window, hi);
    for (int i = find_segment(t, start); i < t.n; ++i) {
      const auto& s = t[i];
      if (s.begin >= end) break;
      const int64_t a = cut(start, s), b = cut(end, s);
      if (b > a) f(s, a, b - a);
    }
  }
}

// Fills `begin` (position in the concatenation) for every segment; returns the total.
template <typename Seg>
int64_t assign_begins(std::vector<Seg>& segs) {
  int64_t total = 0;
  for (auto& s : segs) {
    s.begin = total;
    total += s.numel;
  }
  return total;
}

// Multiprocessor count, read once per device. (ATen/cuda/CUDAContext.h would do this too, but it
// drags in cuBLAS/cuSPARSE headers that a compile-only toolkit may not have.)
inline int sm_count(int device) {
  static int counts[kMaxDevices] = {0};
  check_device_index(device, "table of multiprocessor counts");
  if (counts[device] == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount, device));
  }
  return counts[device];
}

// Blocks of `kernel` resident per multiprocessor. Callers cache it in a static of their own
// instantiation (kernels of one signature share a function-pointer type, so a cache keyed on the
// type here would mix them up).
template <typename Kernel>
int blocks_per_sm(Kernel kernel, int threads) {
  int n = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0));
  return std::max(n, 1);
}

// How a launch covers `span` elements: `grid` resident blocks, each taking windows of `window`
// elements in turn. Small jobs get one window of at least `min_window` per block (latency);
// large ones windows of `max_window`, many per block (balance).
struct Split {
  int grid;
  int64_t window;
};

inline Split split_for(int device, int per_sm, int64_t span, int64_t min_window, int64_t max_window) {
  const int64_t cap = int64_t{sm_count(device)} * per_sm;
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(cap, span / min_window));
  int64_t window = (span + grid - 1) / grid;
  window = (window + kQuantum - 1) / kQuantum * kQuantum;
  return {static_cast<int>(grid), std::min(window, max_window)};
}

// Device copies of recently used segment tables, keyed by content. Uploading a table needs pinned
// staging from the caching host allocator, which cost ~100 us of host time per call on the H200
// while earlier launches still held its blocks; a training loop or a benchmark sends the same
// table every call, so after the first call it is found here and nothing is uploaded.
class TableCache {
 public:
  static TableCache& get() {
    static TableCache* cache = new TableCache;  // never destroyed: no CUDA calls at exit
    return *cache;
  }

  // A device tensor holding `bytes` bytes equal to `rows`, usable by work queued next on `stream`.
  // The caller holds it until its launch is queued, so an eviction by another thread in between
  // cannot hand the block to other work first.
  at::Tensor find_or_upload(const void* tag, int device, const void* rows, size_t bytes, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < entries_.size(); ++i) {
      Entry& e = entries_[i];
      if (e.tag != tag || e.device != device || e.rows.size() != bytes || std::memcmp(e.rows.data(), rows, bytes)) {
        continue;
      }
      if (stream != e.stream) {
        // The upload ran on e.stream: order this stream after it, and keep the block from being
        // reused before this stream's work is done should the entry be evicted.
        C10_CUDA_CHECK(cudaStreamWaitEvent(stream, e.uploaded, 0));
        c10::cuda::CUDACachingAllocator::recordStream(
            e.table.storage().data_ptr(),
            c10::cuda::getStreamFromExternal(stream, static_cast<c10::DeviceIndex>(device)));
      }
      std::rotate(entries_.begin(), entries_.begin() + i, entries_.begin() + i + 1);  // most recent first
      return entries_.front().table;
    }
    Entry e;
    e.tag = tag;
    e.device = device;
    e.rows.assign(static_cast<const char*>(rows), static_cast<const char*>(rows) + bytes);
    e.table = upload(rows, bytes, device);
    e.stream = stream;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&e.uploaded, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(e.uploaded, stream));
    if (entries_.size() == kEntries) {
      C10_CUDA_CHECK(cudaEventDestroy(entries_.back().uploaded));
      entries_.pop_back();  // the allocator reuses the block only after the work queued on it
    }
    entries_.insert(entries_.begin(), std::move(e));
    return entries_.front().table;
  }

  // A fresh device copy on the current stream (pinned staging; the caching host allocator keeps
  // the staging block alive until the copy has run).
  static at::Tensor upload(const void* rows, size_t bytes, int device) {
    at::Tensor host = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    std::memcpy(host.data_ptr(), rows, bytes);
    return host.to(at::Device(at::kCUDA, device), /*non_blocking=*/true);
  }

 private:
  static constexpr size_t kEntries = 16;
  struct Entry {
    const void* tag;
    int device;
    std::vector<char> rows;
    at::Tensor table;
    cudaStream_t stream;
    cudaEvent_t uploaded;
  };
  std::mutex mutex_;
  std::vector<Entry> entries_;
};

// One distinct address per row type: the cache key, so tables of different kernels never match.
template <typename Seg>
const void* row_tag() {
  static const char tag = 0;
  return &tag;
}

// Calls launch(table) with an InlineTable when the segments fit (the common case: a model's
// handful of gradients; the parameter block is copied on every launch, so it stays small), else
// with a GlobalTable in device memory. Large parameter tables were tried and dropped: the
// kernel's binary search through constant memory made flatten of 200 tensors 1.7x slower.
template <int kCap, typename Seg, typename Launch>
void with_table(const std::vector<Seg>& segs, int device, Launch&& launch) {
  const int32_t n = static_cast<int32_t>(segs.size());
  if (n <= kCap) {
    InlineTable<Seg, kCap> t;
    t.n = n;
    std::copy(segs.begin(), segs.end(), t.seg);
    launch(t);
    return;
  }
  const size_t bytes = segs.size() * sizeof(Seg);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  GlobalTable<Seg> t;
  t.n = n;
  if (capture == cudaStreamCaptureStatusNone) {
    const at::Tensor table = TableCache::get().find_or_upload(row_tag<Seg>(), device, segs.data(), bytes, stream);
    t.seg = static_cast<const Seg*>(table.const_data_ptr());
    launch(t);
    return;
  }
  // Under graph capture the table must live as long as the graph: a private copy from the
  // graph's memory pool, never a cache entry that may be evicted before a replay.
  at::Tensor dev = TableCache::upload(segs.data(), bytes, device);
  t.seg = static_cast<const Seg*>(dev.const_data_ptr());
  launch(t);
}

}  // namespace vlseq
