// Persistent LSTM/GRU layer kernels: one launch runs every step of one layer and direction
// (semantics: csrc/include/vlseq/rnn.h; host side and layout choice: rnn.cu). This file: what every
// kernel shares, and the generic kernels (W_hh in shared memory, any batch, one block or a cluster);
// the fused kernels (W_hh in registers, the cell in the lanes that sum the products, no block-wide
// barrier per step in a cluster) are in rnn_fused_kernels.cuh, the grid layout's in
// rnn_grid_kernels.cuh.
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
//   kCluster nc <= 16 blocks of one thread-block cluster: st.async stores into the other blocks'
//            shared memory (distributed shared memory), each counting its bytes on the receiver's
//            mbarrier (Mailbox below); a block waits only until its own bytes have arrived.
//   kGrid    W_hh too large for a cluster: the exchange goes through global memory (L2) and a
//            barrier on a per-group arrival counter (grid_barrier below). The host launches it
//            cooperatively, which guarantees that every block of the grid is resident at once, so
//            the spinning blocks cannot wait for a block that never gets an SM.
//
// Synchronisation protocol (why every buffer is safe to reuse)
// ------------------------------------------------------------
// Exchange buffers are double-buffered by step parity, and each step ends with one group barrier
// (GroupBarrier below: __syncthreads / grid barrier) or, in a cluster, with the wait for this
// block's bytes of the step (Mailbox below).
// At step s a block reads the buffer of parity s (written by every block at step s-1, before
// barrier s-1) and writes the buffer of parity s+1. A block can only write parity s+1 again at
// step s+2, after passing barrier s+1, which every block reaches only after finishing step s+1 and
// therefore its reads of parity s+1 at step s+1... and its reads of that parity at step s were
// before barrier s. So no block overwrites a buffer another block may still read. In a cluster the
// same holds without a barrier: a block stores into parity s+1 again at step s+2 only after it has
// received every block's step s+1 data, which each block sends after its step s reads of that
// buffer are done (a __syncthreads orders them); the receiver arms the buffer's mbarrier for a
// step only after its wait for the buffer's previous fill, and that fill's phase parity is
// (fill index) & 1. Blocks
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

#include "vlseq/rnn_types.h"

namespace vlseq::rnn {

namespace cg = cooperative_groups;

enum class Sync : int { kLocal = 0, kCluster = 1, kGrid = 2 };

constexpr int kThreads = 256;
constexpr int kRowTile = 2;  // rows of W per product tile (the batch side, BT, is a template)
constexpr int kMaxCluster = 16;
constexpr int kWarps = kThreads / 32;
// (sample, unit) pairs per thread in the cell phase: the planner keeps bs * hs <= kThreads * kMaxItems,
// so each thread's pairs are computed once and held in registers.
constexpr int kMaxItems = 4;
// The fused kernels' W_hh in registers: float4 chunks of k per lane and row (forward: G rows, the
// gates of one unit; backward: one column as 4 * kFusedChunks chunks of four gates), at most
// 4 x 4 x 4 = 64 registers.
constexpr int kFusedChunks = 4;

__host__ __device__ constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }
__host__ __device__ constexpr int ceil_div(int x, int m) { return (x + m - 1) / m; }

// The layout of one layer's launch, chosen by the host (rnn.cu) and read by every block.
struct Geometry {
  int B, T, H;
  int nc;     // blocks per group
  int hs;     // hidden units per block (the last block may hold fewer)
  int bs;     // samples per group
  int chunk;  // kGrid: columns of h staged in shared memory at once (rnn_grid_kernels.cuh); = bs otherwise
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
  // The fused kernels' grouping: the samples in descending order of length (rnn_fused_kernels.cuh);
  // null: 0 .. B-1, which is that order only when the lengths do not increase. The generic kernels
  // ignore it.
  const int64_t* order;
  float* y;
  float* h_n;
  float* c_n;
  float* saved;
  float* cs;
  float* xchg;         // kGrid: [2][groups][bs][round_up(H, 4)], the padding zero
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
  const int64_t* order;  // as in ForwardArgs
  const float* dy;    // may be null
  const float* dh_n;  // may be null
  const float* dc_n;  // may be null
  float* dgates;
  float* dgates_hn;
  float* dh0;
  float* dc0;
  float* xchg;  // kGrid: [2][groups][nc][bs][nc * hs]
  unsigned* arrivals;
};

// Byte offsets into dynamic shared memory; the host sizes the launch with the same arithmetic.
struct ForwardSmem {
  int w, h, gates, hown, cown, lens, bars, total;
  __host__ __device__ ForwardSmem(const Geometry& g, int G, int wbytes, int bt) {
    const int R = G * g.hs, Kp = round_up(g.H, 4);
    int off = 0;
    w = off, off += round_up(round_up(R, kRowTile) * (Kp + 4) * wbytes, 16);
    h = off, off += 2 * round_up(g.bs, bt) * Kp * 4;
    gates = off, off += round_up(g.bs * R * 4, 16);
    hown = off, off += round_up(g.bs * g.hs * 4, 16);
    cown = off, off += round_up(g.bs * g.hs * 4, 16);
    lens = off, off += round_up(g.bs * 4, 16);
    bars = off, off += 16;
    total = off;
  }
};

// Per (sample, unit) the backward step reads F values: LSTM i, f, g, o, c_t, c_{t-1}, dy;
// GRU r, z, n, W_hn h + b_hn, h_{t-1}, dy.
__host__ __device__ constexpr int backward_fields(Cell c) { return c == Cell::kLSTM ? 7 : 6; }

struct BackwardSmem {
  int wt, dg, recv, dh, dc, ddir, lens, bars, total;
  __host__ __device__ BackwardSmem(const Geometry& g, int G, int wbytes, int bt, int F) {
    const int Rp = round_up(G * g.hs, 4), Kp = round_up(g.H, 4);
    int off = 0;
    wt = off, off += round_up(Kp * (Rp + 4) * wbytes, 16);
    dg = off, off += round_up(g.bs, bt) * Rp * 4;
    recv = off, off += 2 * g.nc * g.bs * g.hs * 4;
    dh = off, off += round_up(g.bs * g.hs * 4, 16);
    dc = off, off += round_up(g.bs * g.hs * 4, 16);
    ddir = off, off += round_up(g.bs * g.hs * 4, 16);
    lens = off, off += round_up(g.bs * 4, 16);
    bars = off, off += 16;
    total = off;
  }
};

// The fused kernels: lanes per hidden unit (a power of 2 up to a warp, as many as keep the threads
// busy), and whether a layer fits them: every unit of a block on its own lanes, the block's samples
// in one batch tile with a lane for each (ks >= bt), W_hh within fused_chunks chunks per lane and row.
// A single block of one or two samples works with 4 warps of its 8 (the rest leave after the set-up),
// each lane holding twice the chunks: a step's instructions outside the products (the butterfly, the
// cell, loads and stores: ~3/4 of them at hidden 64) then issue once for 4 warps, not for 8 (hidden 64:
// backward step 1,586 -> 1,362 clocks; the forward's did not move, 1,196 -> 1,188).
__host__ __device__ constexpr bool fused_few_workers(bool local, int bt) { return local && bt <= 2; }
__host__ __device__ constexpr int fused_workers(bool local, int bt) {
  return fused_few_workers(local, bt) ? kThreads / 2 : kThreads;
}
// `wide`: a cluster block holding twice the chunks (fits_fused's `wide`), so that a layer fits in half the
// blocks: LSTM 256 fp32 in 8, where a one-sample pass beside others is bound by the SMs its clusters
// hold (BENCHMARKS.md, eighteenth session), not by its step.
__host__ __device__ constexpr int fused_chunks(bool local, int bt, bool wide = false) {
  return fused_few_workers(local, bt) || wide ? 2 * kFusedChunks : kFusedChunks;
}
// The wide cluster kernels are built for batch tiles of 1, 2 and 4 (each lane's registers hold twice the
// weights: the LSTM's tile of 4 takes 231 / 254 registers forward / backward, no spills; a tile of 8 would
// add 16 more sums a lane).
constexpr int kWideMaxTile = 4;
// The backward's units per lane group (FusedThread): with few workers each lane multiplies two units'
// columns, so that each chunk of gate gradients it reads from shared memory serves both (the products
// read half as much; they had been bound by shared-memory wavefronts: hidden 64 backward step 1,362 ->
// 1,311 clocks).
__host__ __device__ constexpr int fused_units(bool local, int bt) { return fused_few_workers(local, bt) ? 2 : 1; }
__host__ __device__ inline int fused_lanes(int hs, int workers) {
  int ks = 1;
  while (ks < 32 && hs * ks * 2 <= workers) ks *= 2;
  return ks;
}
__host__ __device__ inline bool fits_fused(int G, int H, int hs, int bs, int bt, bool local, bool wide = false) {
  if (wide && (local || bt > kWideMaxTile)) return false;
  const int workers = fused_workers(local, bt), chunks = fused_chunks(local, bt, wide), U = fused_units(local, bt);
  const int ks = fused_lanes(hs, workers), ksb = fused_lanes(ceil_div(hs, U), workers);  // forward, backward
  return bs <= bt && hs * ks <= workers && ks >= bt && ceil_div(round_up(H, 4) / 4, ks) <= chunks &&
         ceil_div(hs, U) * ksb <= workers && ksb / U >= bt && ceil_div(H, ksb) <= 4 * chunks / U;
}

// Shared memory of the fused kernels: two exchange buffers (step parity) of bt rows of `row` floats
// (forward: h, row = round_up(H, 4); backward: the recurrent gate gradients of every unit, four per
// unit, row = 4 * H), the lengths, the mailbox.
struct FusedSmem {
  int v, lens, bars, total;
  __host__ __device__ FusedSmem(const Geometry& g, int row, int bt) {
    int off = 0;
    v = off, off += 2 * bt * row * 4;
    lens = off, off += round_up(g.bs * 4, 16);
    bars = off, off += 16;
    total = off;
  }
};

// The fused backward with a reduce-scatter (rnn_scatter_kernel.cuh): where it applies (fp32), and its
// shared memory: the received partial dh (two parities x nc source blocks x bt samples x hs units),
// the step's gate gradients (bt x hs float4s), the partials per unit group (bt x hs / 4 x Kp / 4
// float4s), the lengths, the mailbox.
__host__ __device__ inline bool fits_scatter(int H, int hs, int bs, int bt) {
  return hs % 4 == 0 && (hs / 4) * (round_up(H, 4) / 4) <= kThreads && bt * hs <= kThreads && bs <= bt;
}
struct ScatterSmem {
  int recv, g, red, lens, bars, total;
  __host__ __device__ ScatterSmem(const Geometry& geo, int bt) {
    int off = 0;
    recv = off, off += 2 * geo.nc * bt * geo.hs * 4;
    g = off, off += bt * geo.hs * 16;
    red = off, off += bt * (geo.hs / 4) * (round_up(geo.H, 4) / 4) * 16;
    lens = off, off += round_up(geo.bs * 4, 16);
    bars = off, off += 16;
    total = off;
  }
};

// The kernel for a cell, weight precision and batch tile (1, 2, 4 or 8), as a launchable pointer
// (rnn_forward.cu, rnn_backward.cu instantiate them with VLSEQ_RNN_KERNEL_TABLE). `fused`: the fused
// kernel (fp32; fits_fused says when it applies), else the generic one; `local`: the fused kernel's
// single-block form (Sync::kLocal); `wide`: its cluster form with twice the chunks (fused_chunks).
const void* forward_kernel(Cell c, Weights w, int bt, bool fused, bool local, bool wide);
const void* backward_kernel(Cell c, Weights w, int bt, bool fused, bool local, bool wide);
const void* backward_scatter_kernel(Cell c, int bt);  // rnn_backward_scatter.cu (fp32)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The exchange of a cluster. Each block has one mbarrier per buffer parity (arrival count 1):
// thread 0 arms it for a step with the bytes the step will bring (mbarrier.arrive.expect_tx; the
// peers' bytes may arrive before it does, the transaction count may go below zero meanwhile), the
// senders' st.async stores count their bytes on it (complete_tx, release at cluster scope), and the
// phase completes when every byte has arrived. The waiters acquire at cluster scope, which makes the
// stored data visible to them. Unlike a cluster barrier, nobody waits for the slowest block's
// release of its stores, only for the bytes it needs.
struct Mailbox {
  uint32_t bars;  // this block's two mbarriers (shared::cta address)
  __device__ __forceinline__ uint32_t bar(int parity) const { return bars + 8 * parity; }

  __device__ __forceinline__ explicit Mailbox(uint64_t* b) : bars(smem_u32(b)) {
    if (threadIdx.x == 0) {
      for (int p = 0; p < 2; ++p) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar(p)) : "memory");
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // before the set-up's cluster barrier
    }
  }
  __device__ __forceinline__ void expect(int parity, uint32_t bytes) const {
    if (threadIdx.x == 0)  // no arrival token (_): the wait goes by phase parity
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar(parity)), "r"(bytes)
                   : "memory");
  }
  __device__ __forceinline__ void wait(int parity, uint32_t phase) const {
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
          " selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done) : "r"(bar(parity)), "r"(phase) : "memory");
    }
  }
  // The address in block `rank` of the cluster of this block's shared-memory address `local`.
  __device__ __forceinline__ static uint32_t peer(uint32_t local, int rank) {
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(local), "r"(rank));
    return r;
  }
  __device__ __forceinline__ void send(int rank, uint32_t local_dst, int parity, float v) const {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];\n"
                 ::"r"(peer(local_dst, rank)), "f"(v), "r"(peer(bar(parity), rank)) : "memory");
  }
  __device__ __forceinline__ void send(int rank, uint32_t local_dst, int parity, float4 v) const {
    send_mapped(peer(local_dst, rank), peer(bar(parity), rank), v);
  }
  // A send whose destination and mbarrier are already cluster addresses (peer): a block that sends
  // to the same peer every step maps them once.
  __device__ __forceinline__ static void send_mapped(uint32_t dst, uint32_t mbar, float4 v) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n"
                 ::"r"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(mbar) : "memory");
  }
};

// Lanes that split one tile's reduction: as many as keep every thread busy, at most 32 (one warp:
// they combine with shuffles) and at most one float4 chunk each.
__host__ __device__ inline int split_lanes(int rows, int nb, int bt, int k4n) {
  const int tiles = ceil_div(rows, kRowTile) * ceil_div(nb, bt);
  int ks = 1;
  while (ks < 32 && tiles * ks * 2 <= kThreads && ks * 2 <= k4n) ks *= 2;
  return ks;
}

#if defined(__CUDACC__)

// Phase timestamps of block 0, thread 0, for benchmarks/probe/step_timing.cu (compiled out otherwise): the SM
// clock at each phase, and the global timer (ns) at phase 0 of every 64th step, which gives the SM clock's rate
// during the steps (kernels heavy on the tensor cores can run below the clock an idle spin measures).
#ifdef VLSEQ_RNN_TIMING
__device__ long long g_step_clock[2][8][4096];
__device__ unsigned long long g_step_ns[2][4096];
__device__ __forceinline__ void mark_step(int dir, int k, int s) {
  g_step_clock[dir][k][s] = clock64();
  if (k == 0 && s % 64 == 0) {
    unsigned long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    g_step_ns[dir][s] = ns;
  }
}
#define VLSEQ_MARK(dir, k, s) \
  if (threadIdx.x == 0 && blockIdx.x == 0 && (s) >= 0 && (s) < 4096) mark_step(dir, k, s)
#else
#define VLSEQ_MARK(dir, k, s)
#endif

// Asks L2 for the line at p without a register to wait on: the fused kernels ask for the step after
// next's inputs, so that the next step's register loads (one step ahead) find them in L2, not in
// HBM (a batch's saved fields and input projections outgrow the 50 MB L2).
#ifndef VLSEQ_RNN_L2_PREFETCH
#define VLSEQ_RNN_L2_PREFETCH 1
#endif
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if VLSEQ_RNN_L2_PREFETCH
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// Activations with the fast exponential and division: ~2e-7 absolute error, far inside the 1e-5
// relative bar against float64, and a short dependency chain (the cell is on every step's path).
__device__ __forceinline__ float sigmoid(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }

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

__device__ __forceinline__ unsigned load_relaxed(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The group barrier, split in two so that work that nobody waits for (this step's outputs to global
// memory, the prefetch of a later step) runs while the other blocks catch up: arrive() publishes
// this block's exchange writes, wait() returns when every block of the group has arrived and makes
// their writes visible.
//   kLocal   wait() is __syncthreads.
//   kCluster barrier.cluster.arrive.release / wait.acquire, once after the set-up (every block has
//            started and initialised its mbarriers before the first remote store); the steps use the
//            Mailbox.
//   kGrid    a per-group counter that only grows: barrier n is complete when it reaches n * nc.
//            Thread 0 publishes the block's global writes (ordered before it by __syncthreads) with a
//            release add, spins on relaxed loads, then acquires once with a fence. Release/acquire is
//            all it needs (each block must see the writes made before the others' arrivals); the
//            __threadfence it had is sequentially consistent (MEMBAR.SC), and an acquire load per
//            poll invalidates L1 each time. The closing __syncthreads hands that view to the other
//            threads (cooperative_groups' grid.sync() pattern).
struct GroupBarrier {
  Sync mode;
  unsigned* counter;
  unsigned nc;
  unsigned arrived;
  __device__ __forceinline__ void arrive() {
    if (mode == Sync::kCluster) {
      asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
    } else if (mode == Sync::kGrid) {
      __syncthreads();
      arrived += nc;
      if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(counter) : "memory");
    }
  }
  __device__ __forceinline__ void wait() {
    if (mode == Sync::kCluster) {
      asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    } else if (mode == Sync::kGrid) {
      if (threadIdx.x == 0) {
        while (load_relaxed(counter) < arrived) {
        }
        asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
      }
      __syncthreads();
    } else {
      __syncthreads();
    }
  }
};

// The end of every kernel's set-up: this block's shared memory written (a __syncthreads), then the
// group barrier, after which every block of the group has started and initialised its mailbox (no
// remote store can reach a block before). Returns the longest of the group's `bs` lengths.
__device__ __forceinline__ int finish_setup(GroupBarrier& bar, const int* lens, int bs) {
  __syncthreads();
  int smax = 0;
  for (int b = 0; b < bs; ++b) smax = max(smax, lens[b]);
  bar.arrive();
  bar.wait();
  return smax;
}

// The ks consecutive lanes that split sums over k combine their parts with a butterfly: every lane
// ends with the same totals (each level adds the same two values, in either order), summed in a
// fixed order (the same bits every run). Every lane of the warp must call it (the shuffles).
template <int N>
__device__ __forceinline__ void lane_sum(float (&v)[N], int ks) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    if (off < ks) {
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], off);
    }
  }
}

// acc[i * BT + j] += sum over chunks k4 = k4b, k4b + step, ... < k4e of W row i . v row j, where row i
// of W starts at w + i * wrow and row j of v at v + j * ldv (chunk k4 at 4 * k4; of W, at 4 * (k4 ^ wswz):
// the grid backward's swizzled rows); UNROLL iterations unrolled.
template <int RT, int BT, int UNROLL, typename WT>
__device__ __forceinline__ void tile_fma(float (&acc)[RT * BT], const WT* w, int wrow, const float* v, int ldv, int k4b,
                                         int k4e, int step, int wswz = 0) {
#pragma unroll UNROLL
  for (int k4 = k4b; k4 < k4e; k4 += step) {
    float4 wv[RT];
#pragma unroll
    for (int i = 0; i < RT; ++i) wv[i] = load4(w + i * wrow + 4 * (k4 ^ wswz));
#pragma unroll
    for (int j = 0; j < BT; ++j) {
      const float4 x = *reinterpret_cast<const float4*>(v + j * ldv + 4 * k4);
#pragma unroll
      for (int i = 0; i < RT; ++i) {
        float& sum = acc[i * BT + j];
        sum = fmaf(wv[i].x, x.x, sum);
        sum = fmaf(wv[i].y, x.y, sum);
        sum = fmaf(wv[i].z, x.z, sum);
        sum = fmaf(wv[i].w, x.w, sum);
      }
    }
  }
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
    float acc[kRowTile * BT];  // row i, sample j at i * BT + j
#pragma unroll
    for (int i = 0; i < kRowTile * BT; ++i) acc[i] = 0.0f;
    tile_fma<kRowTile, BT, 2>(acc, W + r0 * ldw, ldw, v + b0 * ldv, ldv, q, k4n, ks);
    lane_sum(acc, ks);
    if (q == 0 && tile_raw < ntiles) {
#pragma unroll
      for (int i = 0; i < kRowTile; ++i)
#pragma unroll
        for (int j = 0; j < BT; ++j)
          if (r0 + i < rows && b0 + j < nb) store(b0 + j, r0 + i, acc[i * BT + j]);
    }
  }
}

// The cell's forward for one (sample, unit) (the fused and the grid kernels): x the input projections,
// gh the recurrent products with b_hh; h, c the state (GRU: c unused); out what the backward reads
// (LSTM i, f, g, o; GRU r, z, n, gh_n).
template <Cell C, int G>
__device__ __forceinline__ void forward_cell(const float (&x)[G], const float (&gh)[G], float& h, float& c,
                                             float (&out)[4]) {
  if constexpr (C == Cell::kLSTM) {
    const float ig = sigmoid(x[0] + gh[0]), fg = sigmoid(x[1] + gh[1]);
    const float gg = tanhf(x[2] + gh[2]), og = sigmoid(x[3] + gh[3]);
    c = fg * c + ig * gg;
    h = og * tanhf(c);
    out[0] = ig, out[1] = fg, out[2] = gg, out[3] = og;
  } else {
    const float r = sigmoid(x[0] + gh[0]), z = sigmoid(x[1] + gh[1]);
    const float n = tanhf(x[2] + r * gh[2]);
    h = (1.0f - z) * n + z * h;
    out[0] = r, out[1] = z, out[2] = n, out[3] = gh[2];
  }
}

// This thread's (sample, unit) pairs of the block: item i is pair tid + i * kThreads of the
// row-major bv x hv grid; b = -1 past the end.
template <int N = kMaxItems>
struct Items {
  int b[N], j[N];
  __device__ __forceinline__ Items(int bv, int hv) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int e = static_cast<int>(threadIdx.x) + i * kThreads;
      b[i] = e < bv * hv ? e / hv : -1;
      j[i] = e < bv * hv ? e - b[i] * hv : 0;
    }
  }
};

// A step's per-pair registers from those loaded a step ahead.
template <int N, int F>
__device__ __forceinline__ void copy_items(float (&dst)[N][F], const float (&src)[N][F]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int f = 0; f < F; ++f) dst[i][f] = src[i][f];
}

// Where this block sits: group `group` runs samples [b0, b0 + bv), block `rank` of it owns hidden
// units [j0, j0 + hv).
struct Block {
  int groups, rank, group, j0, hv, b0, bv;
  __device__ __forceinline__ explicit Block(const Geometry& g) {
    groups = gridDim.x / g.nc;
    rank = blockIdx.x % g.nc, group = blockIdx.x / g.nc;
    j0 = rank * g.hs, hv = max(0, min(g.hs, g.H - j0));
    b0 = group * g.bs, bv = min(g.bs, g.B - b0);
  }
};

// The W_hh row of this block's row r: gate q = r / hs, unit j0 + r % hs (row q*H + j0 + j), or null for
// a padding row (past the G gates' rows, or past the block's hv units). Every kernel reads its rows so.
__device__ __forceinline__ const float* block_row(const float* w_hh, int G, const Geometry& g, const Block& blk, int r) {
  const int q = r / g.hs, j = r - q * g.hs;
  return r < G * g.hs && j < blk.hv ? w_hh + static_cast<int64_t>(q * g.H + blk.j0 + j) * g.H : nullptr;
}

// This block's rows of W_hh (block_row), zero padded to `rows` x `cols`, into w as w[r * ld + k] or,
// transposed, w[k * ld + r]. k runs fastest so that the reads of W_hh rows coalesce.
template <bool kTransposed, typename WT>
__device__ __forceinline__ void load_weights(WT* w, int ld, int rows, int cols, const float* w_hh, int G, const Geometry& g,
                             const Block& blk) {
  for (int e = threadIdx.x; e < rows * cols; e += kThreads) {
    const int r = e / cols, k = e - r * cols;
    const float* row = block_row(w_hh, G, g, blk, r);
    w[kTransposed ? k * ld + r : r * ld + k] = to_weight<WT>(row && k < g.H ? row[k] : 0.0f);
  }
}

// The (sample, time) row of sample b of the group at step s: time s, or len-1-s in reverse.
__device__ __forceinline__ int64_t step_row(const Geometry& g, const Block& blk, int b, int len, int s) {
  return static_cast<int64_t>(blk.b0 + b) * g.T + (g.reverse ? len - 1 - s : s);
}

__device__ __forceinline__ void load_lengths(int* lens, const int64_t* lengths, const Geometry& g, const Block& blk) {
  for (int b = threadIdx.x; b < g.bs; b += kThreads)
    lens[b] = b < blk.bv ? static_cast<int>(clamp_length(lengths[blk.b0 + b], g.T)) : 0;
}

// The outputs at step s of this thread's pairs still running (`live`): y = h, saved = out (what the
// backward reads, forward_cell), cs = c (LSTM).
template <Cell C, int N>
__device__ __forceinline__ void store_step_outputs(const ForwardArgs& a, const Block& blk, const Items<N>& it,
                                                   const int* lens, int s, const bool (&live)[N], const float (&h)[N],
                                                   const float (&c)[N], const float (&out)[N][4]) {
  const int H = a.g.H;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if (!live[i]) continue;
    const int64_t row = step_row(a.g, blk, it.b[i], lens[it.b[i]], s), unit = blk.j0 + it.j[i];
    a.y[row * H + unit] = h[i];
    reinterpret_cast<float4*>(a.saved)[row * H + unit] = make_float4(out[i][0], out[i][1], out[i][2], out[i][3]);
    if constexpr (C == Cell::kLSTM) a.cs[row * H + unit] = c[i];
  }
}

// The input projections at step s of this thread's pairs still running, into x (loaded a step ahead:
// their latency hides behind the barrier and the next products), and a request to L2 for step s + 1's
// (a batch's projections outgrow L2; the next register loads then find them there).
template <int G, int N>
__device__ __forceinline__ void load_step_inputs(const ForwardArgs& a, const Block& blk, const Items<N>& it,
                                                 const int* lens, int s, float (&x)[N][G]) {
  const Geometry& g = a.g;
  const int64_t GH = static_cast<int64_t>(G) * g.H;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int b = it.b[i];
    if (b < 0) continue;
    const int len = lens[b];
    const float* row = a.xproj + static_cast<int64_t>(blk.b0 + b) * g.T * GH + blk.j0 + it.j[i];
    if (s < len) {
      const int64_t t = g.reverse ? len - 1 - s : s;
#pragma unroll
      for (int q = 0; q < G; ++q) x[i][q] = __ldg(row + t * GH + q * g.H);
    }
    if (s + 1 < len) {
      const int64_t t = g.reverse ? len - 2 - s : s + 1;
#pragma unroll
      for (int q = 0; q < G; ++q) prefetch_l2(row + t * GH + q * g.H);
    }
  }
}

template <Cell C, typename WT, int BT>
__global__ void __launch_bounds__(kThreads, 1) rnn_forward_kernel(const ForwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int G = C == Cell::kLSTM ? 4 : 3;
  const Geometry& g = a.g;
  const int H = g.H, hs = g.hs, R = G * hs;
  const int Kp = round_up(H, 4), ldw = Kp + 4;
  const Block blk(g);
  const int j0 = blk.j0, hv = blk.hv, b0 = blk.b0, bv = blk.bv;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool cluster = g.sync == Sync::kCluster;

  extern __shared__ __align__(16) unsigned char smem[];
  const ForwardSmem lay(g, G, sizeof(WT), BT);
  WT* w_s = reinterpret_cast<WT*>(smem + lay.w);
  float* h_s = reinterpret_cast<float*>(smem + lay.h);
  float* gates_s = reinterpret_cast<float*>(smem + lay.gates);
  float* hown = reinterpret_cast<float*>(smem + lay.hown);
  float* cown = reinterpret_cast<float*>(smem + lay.cown);
  int* lens = reinterpret_cast<int*>(smem + lay.lens);
  const Mailbox mbox(reinterpret_cast<uint64_t*>(smem + lay.bars));
  const int hbuf = round_up(g.bs, BT) * Kp;  // floats per h buffer

  load_weights<false>(w_s, ldw, round_up(R, kRowTile), ldw, a.w_hh, G, g, blk);
  load_lengths(lens, a.lengths, g, blk);
  for (int e = tid; e < g.bs * hs; e += kThreads) {
    const int b = e / hs, j = e - b * hs;
    const bool mine = b < bv && j < hv;
    const int64_t at = static_cast<int64_t>(b0 + b) * H + j0 + j;
    hown[e] = mine ? a.h0[at] : 0.0f;
    cown[e] = mine && C == Cell::kLSTM ? a.c0[at] : 0.0f;
  }
  // Buffer 0 = h0 of the group's samples; other entries zero. Later steps write only rows < bv,
  // columns < H, which this set-up leaves to them.
  for (int e = tid; e < 2 * hbuf; e += kThreads) {
    const int buf = e / hbuf, rem = e - buf * hbuf, b = rem / Kp, k = rem - b * Kp;
    if (buf == 0 && b < bv && k < H)
      h_s[e] = a.h0[static_cast<int64_t>(b0 + b) * H + k];
    else if (b >= bv || k >= H)
      h_s[e] = 0.0f;
  }
  const Items it(bv, hv);
  float bias[kMaxItems][G];
#pragma unroll
  for (int i = 0; i < kMaxItems; ++i)
#pragma unroll
    for (int q = 0; q < G; ++q) bias[i][q] = it.b[i] >= 0 && a.b_hh ? a.b_hh[q * H + j0 + it.j[i]] : 0.0f;
  GroupBarrier bar{g.sync, nullptr, static_cast<unsigned>(g.nc), 0u};
  const int smax = finish_setup(bar, lens, g.bs);

  float xnext[kMaxItems][G];
  const int ks = split_lanes(R, bv, BT, Kp / 4);
  load_step_inputs(a, blk, it, lens, 0, xnext);
  // Sent per unit, or per 4 units where the rows of h_s and hown stay 16-byte aligned.
  const int vec = hs % 4 == 0 && hv % 4 == 0 ? 4 : 1, sends_per_row = hv / vec;
  for (int s = 0; s < smax; ++s) {
    const int cur = s & 1;
    if (cluster) mbox.expect(cur ^ 1, static_cast<uint32_t>(bv * H * 4));
    float x[kMaxItems][G];
    copy_items(x, xnext);
    VLSEQ_MARK(0, 0, s);
    // Recurrent products: gates_s[b * R + r] = W_hh row r . h_{t-1} of sample b.
    matvec<BT>(w_s, ldw, R, Kp / 4, h_s + cur * hbuf, Kp, bv, ks,
               [&](int b, int r, float v) { gates_s[b * R + r] = v; });
    VLSEQ_MARK(0, 1, s);
    __syncthreads();
    VLSEQ_MARK(0, 2, s);
    // The cell, for this thread's (sample, unit) pairs still running. Outputs stay in registers
    // until the barrier has been arrived at.
    float out[kMaxItems][4], hnew[kMaxItems], cnew[kMaxItems];
    bool live[kMaxItems];
#pragma unroll
    for (int i = 0; i < kMaxItems; ++i) {
      const int b = it.b[i], j = it.j[i];
      live[i] = b >= 0 && s < lens[b];
      if (!live[i]) continue;
      float gh[G];
#pragma unroll
      for (int q = 0; q < G; ++q) gh[q] = gates_s[b * R + q * hs + j] + bias[i][q];
      hnew[i] = hown[b * hs + j], cnew[i] = cown[b * hs + j];
      forward_cell<C>(x[i], gh, hnew[i], cnew[i], out[i]);
      hown[b * hs + j] = hnew[i], cown[b * hs + j] = cnew[i];
    }
    __syncthreads();
    VLSEQ_MARK(0, 3, s);
    // Publish this block's units of h (frozen samples too) to every block of the group: one row
    // (destination block, sample) per warp, units over the lanes.
    if (cluster) {
      const uint32_t next = smem_u32(h_s + (cur ^ 1) * hbuf);
      for (int e = tid; e < g.nc * bv * sends_per_row; e += kThreads) {
        const int dst = e / (bv * sends_per_row), rem = e - dst * bv * sends_per_row;
        const int b = rem / sends_per_row, j = (rem - b * sends_per_row) * vec;
        const uint32_t to = next + 4 * (b * Kp + j0 + j);
        if (vec == 4)
          mbox.send(dst, to, cur ^ 1, *reinterpret_cast<const float4*>(hown + b * hs + j));
        else
          mbox.send(dst, to, cur ^ 1, hown[b * hs + j]);
      }
    } else {
      float* next = h_s + (cur ^ 1) * hbuf;
      for (int row = warp; row < bv; row += kWarps)
        for (int j = lane; j < hv; j += 32) next[row * Kp + j0 + j] = hown[row * hs + j];
    }
    VLSEQ_MARK(0, 4, s);
    if (!cluster) bar.arrive();
    VLSEQ_MARK(0, 5, s);
    store_step_outputs<C>(a, blk, it, lens, s, live, hnew, cnew, out);
    load_step_inputs(a, blk, it, lens, s + 1, xnext);
    VLSEQ_MARK(0, 6, s);
    if (cluster)
      mbox.wait(cur ^ 1, (s >> 1) & 1);
    else
      bar.wait();
    VLSEQ_MARK(0, 7, s);
  }
#pragma unroll
  for (int i = 0; i < kMaxItems; ++i) {
    if (it.b[i] < 0) continue;
    const int at = it.b[i] * hs + it.j[i];
    const int64_t o = static_cast<int64_t>(b0 + it.b[i]) * H + j0 + it.j[i];
    a.h_n[o] = hown[at];
    if constexpr (C == Cell::kLSTM) a.c_n[o] = cown[at];
  }
#endif
}

template <Cell C, typename WT, int BT>
__global__ void __launch_bounds__(kThreads, 1) rnn_backward_kernel(const BackwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int G = C == Cell::kLSTM ? 4 : 3;
  constexpr int F = backward_fields(C);
  const Geometry& g = a.g;
  const int H = g.H, T = g.T, hs = g.hs, R = G * hs, GH = G * H;
  const int Kp = round_up(H, 4), Rp = round_up(R, 4), ldt = Rp + 4;
  const Block blk(g);
  const int rank = blk.rank, j0 = blk.j0, hv = blk.hv, b0 = blk.b0, bv = blk.bv;
  const int tid = threadIdx.x;
  const bool cluster = g.sync == Sync::kCluster;

  extern __shared__ __align__(16) unsigned char smem[];
  const BackwardSmem lay(g, G, sizeof(WT), BT, F);
  WT* wt_s = reinterpret_cast<WT*>(smem + lay.wt);  // [k][r]: W_hh transposed, own rows
  float* dg_s = reinterpret_cast<float*>(smem + lay.dg);
  float* recv_s = reinterpret_cast<float*>(smem + lay.recv);
  float* dh_s = reinterpret_cast<float*>(smem + lay.dh);
  float* dc_s = reinterpret_cast<float*>(smem + lay.dc);
  float* ddir = reinterpret_cast<float*>(smem + lay.ddir);
  int* lens = reinterpret_cast<int*>(smem + lay.lens);
  const Mailbox mbox(reinterpret_cast<uint64_t*>(smem + lay.bars));

  load_weights<true>(wt_s, ldt, ldt, Kp, a.w_hh, G, g, blk);
  for (int e = tid; e < round_up(g.bs, BT) * Rp; e += kThreads) dg_s[e] = 0.0f;
  load_lengths(lens, a.lengths, g, blk);
  for (int e = tid; e < g.bs * hs; e += kThreads) {
    const int b = e / hs, j = e - b * hs;
    const bool mine = b < bv && j < hv;
    const int64_t at = static_cast<int64_t>(b0 + b) * H + j0 + j;
    dh_s[e] = mine && a.dh_n ? a.dh_n[at] : 0.0f;
    dc_s[e] = mine && a.dc_n ? a.dc_n[at] : 0.0f;
    ddir[e] = 0.0f;
  }
  const Items it(bv, hv);
  GroupBarrier bar{g.sync, nullptr, static_cast<unsigned>(g.nc), 0u};
  const int smax = finish_setup(bar, lens, g.bs);

  // The sum, in rank order, of the partial dh that every block delivered for pair (b, j) at a
  // step of parity `parity`.
  auto received = [&](int parity, int b, int j) {
    float acc = 0.0f;
    const float* src = recv_s + (parity * g.nc * g.bs + b) * hs + j;
#pragma unroll 8
    for (int q = 0; q < g.nc; ++q) acc += src[q * g.bs * hs];
    return acc;
  };

  // What step s reads for this thread's pairs, loaded one step ahead into registers: LSTM i, f, g,
  // o, c_t, c_{t-1}, dy; GRU r, z, n, W_hn h + b_hn, h_{t-1}, dy.
  float pnext[kMaxItems][F];
  auto prefetch = [&](int s) {
#pragma unroll
    for (int i = 0; i < kMaxItems; ++i) {
      if (s < 0 || it.b[i] < 0 || s >= lens[it.b[i]]) continue;
      const int b = it.b[i], len = lens[b];
      const int t = g.reverse ? len - 1 - s : s, tp = g.reverse ? len - s : s - 1;  // tp: the step before
      const int64_t first = static_cast<int64_t>(b0 + b) * T, unit = j0 + it.j[i];
      const int64_t at = first + t, prev = first + tp;
      const float4 sv = __ldg(reinterpret_cast<const float4*>(a.saved) + at * H + unit);
      pnext[i][0] = sv.x, pnext[i][1] = sv.y, pnext[i][2] = sv.z, pnext[i][3] = sv.w;
      if constexpr (C == Cell::kLSTM) {
        pnext[i][4] = __ldg(a.cs + at * H + unit);
        pnext[i][5] = s > 0 ? __ldg(a.cs + prev * H + unit) : __ldg(a.c0 + static_cast<int64_t>(b0 + b) * H + unit);
      } else {
        pnext[i][4] = s > 0 ? __ldg(a.y + prev * H + unit) : __ldg(a.h0 + static_cast<int64_t>(b0 + b) * H + unit);
      }
      pnext[i][F - 1] = a.dy ? __ldg(a.dy + at * H + unit) : 0.0f;
    }
  };

  const int ks = split_lanes(H, bv, BT, Rp / 4);
  prefetch(smax - 1);
  for (int s = smax - 1; s >= 0; --s) {
    const int cur = s & 1;
    if (cluster) mbox.expect(cur, static_cast<uint32_t>(g.nc * bv * hv * 4));
    float p[kMaxItems][F];
    copy_items(p, pnext);
    VLSEQ_MARK(1, 0, s);
    VLSEQ_MARK(1, 1, s);
    float out[kMaxItems][G + 1];
    bool live[kMaxItems];
#pragma unroll
    for (int i = 0; i < kMaxItems; ++i) {
      const int b = it.b[i], j = it.j[i];
      live[i] = false;
      if (b < 0) continue;
      const int at = b * hs + j, len = lens[b];
      float dhc = dh_s[at];
      if (s + 1 < len) dhc = received(cur ^ 1, b, j) + ddir[at];  // dh_t from step s+1's exchange
      dh_s[at] = dhc;
      float* dgb = dg_s + b * Rp + j;  // gate q at dgb[q * hs]
      if (s >= len) {
#pragma unroll
        for (int q = 0; q < G; ++q) dgb[q * hs] = 0.0f;
        continue;
      }
      live[i] = true;
      const float dht = dhc + p[i][F - 1];
      if constexpr (C == Cell::kLSTM) {
        const float ig = p[i][0], fg = p[i][1], gg = p[i][2], og = p[i][3], ct = p[i][4], cp = p[i][5];
        const float tc = tanhf(ct);
        const float dct = dc_s[at] + dht * og * (1.0f - tc * tc);
        out[i][0] = dct * gg * ig * (1.0f - ig);
        out[i][1] = dct * cp * fg * (1.0f - fg);
        out[i][2] = dct * ig * (1.0f - gg * gg);
        out[i][3] = dht * tc * og * (1.0f - og);
        dc_s[at] = dct * fg;
#pragma unroll
        for (int q = 0; q < G; ++q) dgb[q * hs] = out[i][q];
      } else {
        const float r = p[i][0], z = p[i][1], n = p[i][2], ghn = p[i][3], hp = p[i][4];
        const float dn = dht * (1.0f - z) * (1.0f - n * n);
        out[i][0] = dn * ghn * r * (1.0f - r);
        out[i][1] = dht * (hp - n) * z * (1.0f - z);
        out[i][2] = dn;
        out[i][3] = dn * r;
        dgb[0] = out[i][0], dgb[hs] = out[i][1], dgb[2 * hs] = out[i][3];
        ddir[at] = dht * z;
      }
    }
    __syncthreads();
    VLSEQ_MARK(1, 2, s);
    // Partial dh_{t-1} over this block's rows for every unit k, delivered to k's owner.
    float* recv_next = recv_s + cur * g.nc * g.bs * hs;
    auto deliver = [&](int b, int k, float v) {
      const int owner = k / hs, at = (rank * g.bs + b) * hs + (k - owner * hs);
      if (cluster)
        mbox.send(owner, smem_u32(recv_next + at), cur, v);
      else
        recv_next[at] = v;
    };
    matvec<BT>(wt_s, ldt, H, Rp / 4, dg_s, Rp, bv, ks, deliver);
    VLSEQ_MARK(1, 3, s);
    if (!cluster) bar.arrive();
    VLSEQ_MARK(1, 4, s);
#pragma unroll
    for (int i = 0; i < kMaxItems; ++i) {
      if (!live[i]) continue;
      const int64_t row = step_row(g, blk, it.b[i], lens[it.b[i]], s), unit = j0 + it.j[i];
#pragma unroll
      for (int q = 0; q < G; ++q) a.dgates[row * GH + q * H + unit] = out[i][q];
      if constexpr (C == Cell::kGRU) a.dgates_hn[row * H + unit] = out[i][3];
    }
    prefetch(s - 1);
    VLSEQ_MARK(1, 5, s);
    if (cluster)
      mbox.wait(cur, ((smax - 1 - s) >> 1) & 1);
    else
      bar.wait();
    VLSEQ_MARK(1, 6, s);
  }
#pragma unroll
  for (int i = 0; i < kMaxItems; ++i) {
    const int b = it.b[i], j = it.j[i];
    if (b < 0) continue;
    const int at = b * hs + j;
    const float dh = lens[b] > 0 ? received(0, b, j) + ddir[at] : dh_s[at];
    const int64_t o = static_cast<int64_t>(b0 + b) * H + j0 + j;
    a.dh0[o] = dh;
    if constexpr (C == Cell::kLSTM) a.dc0[o] = dc_s[at];
  }
#endif
}

#endif  // __CUDACC__

}  // namespace vlseq::rnn
