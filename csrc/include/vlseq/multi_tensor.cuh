// Multi-tensor launch machinery, after apex's multi_tensor_apply.cuh, with two differences that
// fit our ops better:
//  * One launch covers the whole list as one stream of elements, whatever the tensor
//    boundaries: a grid of resident blocks (sized from the kernel's occupancy) takes fixed
//    windows of that stream in turn, so the grid sweeps memory front to back together and no
//    partial last wave is left (fixed per-tensor chunks ran flatten of 256 MB / 200 tensors at
//    70% of a copy's bandwidth; 4K-element windows at 94%, BENCHMARKS.md). A block finds a
//    window's segment by binary search over the segments' start positions.
//  * The table travels by value as a __grid_constant__ parameter up to 32 KB (hundreds of
//    tensors), and through device memory beyond, so a list of any length is still one launch.
// Sizes and offsets are 64-bit throughout.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vlseq/dtypes.h"

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
  static int counts[64] = {0};
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

// Kernel parameters may take up to 32,764 bytes (CUDA >= 12.1, Volta and newer); a table up to
// this size still travels inline, leaving room for the kernel's other arguments.
constexpr size_t kMaxInlineTableBytes = 32000;

// Calls launch(table) with the smallest table that holds the segments: InlineTable<kSmall> (the
// common case: a model's handful of gradients; the whole parameter block is copied on every
// launch, so it stays small), a large InlineTable up to kMaxInlineTableBytes, else a
// GlobalTable whose rows were uploaded to `device` on `stream`. The upload needs pinned staging
// from the caching host allocator, which costs ~100 us per call while earlier launches still
// hold its blocks: the large inline table keeps lists of hundreds of tensors off that path.
template <int kSmall, typename Seg, typename Launch>
void with_table(const std::vector<Seg>& segs, int device, Launch&& launch) {
  constexpr int kLarge = static_cast<int>((kMaxInlineTableBytes - 16) / sizeof(Seg));
  static_assert(kLarge > kSmall, "kSmall must be below the large table's capacity");
  const int32_t n = static_cast<int32_t>(segs.size());
  if (n <= kSmall) {
    InlineTable<Seg, kSmall> t;
    t.n = n;
    std::copy(segs.begin(), segs.end(), t.seg);
    launch(t);
    return;
  }
  if (n <= kLarge) {
    InlineTable<Seg, kLarge> t;
    t.n = n;
    std::copy(segs.begin(), segs.end(), t.seg);
    launch(t);
    return;
  }
  const int64_t bytes = static_cast<int64_t>(segs.size() * sizeof(Seg));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), segs.data(), bytes);
  at::Tensor dev = host.to(at::Device(at::kCUDA, device), /*non_blocking=*/true);
  GlobalTable<Seg> t;
  t.n = n;
  t.seg = reinterpret_cast<const Seg*>(dev.data_ptr());
  launch(t);
  // `dev` is freed here; the caching allocator hands the block out again only to work that is
  // ordered after this launch on the same stream.
}

}  // namespace vlseq
