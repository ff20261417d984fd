// The reduction kernel behind every reduce and broadcast op: one launch sums up to R sources in
// order and stores the result (or zeros) into up to R destinations, for a whole list of tensors.
// Host side: csrc/cuda/job_tables.cu.
#pragma once

#include <cstdint>

#include "vlseq/dtypes.h"
#include "vlseq/multi_tensor.cuh"

namespace vlseq::reduce {

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

}  // namespace vlseq::reduce
