// Multi-tensor launch machinery, after apex's multi_tensor_apply.cuh, with two differences that
// fit our ops better:
//  * One launch covers the whole list. Each tensor ("segment") is cut into fixed-size chunks;
//    a block walks chunks grid-stride and finds its segment by binary search over each
//    segment's first chunk. apex instead launches once per 320 blocks' worth of chunks.
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

// Chunk sizes are multiples of kChunkQuantum elements, a multiple of every vector width, so
// chunk starts keep a segment's alignment.
constexpr int64_t kChunkQuantum = 256;

// Elements per chunk for `total` elements that `blocks` blocks should share: small lists get
// small chunks (more blocks busy, lower latency), large ones up to `max_chunk`.
inline int64_t pick_chunk(int64_t total, int64_t blocks, int64_t min_chunk, int64_t max_chunk) {
  int64_t c = (total + blocks - 1) / std::max<int64_t>(blocks, 1);
  c = (c + kChunkQuantum - 1) / kChunkQuantum * kChunkQuantum;
  return std::min(max_chunk, std::max(min_chunk, c));
}

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
  int64_t chunk;  // elements per chunk
  int64_t total_chunks;
  Seg seg[kCap];
  __device__ __forceinline__ const Seg& operator[](int i) const { return seg[i]; }
};

template <typename Seg>
struct GlobalTable {
  int32_t n;
  int64_t chunk;
  int64_t total_chunks;
  const Seg* seg;
  __device__ __forceinline__ const Seg& operator[](int i) const { return seg[i]; }
};

// Index of the segment that owns `chunk`: the last one whose chunk_begin <= chunk. Empty segments
// share their successor's chunk_begin and so are never returned.
template <typename Table>
__device__ __forceinline__ int find_segment(const Table& t, int64_t chunk) {
  int lo = 0, hi = t.n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (t[mid].chunk_begin <= chunk) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Fills chunk_begin for every segment; returns the total number of chunks.
template <typename Seg>
int64_t assign_chunks(std::vector<Seg>& segs, int64_t chunk) {
  int64_t c = 0;
  for (auto& s : segs) {
    s.chunk_begin = c;
    c += (s.numel + chunk - 1) / chunk;
  }
  return c;
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

// Grid size for a chunked kernel: enough blocks to fill the device, never more than chunks.
inline int grid_for(int device, int64_t chunks, int blocks_per_sm) {
  const int64_t cap = static_cast<int64_t>(sm_count(device)) * blocks_per_sm;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(chunks, cap)));
}

// Calls launch(table) with an InlineTable when the segments fit, else with a GlobalTable whose
// rows were uploaded to `device` on `stream` (pinned staging; the caching host allocator keeps the
// staging block alive until the copy has run).
template <int kCap, typename Seg, typename Launch>
void with_table(const std::vector<Seg>& segs, int64_t chunk, int64_t total_chunks, int device, Launch&& launch) {
  if (segs.size() <= static_cast<size_t>(kCap)) {
    InlineTable<Seg, kCap> t;
    t.n = static_cast<int32_t>(segs.size());
    t.chunk = chunk;
    t.total_chunks = total_chunks;
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
  t.chunk = chunk;
  t.total_chunks = total_chunks;
  t.seg = reinterpret_cast<const Seg*>(dev.data_ptr());
  launch(t);
  // `dev` is freed here; the caching allocator hands the block out again only to work that is
  // ordered after this launch on the same stream.
}

}  // namespace vlseq
