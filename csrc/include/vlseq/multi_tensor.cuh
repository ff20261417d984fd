// Multi-tensor launch machinery, after apex's multi_tensor_apply.cuh, with two differences that
// fit our ops better:
//  * One launch covers the whole list, split *evenly by elements*: block b of G owns the
//    elements [lo + span*b/G, lo + span*(b+1)/G) of the list's concatenation, whatever the
//    tensor boundaries, so every block does the same work and a grid of one resident wave
//    finishes together. (Fixed-size chunks left a partial last wave: 1,200 chunks on 1,056
//    block slots ran at 70% of copy bandwidth.) A block finds its first segment by one binary
//    search, then walks forward.
//  * The table travels by value as a __grid_constant__ parameter when it is small (the common
//    case: a model's handful of gradients), and through device memory otherwise, so a list of
//    any length is still one launch.
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

// Block boundaries inside a segment are rounded down to kQuantum elements, a multiple of every
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

// Calls f(segment, first element, count) for each piece of this block's share of [lo, hi).
template <typename Table, typename F>
__device__ __forceinline__ void for_each_piece(const Table& t, int64_t lo, int64_t hi, F&& f) {
  const int64_t span = hi - lo;
  const int64_t start = lo + span * blockIdx.x / gridDim.x;
  const int64_t end = lo + span * (blockIdx.x + 1) / gridDim.x;
  if (start >= end) return;
  for (int i = find_segment(t, start); i < t.n; ++i) {
    const auto& s = t[i];
    if (s.begin >= end) break;
    const int64_t a = cut(start, s), b = cut(end, s);
    if (b > a) f(s, a, b - a);
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

// Grid for `span` elements: about `min_per_block` elements per block or more, and never more
// blocks than fit on the device at once, so the even split runs as one wave.
inline int grid_for(int device, int per_sm, int64_t span, int64_t min_per_block) {
  const int64_t cap = int64_t{sm_count(device)} * per_sm;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(cap, span / min_per_block)));
}

// Calls launch(table) with an InlineTable when the segments fit, else with a GlobalTable whose
// rows were uploaded to `device` on `stream` (pinned staging; the caching host allocator keeps the
// staging block alive until the copy has run).
template <int kCap, typename Seg, typename Launch>
void with_table(const std::vector<Seg>& segs, int device, Launch&& launch) {
  if (segs.size() <= static_cast<size_t>(kCap)) {
    InlineTable<Seg, kCap> t;
    t.n = static_cast<int32_t>(segs.size());
    std::copy(segs.begin(), segs.end(), t.seg);
    launch(t);
    return;
  }
  const int64_t bytes = static_cast<int64_t>(segs.size() * sizeof(Seg));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), segs.data(), bytes);
  at::Tensor dev = host.to(at::Device(at::kCUDA, device), /*non_blocking=*/true);
  GlobalTable<Seg> t;
  t.n = static_cast<int32_t>(segs.size());
  t.seg = reinterpret_cast<const Seg*>(dev.data_ptr());
  launch(t);
  // `dev` is freed here; the caching allocator hands the block out again only to work that is
  // ordered after this launch on the same stream.
}

}  // namespace vlseq
