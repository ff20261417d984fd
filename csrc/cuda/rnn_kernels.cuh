// Persistent LSTM/GRU layer kernels: one launch runs every step of one layer and direction
// (semantics: csrc/include/vlseq/rnn.h; host side and layout choice: rnn.cu).
//
// Work split
// ----------
// A *group* of `nc` blocks runs `bs` samples. Block `rank` owns hidden units
// [rank*hs, rank*hs + hs): it keeps the W_hh rows of those units (every gate) in shared memory
// for the whole sequence, and computes those units' gates and state for all of the group's
// samples. Each step needs the whole h_{t-1} of every sample (forward) or the whole
// dh_t = W_hh^T dgates_t (backward), so blocks exchange once per step:
//   forward:  every block publishes its units of h_t to every block of the group (all-gather);
//   backward: every block computes the partial W_hh[own rows]^T dgates[own rows] for all H units
//             and delivers each unit's partial to the block that owns it (reduce-scatter); the
//             owner sums the nc partials in rank order, so the result has the same bits on every
//             run.
// Three ways to exchange, chosen by the host (Sync):
//   kLocal   nc = 1: the block's own shared memory, __syncthreads.
//   kCluster nc <= 16 blocks of one thread-block cluster: stores into the other blocks' shared
//            memory (distributed shared memory) and one cluster barrier per step.
//   kGrid    W_hh too large for a cluster: the exchange goes through global memory (L2) and a
//            barrier on a per-group arrival counter (grid_barrier below). The host launches it
//            cooperatively, which guarantees that every block of the grid is resident at once, so
//            the spinning blocks cannot wait for a block that never gets an SM.
//
// Synchronisation protocol (why every buffer is safe to reuse)
// ------------------------------------------------------------
// Exchange buffers are double-buffered by step parity, and each step ends with one group barrier
// (bar() below: __syncthreads / cluster barrier with release-acquire semantics / grid barrier).
// At step s a block reads the buffer of parity s (written by every block at step s-1, before
// barrier s-1) and writes the buffer of parity s+1. A block can only write parity s+1 again at
// step s+2, after passing barrier s+1, which every block reaches only after finishing step s+1 and
// therefore its reads of parity s+1 at step s+1... and its reads of that parity at step s were
// before barrier s. So no block overwrites a buffer another block may still read. Blocks
// initialise only their own buffers' padding (never entries others write), and a barrier after the
// set-up guarantees that every block of a cluster has started before the first remote store.
// Global exchange buffers are read with ld.global.cg (L2, never a stale L1 line).
//
// Sample b of length L runs steps s = 0 .. L-1 at time t = s (reverse: L-1-s). From s = L on its
// state is frozen (it is still published, unchanged), its outputs are left at the zeros the host
// allocated, and its gate gradients are zero. The loop runs to the group's longest length only.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "vlseq/rnn.h"

namespace vlseq::rnn {

namespace cg = cooperative_groups;

enum class Sync : int { kLocal = 0, kCluster = 1, kGrid = 2 };

constexpr int kThreads = 256;
constexpr int kRowTile = 2;  // rows of W per product tile (the batch side, BT, is a template)
constexpr int kMaxCluster = 16;

__host__ __device__ constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }
__host__ __device__ constexpr int ceil_div(int x, int m) { return (x + m - 1) / m; }

// The layout of one layer's launch, chosen by the host (rnn.cu) and read by every block.
struct Geometry {
  int B, T, H;
  int nc;     // blocks per group
  int hs;     // hidden units per block (the last block may hold fewer)
  int bs;     // samples per group
  int chunk;  // samples whose h is staged in shared memory at once (kGrid); = bs otherwise
  Sync sync;
  int reverse;
};

struct ForwardArgs {
  Geometry g;
  const float* xproj;
  const float* w_hh;
  const float* b_hh;  // may be null
  const float* h0;
  const float* c0;  // LSTM only
  const int64_t* lengths;
  float* y;
  float* h_n;
  float* c_n;
  float* saved;
  float* cs;
  float* xchg;         // kGrid: [2][groups][bs][H]
  unsigned* arrivals;  // kGrid: one counter per group, zeroed before the launch
};

struct BackwardArgs {
  Geometry g;
  const float* w_hh;
  const float* y;
  const float* saved;
  const float* cs;
  const float* h0;
  const float* c0;
  const int64_t* lengths;
  const float* dy;    // may be null
  const float* dh_n;  // may be null
  const float* dc_n;  // may be null
  float* dgates;
  float* dgates_hn;
  float* dh0;
  float* dc0;
  float* xchg;  // kGrid: [2][groups][nc][bs][H]
  unsigned* arrivals;
};

// Byte offsets into dynamic shared memory; the host sizes the launch with the same arithmetic.
struct ForwardSmem {
  int w, h, gates, x, hown, cown, lens, total;
  __host__ __device__ ForwardSmem(const Geometry& g, int G, int wbytes, int bt) {
    const int R = G * g.hs, Kp = round_up(g.H, 4);
    int off = 0;
    w = off, off += round_up(round_up(R, kRowTile) * (Kp + 4) * wbytes, 16);
    h = off, off += (g.sync == Sync::kGrid ? 1 : 2) * round_up(g.chunk, bt) * Kp * 4;
    gates = off, off += round_up(g.bs * R * 4, 16);
    x = off, off += round_up(2 * g.bs * R * 4, 16);
    hown = off, off += round_up(g.bs * g.hs * 4, 16);
    cown = off, off += round_up(g.bs * g.hs * 4, 16);
    lens = off, off += round_up(g.bs * 4, 16);
    total = off;
  }
};

// Per (sample, unit) the backward step reads F values: LSTM i, f, g, o, c_t, c_{t-1}, dy;
// GRU r, z, n, W_hn h + b_hn, h_{t-1}, dy.
__host__ __device__ constexpr int backward_fields(Cell c) { return c == Cell::kLSTM ? 7 : 6; }

struct BackwardSmem {
  int wt, dg, recv, dh, dc, ddir, pre, lens, total;
  __host__ __device__ BackwardSmem(const Geometry& g, int G, int wbytes, int bt, int F) {
    const int Rp = round_up(G * g.hs, 4), Kp = round_up(g.H, 4);
    int off = 0;
    wt = off, off += round_up(Kp * (Rp + 4) * wbytes, 16);
    dg = off, off += round_up(g.bs, bt) * Rp * 4;
    recv = off, off += g.sync == Sync::kGrid ? 0 : 2 * g.nc * g.bs * g.hs * 4;
    dh = off, off += round_up(g.bs * g.hs * 4, 16);
    dc = off, off += round_up(g.bs * g.hs * 4, 16);
    ddir = off, off += round_up(g.bs * g.hs * 4, 16);
    pre = off, off += round_up(2 * g.bs * F * g.hs * 4, 16);
    lens = off, off += round_up(g.bs * 4, 16);
    total = off;
  }
};

// The kernel for a cell, weight precision and batch tile (1, 2, 4 or 8), as a launchable pointer
// (rnn_forward.cu, rnn_backward.cu).
const void* forward_kernel(Cell c, Weights w, int bt);
const void* backward_kernel(Cell c, Weights w, int bt);

#if defined(__CUDACC__)

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <typename WT>
__device__ __forceinline__ WT to_weight(float v);
template <>
__device__ __forceinline__ float to_weight<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 to_weight<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);  // bf16 -> fp32 is a 16-bit shift
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                     __uint_as_float(u.y & 0xffff0000u));
}

// 4-byte asynchronous copy global -> shared: the next step's inputs load while this step runs.
__device__ __forceinline__ void cp_async4(float* dst, const float* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The kGrid barrier. Every block of a group adds 1 to the group's counter once per barrier, and
// the counter only grows: barrier n is complete when it reaches n * nc. Thread 0 publishes the
// block's global writes (ordered before it by the __syncthreads) with a fence and the atomic, and
// spins on acquire loads; the closing __syncthreads hands that view to the block's other threads
// (the pattern of cooperative_groups' grid.sync()).
__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
    while (load_acquire(counter) < target) {
    }
    __threadfence();
  }
  __syncthreads();
}

struct GroupBarrier {
  Sync mode;
  unsigned* counter;
  unsigned nc;
  unsigned arrived;
  __device__ void operator()() {
    if (mode == Sync::kCluster) {
      cg::this_cluster().sync();
    } else if (mode == Sync::kGrid) {
      arrived += nc;
      grid_barrier(counter, arrived);
    } else {
      __syncthreads();
    }
  }
};

// Lanes that split one tile's reduction: as many as keep every thread busy, at most 32 (one warp:
// they combine with shuffles) and at most one float4 chunk each.
__device__ __forceinline__ int split_lanes(int rows, int nb, int bt, int k4n) {
  const int tiles = ceil_div(rows, kRowTile) * ceil_div(nb, bt);
  int ks = 1;
  while (ks < 32 && tiles * ks * 2 <= kThreads && ks * 2 <= k4n) ks *= 2;
  return ks;
}

// store(b, r, sum_k W[r * ldw + k] * v[b * ldv + k]) for r < rows, b < nb, k < 4 * k4n.
// Tiles of kRowTile rows x BT samples per thread group of `ks` consecutive lanes, which split k in
// interleaved float4 chunks and combine with a butterfly: a fixed order, the same bits every run.
// W rows up to round_up(rows, kRowTile) and v rows up to round_up(nb, BT) must be readable (zero
// padding in shared memory). Lanes past the last tile repeat it and store nothing, so that every
// lane of a warp reaches the shuffles.
template <int BT, typename WT, typename Store>
__device__ __forceinline__ void matvec(const WT* W, int ldw, int rows, int k4n, const float* v, int ldv, int nb,
                                       int ks, Store&& store) {
  const int nrt = ceil_div(rows, kRowTile);
  const int ntiles = nrt * ceil_div(nb, BT);
  const int per_pass = kThreads / ks;
  const int q = threadIdx.x % ks;
  for (int first = 0; first < ntiles; first += per_pass) {
    const int tile_raw = first + static_cast<int>(threadIdx.x) / ks;
    const int tile = min(tile_raw, ntiles - 1);
    const int r0 = (tile % nrt) * kRowTile, b0 = (tile / nrt) * BT;
    float acc[kRowTile][BT];
#pragma unroll
    for (int i = 0; i < kRowTile; ++i)
#pragma unroll
      for (int j = 0; j < BT; ++j) acc[i][j] = 0.0f;
    const WT* w0 = W + r0 * ldw;
    const float* v0 = v + b0 * ldv;
    for (int k4 = q; k4 < k4n; k4 += ks) {
      float4 w[kRowTile];
#pragma unroll
      for (int i = 0; i < kRowTile; ++i) w[i] = load4(w0 + i * ldw + 4 * k4);
#pragma unroll
      for (int j = 0; j < BT; ++j) {
        const float4 x = *reinterpret_cast<const float4*>(v0 + j * ldv + 4 * k4);
#pragma unroll
        for (int i = 0; i < kRowTile; ++i) {
          acc[i][j] = fmaf(w[i].x, x.x, acc[i][j]);
          acc[i][j] = fmaf(w[i].y, x.y, acc[i][j]);
          acc[i][j] = fmaf(w[i].z, x.z, acc[i][j]);
          acc[i][j] = fmaf(w[i].w, x.w, acc[i][j]);
        }
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      if (off < ks) {
#pragma unroll
        for (int i = 0; i < kRowTile; ++i)
#pragma unroll
          for (int j = 0; j < BT; ++j) acc[i][j] += __shfl_xor_sync(0xffffffffu, acc[i][j], off);
      }
    }
    if (q == 0 && tile_raw < ntiles) {
#pragma unroll
      for (int i = 0; i < kRowTile; ++i)
#pragma unroll
        for (int j = 0; j < BT; ++j)
          if (r0 + i < rows && b0 + j < nb) store(b0 + j, r0 + i, acc[i][j]);
    }
  }
}

template <Cell C, int BT, typename WT>
__global__ void __launch_bounds__(kThreads) rnn_forward_kernel(const ForwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int G = C == Cell::kLSTM ? 4 : 3;
  const Geometry& g = a.g;
  const int H = g.H, T = g.T, hs = g.hs, R = G * hs, GH = G * H;
  const int Kp = round_up(H, 4), ldw = Kp + 4;
  const int groups = gridDim.x / g.nc;
  const int rank = blockIdx.x % g.nc, group = blockIdx.x / g.nc;
  const int j0 = rank * hs, hv = max(0, min(hs, H - j0));
  const int b0 = group * g.bs, bv = min(g.bs, g.B - b0);
  const int tid = threadIdx.x;
  const bool grid = g.sync == Sync::kGrid, cluster = g.sync == Sync::kCluster;

  extern __shared__ __align__(16) unsigned char smem[];
  const ForwardSmem lay(g, G, sizeof(WT), BT);
  WT* w_s = reinterpret_cast<WT*>(smem + lay.w);
  float* h_s = reinterpret_cast<float*>(smem + lay.h);
  float* gates_s = reinterpret_cast<float*>(smem + lay.gates);
  float* x_s = reinterpret_cast<float*>(smem + lay.x);
  float* hown = reinterpret_cast<float*>(smem + lay.hown);
  float* cown = reinterpret_cast<float*>(smem + lay.cown);
  int* lens = reinterpret_cast<int*>(smem + lay.lens);
  const int hbuf = round_up(g.chunk, BT) * Kp;  // floats per h buffer
  auto xchg = [&](int parity) { return a.xchg + (static_cast<int64_t>(parity) * groups + group) * g.bs * H; };

  // Set-up: this block's W_hh rows (row q*hs + j <- W_hh[q*H + j0 + j]), zero padded.
  const int wrows = round_up(R, kRowTile);
  for (int e = tid; e < wrows * ldw; e += kThreads) {
    const int r = e / ldw, k = e - r * ldw;
    float v = 0.0f;
    if (r < R && k < H) {
      const int q = r / hs, j = r - q * hs;
      if (j < hv) v = a.w_hh[static_cast<int64_t>(q * H + j0 + j) * H + k];
    }
    w_s[e] = to_weight<WT>(v);
  }
  for (int b = tid; b < g.bs; b += kThreads)
    lens[b] = b < bv ? static_cast<int>(clamp_length(a.lengths[b0 + b], T)) : 0;
  for (int e = tid; e < g.bs * hs; e += kThreads) {
    const int b = e / hs, j = e - b * hs;
    const bool mine = b < bv && j < hv;
    const int64_t at = static_cast<int64_t>(b0 + b) * H + j0 + j;
    hown[e] = mine ? a.h0[at] : 0.0f;
    cown[e] = mine && C == Cell::kLSTM ? a.c0[at] : 0.0f;
  }
  if (!grid) {
    // Buffer 0 = h0 of the group's samples; other entries zero. Later steps write only rows < bv,
    // columns < H, which this set-up leaves to them.
    for (int e = tid; e < 2 * hbuf; e += kThreads) {
      const int buf = e / hbuf, rem = e - buf * hbuf, b = rem / Kp, k = rem - b * Kp;
      if (buf == 0 && b < bv && k < H)
        h_s[e] = a.h0[static_cast<int64_t>(b0 + b) * H + k];
      else if (b >= bv || k >= H)
        h_s[e] = 0.0f;
    }
  } else {
    for (int e = tid; e < hbuf; e += kThreads) h_s[e] = 0.0f;
    float* out = xchg(0);
    for (int e = tid; e < bv * hv; e += kThreads) {
      const int b = e / hv, j = e - b * hv;
      __stcg(out + static_cast<int64_t>(b) * H + j0 + j, a.h0[static_cast<int64_t>(b0 + b) * H + j0 + j]);
    }
  }
  __syncthreads();
  int smax = 0;
  for (int b = 0; b < g.bs; ++b) smax = max(smax, lens[b]);
  GroupBarrier bar{g.sync, grid ? a.arrivals + group : nullptr, static_cast<unsigned>(g.nc), 0u};
  bar();

  // Step s+1's input projections of this block's units, into x_s[parity].
  auto prefetch = [&](int s, int parity) {
    float* dst = x_s + parity * g.bs * R;
    for (int e = tid; e < bv * G * hv; e += kThreads) {
      const int b = e / (G * hv), rem = e - b * G * hv, q = rem / hv, j = rem - q * hv;
      const int len = lens[b];
      if (s < len) {
        const int t = g.reverse ? len - 1 - s : s;
        cp_async4(dst + (b * G + q) * hs + j, a.xproj + (static_cast<int64_t>(b0 + b) * T + t) * GH + q * H + j0 + j);
      }
    }
    cp_async_commit();
  };

  const int ks = split_lanes(R, grid ? g.chunk : bv, BT, Kp / 4);
  if (smax > 0) prefetch(0, 0);
  for (int s = 0; s < smax; ++s) {
    const int cur = s & 1;
    if (s + 1 < smax) prefetch(s + 1, cur ^ 1);
    // Recurrent products: gates_s[b * R + r] = W_hh row r . h_{t-1} of sample b.
    if (grid) {
      const float* in = xchg(cur);
      for (int c0 = 0; c0 < bv; c0 += g.chunk) {
        const int nb = min(g.chunk, bv - c0);
        for (int e = tid; e < nb * H; e += kThreads) {
          const int b = e / H, k = e - b * H;
          h_s[b * Kp + k] = __ldcg(in + static_cast<int64_t>(c0 + b) * H + k);
        }
        __syncthreads();
        matvec<BT>(w_s, ldw, R, Kp / 4, h_s, Kp, nb, ks,
                   [&](int b, int r, float v) { gates_s[(c0 + b) * R + r] = v; });
        __syncthreads();
      }
    } else {
      matvec<BT>(w_s, ldw, R, Kp / 4, h_s + cur * hbuf, Kp, bv, ks,
                 [&](int b, int r, float v) { gates_s[b * R + r] = v; });
    }
    if (s + 1 < smax)
      cp_async_wait<1>();
    else
      cp_async_wait<0>();
    __syncthreads();
    // The cell, for this block's units of every sample still running.
    const float* xs = x_s + cur * g.bs * R;
    for (int e = tid; e < bv * hv; e += kThreads) {
      const int b = e / hv, j = e - b * hv;
      const int len = lens[b];
      if (s >= len) continue;  // frozen: hown keeps the last state
      const int t = g.reverse ? len - 1 - s : s;
      const int64_t row = static_cast<int64_t>(b0 + b) * T + t;
      const float* xb = xs + b * R + j;  // gate q at xb[q * hs]
      const float* gb = gates_s + b * R + j;
      float bias[G];
#pragma unroll
      for (int q = 0; q < G; ++q) bias[q] = a.b_hh ? a.b_hh[q * H + j0 + j] : 0.0f;
      float* sv = a.saved + row * 4 * H + j0 + j;
      float h;
      if constexpr (C == Cell::kLSTM) {
        const float i = sigmoid(xb[0] + (gb[0] + bias[0]));
        const float f = sigmoid(xb[hs] + (gb[hs] + bias[1]));
        const float gg = tanhf(xb[2 * hs] + (gb[2 * hs] + bias[2]));
        const float o = sigmoid(xb[3 * hs] + (gb[3 * hs] + bias[3]));
        const float c = f * cown[b * hs + j] + i * gg;
        h = o * tanhf(c);
        cown[b * hs + j] = c;
        sv[0] = i, sv[H] = f, sv[2 * H] = gg, sv[3 * H] = o;
        a.cs[row * H + j0 + j] = c;
      } else {
        const float ghn = gb[2 * hs] + bias[2];
        const float r = sigmoid(xb[0] + (gb[0] + bias[0]));
        const float z = sigmoid(xb[hs] + (gb[hs] + bias[1]));
        const float n = tanhf(xb[2 * hs] + r * ghn);
        h = (1.0f - z) * n + z * hown[b * hs + j];
        sv[0] = r, sv[H] = z, sv[2 * H] = n, sv[3 * H] = ghn;
      }
      a.y[row * H + j0 + j] = h;
      hown[b * hs + j] = h;
    }
    __syncthreads();
    // Publish this block's units of h (frozen samples too) to every block of the group.
    if (grid) {
      float* out = xchg(cur ^ 1);
      for (int e = tid; e < bv * hv; e += kThreads) {
        const int b = e / hv, j = e - b * hv;
        __stcg(out + static_cast<int64_t>(b) * H + j0 + j, hown[b * hs + j]);
      }
    } else {
      float* next = h_s + (cur ^ 1) * hbuf;
      const int n = bv * hv;
      for (int e = tid; e < g.nc * n; e += kThreads) {
        const int dst = e / n, rem = e - dst * n, b = rem / hv, j = rem - b * hv;
        float* to = cluster ? cg::this_cluster().map_shared_rank(next, dst) : next;
        to[b * Kp + j0 + j] = hown[b * hs + j];
      }
    }
    bar();
  }
  for (int e = tid; e < bv * hv; e += kThreads) {
    const int b = e / hv, j = e - b * hv;
    const int64_t at = static_cast<int64_t>(b0 + b) * H + j0 + j;
    a.h_n[at] = hown[b * hs + j];
    if (C == Cell::kLSTM) a.c_n[at] = cown[b * hs + j];
  }
#endif
}

template <Cell C, int BT, typename WT>
__global__ void __launch_bounds__(kThreads) rnn_backward_kernel(const BackwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int G = C == Cell::kLSTM ? 4 : 3;
  constexpr int F = backward_fields(C);
  const Geometry& g = a.g;
  const int H = g.H, T = g.T, hs = g.hs, R = G * hs, GH = G * H;
  const int Kp = round_up(H, 4), Rp = round_up(R, 4), ldt = Rp + 4;
  const int groups = gridDim.x / g.nc;
  const int rank = blockIdx.x % g.nc, group = blockIdx.x / g.nc;
  const int j0 = rank * hs, hv = max(0, min(hs, H - j0));
  const int b0 = group * g.bs, bv = min(g.bs, g.B - b0);
  const int tid = threadIdx.x;
  const bool grid = g.sync == Sync::kGrid, cluster = g.sync == Sync::kCluster;

  extern __shared__ __align__(16) unsigned char smem[];
  const BackwardSmem lay(g, G, sizeof(WT), BT, F);
  WT* wt_s = reinterpret_cast<WT*>(smem + lay.wt);  // [k][r]: W_hh transposed, own rows
  float* dg_s = reinterpret_cast<float*>(smem + lay.dg);
  float* recv_s = reinterpret_cast<float*>(smem + lay.recv);
  float* dh_s = reinterpret_cast<float*>(smem + lay.dh);
  float* dc_s = reinterpret_cast<float*>(smem + lay.dc);
  float* ddir = reinterpret_cast<float*>(smem + lay.ddir);
  float* pre = reinterpret_cast<float*>(smem + lay.pre);
  int* lens = reinterpret_cast<int*>(smem + lay.lens);
  // Partial dh of unit j0 + j of sample b from block q, exchanged at a step of parity `parity`.
  auto xchg = [&](int parity, int q) {
    return a.xchg + ((static_cast<int64_t>(parity) * groups + group) * g.nc + q) * g.bs * H;
  };
  auto received = [&](int parity, int q, int b, int j) {
    return grid ? __ldcg(xchg(parity, q) + static_cast<int64_t>(b) * H + j0 + j)
                : recv_s[((parity * g.nc + q) * g.bs + b) * hs + j];
  };

  for (int e = tid; e < ldt * Kp; e += kThreads) {  // k fastest: coalesced reads of W_hh rows
    const int r = e / Kp, k = e - r * Kp;
    float v = 0.0f;
    if (r < R && k < H) {
      const int q = r / hs, j = r - q * hs;
      if (j < hv) v = a.w_hh[static_cast<int64_t>(q * H + j0 + j) * H + k];
    }
    wt_s[k * ldt + r] = to_weight<WT>(v);
  }
  for (int e = tid; e < round_up(g.bs, BT) * Rp; e += kThreads) dg_s[e] = 0.0f;
  for (int b = tid; b < g.bs; b += kThreads)
    lens[b] = b < bv ? static_cast<int>(clamp_length(a.lengths[b0 + b], T)) : 0;
  for (int e = tid; e < g.bs * hs; e += kThreads) {
    const int b = e / hs, j = e - b * hs;
    const bool mine = b < bv && j < hv;
    const int64_t at = static_cast<int64_t>(b0 + b) * H + j0 + j;
    dh_s[e] = mine && a.dh_n ? a.dh_n[at] : 0.0f;
    dc_s[e] = mine && a.dc_n ? a.dc_n[at] : 0.0f;
    ddir[e] = 0.0f;
  }
  __syncthreads();
  int smax = 0;
  for (int b = 0; b < g.bs; ++b) smax = max(smax, lens[b]);
  GroupBarrier bar{g.sync, grid ? a.arrivals + group : nullptr, static_cast<unsigned>(g.nc), 0u};
  bar();

  // What step s reads per (sample, unit), into pre[parity].
  auto prefetch = [&](int s, int parity) {
    float* dst = pre + parity * g.bs * F * hs;
    for (int e = tid; e < bv * F * hv; e += kThreads) {
      const int b = e / (F * hv), rem = e - b * F * hv, f = rem / hv, j = rem - f * hv;
      const int len = lens[b];
      if (s >= len) continue;
      const int t = g.reverse ? len - 1 - s : s;
      const int tp = g.reverse ? len - s : s - 1;  // the step before (s > 0)
      const int64_t row = static_cast<int64_t>(b0 + b) * T + t, prow = static_cast<int64_t>(b0 + b) * T + tp;
      const int64_t unit = static_cast<int64_t>(j0 + j), first = static_cast<int64_t>(b0 + b) * H + unit;
      const float* src = nullptr;
      if (f < 4) {
        src = a.saved + row * 4 * H + f * H + unit;
      } else if (f == F - 1) {
        src = a.dy ? a.dy + row * H + unit : nullptr;
      } else if (C == Cell::kLSTM && f == 4) {
        src = a.cs + row * H + unit;
      } else if (C == Cell::kLSTM) {  // c_{t-1}
        src = s > 0 ? a.cs + prow * H + unit : a.c0 + first;
      } else {  // GRU h_{t-1}
        src = s > 0 ? a.y + prow * H + unit : a.h0 + first;
      }
      if (src) cp_async4(dst + (b * F + f) * hs + j, src);
    }
    cp_async_commit();
  };

  const int ks = split_lanes(H, bv, BT, Rp / 4);
  if (smax > 0) prefetch(smax - 1, (smax - 1) & 1);
  for (int s = smax - 1; s >= 0; --s) {
    const int cur = s & 1;
    if (s > 0) {
      prefetch(s - 1, cur ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const float* ps = pre + cur * g.bs * F * hs;
    for (int e = tid; e < bv * hv; e += kThreads) {
      const int b = e / hv, j = e - b * hv, at = b * hs + j;
      const int len = lens[b];
      float dhc = dh_s[at];
      if (s + 1 < len) {  // dh_t from step s+1's exchange, summed in rank order
        float acc = 0.0f;
        for (int q = 0; q < g.nc; ++q) acc += received(cur ^ 1, q, b, j);
        dhc = acc + ddir[at];
      }
      dh_s[at] = dhc;
      float* dgb = dg_s + b * Rp + j;  // gate q at dgb[q * hs]
      if (s >= len) {
#pragma unroll
        for (int q = 0; q < G; ++q) dgb[q * hs] = 0.0f;
        continue;
      }
      const int t = g.reverse ? len - 1 - s : s;
      const int64_t row = static_cast<int64_t>(b0 + b) * T + t;
      const float* p = ps + b * F * hs + j;  // field f at p[f * hs]
      const float dht = dhc + (a.dy ? p[(F - 1) * hs] : 0.0f);
      float d[G];
      if constexpr (C == Cell::kLSTM) {
        const float i = p[0], f = p[hs], gg = p[2 * hs], o = p[3 * hs], ct = p[4 * hs], cp = p[5 * hs];
        const float tc = tanhf(ct);
        const float dct = dc_s[at] + dht * o * (1.0f - tc * tc);
        d[0] = dct * gg * i * (1.0f - i);
        d[1] = dct * cp * f * (1.0f - f);
        d[2] = dct * i * (1.0f - gg * gg);
        d[3] = dht * tc * o * (1.0f - o);
        dc_s[at] = dct * f;
#pragma unroll
        for (int q = 0; q < G; ++q) dgb[q * hs] = d[q];
      } else {
        const float r = p[0], z = p[hs], n = p[2 * hs], ghn = p[3 * hs], hp = p[4 * hs];
        const float dn = dht * (1.0f - z) * (1.0f - n * n);
        d[0] = dn * ghn * r * (1.0f - r);
        d[1] = dht * (hp - n) * z * (1.0f - z);
        d[2] = dn;
        a.dgates_hn[row * H + j0 + j] = dn * r;
        dgb[0] = d[0], dgb[hs] = d[1], dgb[2 * hs] = dn * r;
        ddir[at] = dht * z;
      }
#pragma unroll
      for (int q = 0; q < G; ++q) a.dgates[row * GH + q * H + j0 + j] = d[q];
    }
    __syncthreads();
    // Partial dh_{t-1} over this block's rows for every unit k, delivered to k's owner.
    float* recv_next = recv_s + cur * g.nc * g.bs * hs;
    float* out = grid ? xchg(cur, rank) : nullptr;
    matvec<BT>(wt_s, ldt, H, Rp / 4, dg_s, Rp, bv, ks, [&](int b, int k, float v) {
      if (grid) {
        __stcg(out + static_cast<int64_t>(b) * H + k, v);
      } else {
        const int owner = k / hs;
        float* to = cluster ? cg::this_cluster().map_shared_rank(recv_next, owner) : recv_next;
        to[(rank * g.bs + b) * hs + (k - owner * hs)] = v;
      }
    });
    bar();
  }
  for (int e = tid; e < bv * hv; e += kThreads) {
    const int b = e / hv, j = e - b * hv, at = b * hs + j;
    float dh = dh_s[at];
    if (lens[b] > 0) {
      float acc = 0.0f;
      for (int q = 0; q < g.nc; ++q) acc += received(0, q, b, j);
      dh = acc + ddir[at];
    }
    const int64_t o = static_cast<int64_t>(b0 + b) * H + j0 + j;
    a.dh0[o] = dh;
    if (C == Cell::kLSTM) a.dc0[o] = dc_s[at];
  }
#endif
}

#endif  // __CUDACC__

}  // namespace vlseq::rnn
