// The grid layout's kernels: W_hh too large for a thread-block cluster (fp32 LSTM from hidden ~440 on)
// spread over up to one block per SM of a cooperative launch. The work split, the exchanges and the
// synchronisation protocol are the generic kernels' (rnn_kernels.cuh: block `rank` owns hidden units
// [rank*hs, rank*hs + hs); the forward all-gathers h, the backward reduce-scatters partial dh; both
// through double-buffered global buffers and the barrier on a per-group counter). What differs is
// that these kernels are built for many samples per block, where the generic ones were bound by
// shared-memory reads and by unoverlapped loads (fp32 LSTM 1024 at batch 32 ran 0.84x of cuDNN):
//  - products as register tiles of kGridRows rows x BT samples: a thread reads 8 + BT float4s from
//    shared memory for 32 * BT FMAs (the generic 2-row tile: 2 + BT for 8 * BT); shared memory's
//    bandwidth then matches the FMAs' rate, and the products ran at ~45% of it (BENCHMARKS.md, eleventh
//    and twelfth sessions: the exchange through L2 was measured apart and is not what bounds them);
//  - the forward stages h_{t-1} of the group's samples in chunks of k columns with cp.async into two
//    buffers: the L2 reads of chunk c + 1 run under the products of chunk c (cp.async.cg reads L2,
//    never a stale L1 line);
//  - the lanes that split a tile's sums end with a reduce-scatter butterfly (store_lane_totals):
//    each level a lane keeps half of its values and adds its partner's half of them, 60 shuffles for
//    64 values over 16 lanes where a full butterfly takes 256;
//  - the backward sums the nc partials of its units with float4 loads spread over the block's threads
//    (slices of the ranks, then the slices in order: a fixed order, the same bits every run).
// Where a block's rows fit in registers (fp32), rnn_forward_grid_regs_kernel and
// rnn_backward_grid_regs_kernel below hold them there instead and read only h or the gate gradients.
// Samples past their length are neither loaded, multiplied (a tile whose samples have all ended is
// skipped) nor delivered: nobody reads their products (a sample live at step s was live at s - 1).
#pragma once

#include <cuda_fp16.h>

#include "rnn_fused_kernels.cuh"

namespace vlseq::rnn {

constexpr int kGridRows = 8;  // rows of a product tile (forward: rows of W_hh; backward: hidden units)
// Iterations of a tile's k loop unrolled: the 8-row tile's weights and 64 sums take most registers, and
// 2 measured slower (BENCHMARKS.md, tenth session, run 4). -DVLSEQ_RNN_GRID_UNROLL=n for the probe's A/B.
#ifndef VLSEQ_RNN_GRID_UNROLL
#define VLSEQ_RNN_GRID_UNROLL 1
#endif
constexpr int kGridUnroll = VLSEQ_RNN_GRID_UNROLL;
// Partials a backward thread has in flight while it gathers dh (-DVLSEQ_RNN_GATHER_LOADS=n for the probe's A/B).
#ifndef VLSEQ_RNN_GATHER_LOADS
#define VLSEQ_RNN_GATHER_LOADS 8
#endif
constexpr int kGatherLoads = VLSEQ_RNN_GATHER_LOADS;
// (sample, unit) pairs per thread of the kernels with W_hh in registers (their cells' state shares the
// registers with W_hh): they take a block only where bs * hs <= kThreads * kGridRegItems.
constexpr int kGridRegItems = 2;

// Dynamic shared memory of the grid forward: the block's rows of W_hh (rows padded to kGridRows,
// columns to Kp + 4), two buffers of h (the group's samples padded to the batch tile, g.chunk columns
// each plus 4 of padding), the step's recurrent products (bs x R), the lengths.
struct GridForwardSmem {
  int w, h, gates, lens, total;
  __host__ __device__ GridForwardSmem(const Geometry& g, int G, int wbytes, int bt) {
    const int R = G * g.hs, Kp = round_up(g.H, 4);
    int off = 0;
    w = off, off += round_up(round_up(R, kGridRows) * (Kp + 4) * wbytes, 16);
    h = off, off += 2 * round_up(g.bs, bt) * (g.chunk + 4) * 4;
    gates = off, off += round_up(g.bs * R * 4, 16);
    lens = off, off += round_up(g.bs * 4, 16);
    total = off;
  }
};

// Of the grid backward: W_hh's block rows transposed ([k][r], k padded to kGridRows; a row holds the Rp
// gate rows padded to whole 128-byte lines, ldt elements, its chunks swizzled: grid_swizzle), the step's
// gate gradients (samples padded to the batch tile x Rp), the slices' sums of the received partials
// (float4s), the lengths.
__host__ __device__ inline int grid_sum_slots(const Geometry& g) {
  return g.bs * ceil_div(g.hs, 4) > kThreads ? g.bs * ceil_div(g.hs, 4) : kThreads;
}
struct GridBackwardSmem {
  int ldt, wt, dg, red, lens, total;
  __host__ __device__ GridBackwardSmem(const Geometry& g, int G, int wbytes, int bt) {
    const int Rp = round_up(G * g.hs, 4), Kp = round_up(g.H, 4);
    ldt = round_up(Rp, 128 / wbytes);
    int off = 0;
    wt = off, off += round_up(round_up(Kp, kGridRows) * ldt * wbytes, 16);
    dg = off, off += round_up(g.bs, bt) * Rp * 4;
    red = off, off += grid_sum_slots(g) * 16;
    lens = off, off += round_up(g.bs * 4, 16);
    total = off;
  }
};

// Lanes that split one tile's sum over k4n float4 chunks: as many as keep the threads busy, at most 32.
__host__ __device__ inline int grid_lanes(int tiles, int k4n) {
  int ks = 1;
  while (ks < 32 && tiles * ks * 2 <= kThreads && ks * 2 <= k4n) ks *= 2;
  return ks;
}

// The backward's tile kt multiplies units kGridRows * kt .. + kGridRows - 1, so that each sample's 8
// partials leave as two float4 stores (64 scalar stores with their address arithmetic had drawn 40% of
// the backward's stall samples: BENCHMARKS.md, eleventh session). The 8 lanes of a quarter warp read 8 rows at the same chunk; with rows whole
// 128-byte lines that would be one bank group, so unit tile kt keeps chunk c of its rows at chunk
// c ^ grid_swizzle(kt): 8 (fp32; 16 for bf16's 8-byte chunks) consecutive tiles then read distinct
// chunks. Times ks (the lanes that split a tile's chunks: q, q + ks, ...) so that the XOR keeps q.
__host__ __device__ inline int grid_swizzle(int kt, int ks, int wbytes) { return (kt * ks) & (32 / wbytes - 1); }

// The kernels for a cell, weight precision and batch tile (1, 2, 4 or 8): rnn_grid_forward.cu, rnn_grid_backward.cu.
const void* grid_forward_kernel(Cell c, Weights w, int bt);
const void* grid_backward_kernel(Cell c, Weights w, int bt);

#if defined(__CUDACC__)

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Group n of `groups` cp.async groups (committed in order) landed, for every thread of the block (or,
// `warp_only`, of the warp that issued them): at most groups - 1 - n may still be in flight (wait_group
// takes an immediate).
__device__ __forceinline__ void wait_staged(int n, int groups, bool warp_only = false) {
  switch (min(groups - 1 - n, 3)) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    default: cp_async_wait<3>(); break;
  }
  if (warp_only)
    __syncwarp();
  else
    __syncthreads();
}
// x as the TF32 tensor-core products read it, rounded to nearest (the MMA itself would drop the low 13
// bits: truncation, a bias every step of the recurrence would repeat).
__device__ __forceinline__ float round_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
}

// The ks consecutive lanes (a power of 2) that split the sums v[0..N) combine them: at each level (lane
// offset 1, 2, 4, ...) a lane keeps one half of its values (the upper if its offset bit is set) and
// adds its partner's copy of that half. After log2(ks) levels lane q holds N / ks totals, v[0..n), of
// indices first .. first + n - 1; where N < ks the last levels add whole totals, and only `owner` of
// the lanes that then hold the same one should store it. Every lane of the warp must call it (the
// shuffles); each total is summed in a fixed order (the same bits every run).
template <int L, int N>
__device__ __forceinline__ void halve_levels(float (&v)[N], int ks, int off, int& first, int& n, bool& owner) {
  if constexpr (L >= 2) {
    if (off < ks) {
      const bool upper = (threadIdx.x & off) != 0;
      constexpr int h = L / 2;
#pragma unroll
      for (int i = 0; i < h; ++i) {
        const float send = upper ? v[i] : v[i + h];
        const float keep = upper ? v[i + h] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
      }
      if (upper) first += h;
      halve_levels<h>(v, ks, off * 2, first, n, owner);
    } else {
      n = L;
    }
  } else {
    n = 1;
    owner = (threadIdx.x & (ks - 1)) < off;
    for (; off < ks; off *= 2) v[0] += __shfl_xor_sync(0xffffffffu, v[0], off);
  }
}
// The tile's sums v, combined over its ks lanes; store(e, total) for each total of index e this lane
// holds and stores (if `busy`: the tile is real and was multiplied).
template <int N, typename Store>
__device__ __forceinline__ void store_lane_totals(float (&v)[N], int ks, bool busy, Store&& store) {
  if (ks == 1) {  // one lane holds the whole tile: compile-time indices, no shuffles
    if (busy)
#pragma unroll
      for (int i = 0; i < N; ++i) store(i, v[i]);
    return;
  }
  int first = 0, n = N;
  bool owner = true;
  halve_levels<N>(v, ks, 1, first, n, owner);
  if (!busy || !owner) return;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if (i == n) break;
    store(first + i, v[i]);
  }
}

// The next sample from b on that runs at step s (bv if none).
__device__ __forceinline__ int next_running(const int* lens, int s, int b, int bv) {
  while (b < bv && s >= lens[b]) ++b;
  return b;
}

// The longest length of samples [b, b + n) of the block's lengths (0 past the group's bs).
__device__ __forceinline__ int longest(const int* lens, int b, int n, int bs) {
  int m = 0;
  for (int i = b; i < min(b + n, bs); ++i) m = max(m, lens[i]);
  return m;
}

// The 16-bit grid forward's exchange of h with no barrier a step ("tagged"). Block q's h of sample b goes out
// as lines of 16 bytes, each of two 8-byte words (two fp16 h and a tag: the step that reads them, plus 1), one
// thread storing a line; a reader polls each line it needs until both its words carry the tag it waits for.
// An aligned 8-byte access is single-copy atomic, so a word's h and its tag arrive together (NCCL's LL
// protocol rests on the same): one trip through L2 a step where the barrier's fence, arrival, poll and then
// the loads of h took three. Two buffers by step parity: a block stores the h read at step s + 1 into buffer
// (s + 1) & 1 only once it has read all of step s's lines of a sample still running, and each block stored
// those after it had read step s - 1's from that same buffer: no reader is still on it. The host zeroes the
// buffers before each launch, so no line carries a tag the launch waits for before it is stored.
// Layout: lines [2][groups][bs][nc][lq], lq = ceil(hs / 4): block q's units q * hs + 4l .. + 3 (zero past hv).
struct TaggedLines {
  uint4* base;
  int64_t stride;  // lines a buffer
  int lq, per;     // lines a block and a sample, lines a sample (nc * lq)
  __device__ __forceinline__ TaggedLines(float* xchg, const Geometry& g, const Block& blk)
      : lq(ceil_div(g.hs, 4)), per(g.nc * ceil_div(g.hs, 4)) {
    base = reinterpret_cast<uint4*>(xchg) + static_cast<int64_t>(blk.group) * g.bs * per;
    stride = static_cast<int64_t>(blk.groups) * g.bs * per;
  }
  // Sample 0's first line of buffer `parity` (the samples' lines follow one another).
  __device__ __forceinline__ uint4* lines(int parity) const { return base + parity * stride; }
};
// A tagged line's 16 bytes, stored and loaded as one relaxed access at GPU scope.
__device__ __forceinline__ void store_line(uint4* p, unsigned x, unsigned y, unsigned z, unsigned w) {
  asm volatile("st.relaxed.gpu.global.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}
__device__ __forceinline__ void store_tagged(uint4* p, unsigned w0, unsigned w1, unsigned tag) {
  store_line(p, w0, tag, w1, tag);
}
__device__ __forceinline__ uint4 load_tagged(const uint4* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p)
               : "memory");
  return v;
}
// This block's lines of the h in hx_s ([b][round_up(hs, 4)] fp16) of the samples running at `run` (all: -1),
// tagged for step `tag - 1`, into buffer `parity`.
__device__ __forceinline__ void store_h_lines(const TaggedLines& x, int parity, unsigned tag, const __half* hx_s,
                                              const int* lens, int bv, int rank, int run) {
  const int hsp = 4 * x.lq;
  uint4* out = x.lines(parity) + rank * x.lq;
  for (int e = threadIdx.x; e < bv * x.lq; e += kThreads) {
    const int b = e / x.lq, l = e - b * x.lq;
    if (run >= lens[b]) continue;
    const uint2 w = *reinterpret_cast<const uint2*>(hx_s + b * hsp + 4 * l);
    store_tagged(out + static_cast<int64_t>(b) * x.per + l, w.x, w.y, tag);
  }
}
// h_{s-1} of the samples running at s, polled from buffer s & 1 into h_s (rows ldh apart, natural column
// order), then a __syncthreads. Each thread has up to 4 lines' loads in flight before it waits on any.
__device__ __forceinline__ void poll_h_lines(const TaggedLines& x, int s, int hs, __half* h_s, int ldh, const int* lens,
                                             int bv) {
  constexpr int kInFlight = 4;
  const unsigned tag = s + 1;
  const uint4* in = x.lines(s & 1);
  const int total = bv * x.per;
  for (int e0 = threadIdx.x; e0 < total; e0 += kInFlight * kThreads) {
    uint4 v[kInFlight];
    int b[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int e = e0 + u * kThreads;
      b[u] = e < total ? e / x.per : -1;
      if (b[u] >= 0 && s >= lens[b[u]]) b[u] = -1;
      if (b[u] >= 0) v[u] = load_tagged(in + e);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      if (b[u] < 0) continue;
      const int e = e0 + u * kThreads, r = e - b[u] * x.per;
      while (v[u].y != tag || v[u].w != tag) v[u] = load_tagged(in + e);
      __half* row = h_s + b[u] * ldh;
      if ((hs & 3) == 0) {
        *reinterpret_cast<uint2*>(row + 4 * r) = make_uint2(v[u].x, v[u].z);  // lq = hs / 4: column 4r
      } else {
        const int q = r / x.lq, l = r - q * x.lq, c = q * hs + 4 * l;
        const __half2 p0 = *reinterpret_cast<const __half2*>(&v[u].x), p1 = *reinterpret_cast<const __half2*>(&v[u].z);
        const __half hv[4] = {__low2half(p0), __high2half(p0), __low2half(p1), __high2half(p1)};
        for (int i = 0; i < 4 && 4 * l + i < hs; ++i) row[c + i] = hv[i];
      }
    }
  }
  __syncthreads();
}

// The step loop both grid forwards share: block set-up done (weights, lengths, the first barrier), it
// runs the cells of this thread's (sample, unit) pairs and the exchange around them. Per step s:
// products(s, in) computes the recurrent products of the samples running at s from h_{t-1} at `in`
// (every sample's row of Kp floats) and ends with a __syncthreads; gh_of(b, k, j) reads back gate k
// of unit j of sample b; the cell's h goes to the exchange at once; then the barrier, with the
// step's output stores and the next step's input loads between its arrive and its wait. TF32: the
// exchange carries h rounded to TF32 (only the products read it; the state stays fp32); X = __half: it
// carries h in fp16 (rnn_forward_grid_half_kernel), rows of round_up(H, 8). Tagged (X = __half only): h goes
// through the tagged exchange (TaggedLines) with no barrier a step: the cells' h meet in hx_s
// ([b][round_up(hs, 4)], zeroed by the kernel) and go out as tagged lines, and products(s, lines) polls them.
template <Cell C, int I, bool TF32 = false, typename X = float, bool Tagged = false, typename Products, typename GhOf>
__device__ __forceinline__ void grid_forward_steps(const ForwardArgs& a, const Block& blk, const int* lens,
                                                   GroupBarrier& bar, Products&& products, GhOf&& gh_of,
                                                   __half* hx_s = nullptr) {
  constexpr int G = C == Cell::kLSTM ? 4 : 3;
  constexpr bool kHalf = std::is_same_v<X, __half>;
  static_assert(kHalf || !Tagged, "the tagged exchange carries fp16 h");
  const Geometry& g = a.g;
  const int H = g.H, Kp = round_up(H, 16 / static_cast<int>(sizeof(X))), j0 = blk.j0;
  // Exchange: h of every sample of the group, rows of Kp 16-byte chunks (the host zeroes the padding).
  auto xchg = [&](int parity) {
    return reinterpret_cast<X*>(a.xchg) + (static_cast<int64_t>(parity) * blk.groups + blk.group) * g.bs * Kp;
  };
  const TaggedLines tagged(a.xchg, g, blk);
  auto publish = [&](int parity, int b, int j, float v) {
    X* at = xchg(parity) + static_cast<int64_t>(b) * Kp + j0 + j;
    if constexpr (Tagged)
      hx_s[b * 4 * tagged.lq + j] = __float2half_rn(v);
    else if constexpr (kHalf)
      __stcg(reinterpret_cast<unsigned short*>(at), __half_as_ushort(__float2half_rn(v)));
    else
      __stcg(at, TF32 ? round_tf32(v) : v);
  };
  const Items<I> it(blk.bv, blk.hv);
  if constexpr (Tagged) __syncthreads();  // hx_s zeroed
  float h[I], c[I], bias[I][G];
#pragma unroll
  for (int i = 0; i < I; ++i) {
    h[i] = c[i] = 0.0f;
    if (it.b[i] < 0) continue;
    const int64_t at = static_cast<int64_t>(blk.b0 + it.b[i]) * H + j0 + it.j[i];
    h[i] = a.h0[at];
    if constexpr (C == Cell::kLSTM) c[i] = a.c0[at];
#pragma unroll
    for (int q = 0; q < G; ++q) bias[i][q] = a.b_hh ? a.b_hh[q * H + j0 + it.j[i]] : 0.0f;
    publish(0, it.b[i], it.j[i], h[i]);
  }
  if constexpr (Tagged) {
    __syncthreads();
    store_h_lines(tagged, 0, 1u, hx_s, lens, blk.bv, blk.rank, -1);
  }
  const int smax = finish_setup(bar, lens, g.bs);
  float xnext[I][G];
  load_step_inputs(a, blk, it, lens, 0, xnext);
  for (int s = 0; s < smax; ++s) {
    const int cur = s & 1;
    float x[I][G];
    copy_items(x, xnext);
    VLSEQ_MARK(0, 0, s);
    if constexpr (Tagged)
      products(s, tagged);
    else
      products(s, xchg(cur));
    VLSEQ_MARK(0, 3, s);
    // The cell of this thread's (sample, unit) pairs still running; h to the exchange at once.
    float out[I][4];
    bool live[I];
#pragma unroll
    for (int i = 0; i < I; ++i) {
      const int b = it.b[i], j = it.j[i];
      live[i] = b >= 0 && s < lens[b];
      if (!live[i]) continue;
      float gh[G];
#pragma unroll
      for (int k = 0; k < G; ++k) gh[k] = gh_of(b, k, j) + bias[i][k];
      forward_cell<C>(x[i], gh, h[i], c[i], out[i]);
      publish(cur ^ 1, b, j, h[i]);
    }
    VLSEQ_MARK(0, 4, s);
    if constexpr (Tagged) {
      __syncthreads();
      store_h_lines(tagged, cur ^ 1, s + 2, hx_s, lens, blk.bv, blk.rank, s);
    } else {
      bar.arrive();
    }
    VLSEQ_MARK(0, 5, s);
    store_step_outputs<C>(a, blk, it, lens, s, live, h, c, out);
    load_step_inputs(a, blk, it, lens, s + 1, xnext);
    VLSEQ_MARK(0, 6, s);
    if constexpr (!Tagged) bar.wait();
  }
#pragma unroll
  for (int i = 0; i < I; ++i) {
    if (it.b[i] < 0) continue;
    const int64_t o = static_cast<int64_t>(blk.b0 + it.b[i]) * H + j0 + it.j[i];
    a.h_n[o] = h[i];
    if constexpr (C == Cell::kLSTM) a.c_n[o] = c[i];
  }
}

template <Cell C, typename WT, int BT>
__global__ void __launch_bounds__(kThreads, 1) rnn_forward_grid_kernel(const ForwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int G = C == Cell::kLSTM ? 4 : 3, RT = kGridRows, N = RT * BT;
  const Geometry& g = a.g;
  const int H = g.H, hs = g.hs, R = G * hs;
  const int Kp = round_up(H, 4), ldw = Kp + 4, kc = g.chunk, ldh = kc + 4, nch = ceil_div(Kp, kc);
  const Block blk(g);
  const int bv = blk.bv, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int bsp = round_up(g.bs, BT);

  extern __shared__ __align__(16) unsigned char smem[];
  const GridForwardSmem lay(g, G, sizeof(WT), BT);
  WT* w_s = reinterpret_cast<WT*>(smem + lay.w);
  float* h_s = reinterpret_cast<float*>(smem + lay.h);
  float* gates_s = reinterpret_cast<float*>(smem + lay.gates);
  int* lens = reinterpret_cast<int*>(smem + lay.lens);

  load_weights<false>(w_s, ldw, round_up(R, RT), ldw, a.w_hh, G, g, blk);
  load_lengths(lens, a.lengths, g, blk);
  for (int e = tid; e < 2 * bsp * ldh; e += kThreads) h_s[e] = 0.0f;
  __syncthreads();  // the lengths, for tile_len
  GroupBarrier bar{Sync::kGrid, a.arrivals + blk.group, static_cast<unsigned>(g.nc), 0u};

  // This thread's tile: rows r0 .. r0 + RT - 1 of W, samples sb .. sb + BT - 1; lanes q of ks split k.
  const int nrt = ceil_div(R, RT), tiles = nrt * ceil_div(bv, BT), ks = grid_lanes(tiles, kc / 4);
  const int tile = tid / ks, q = tid % ks, r0 = (tile % nrt) * RT, sb = (tile / nrt) * BT;
  const int tile_len = tile < tiles ? longest(lens, sb, BT, bv) : 0;

  auto products = [&](int s, const float* in) {
    // Chunk ch of h_{t-1} (columns ch * kc ..) of the samples still running, into buffer ch & 1.
    // A warp per sample, its lanes over the columns: no division per float4, one length check per sample
    // (staging had cost a quarter of the step's issue slots: BENCHMARKS.md, eleventh session).
    auto stage = [&](int ch) {
      const int k0 = ch * kc, n4 = min(kc, Kp - k0) / 4;
      float* dst = h_s + (ch & 1) * bsp * ldh + 4 * lane;
      for (int b = warp; b < bv; b += kWarps) {
        if (s >= lens[b]) continue;
        const float* src = in + static_cast<int64_t>(b) * Kp + k0 + 4 * lane;
        for (int k4 = lane; k4 < n4; k4 += 32, src += 128) cp_async16(dst + b * ldh + 4 * (k4 - lane), src);
      }
      cp_async_commit();
    };
    stage(0);
    if (nch > 1) stage(1);
    float acc[N];
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] = 0.0f;
    const bool busy = s < tile_len;
    for (int ch = 0; ch < nch; ++ch) {
      if (ch + 1 < nch)
        cp_async_wait<1>();
      else
        cp_async_wait<0>();
      __syncthreads();
      if (ch == 0) VLSEQ_MARK(0, 1, s);
      if (busy)
        tile_fma<RT, BT, kGridUnroll>(acc, w_s + r0 * ldw + ch * kc, ldw, h_s + ((ch & 1) * bsp + sb) * ldh, ldh, q,
                                      min(kc, Kp - ch * kc) / 4, ks);
      __syncthreads();  // every thread is done with buffer ch & 1 before chunk ch + 2 refills it
      if (ch + 2 < nch) stage(ch + 2);
    }
    VLSEQ_MARK(0, 2, s);
    store_lane_totals(acc, ks, busy, [&](int e, float v) {
      const int r = r0 + e / BT, b = sb + e % BT;
      if (r < R && b < bv) gates_s[b * R + r] = v;
    });
    __syncthreads();
  };
  grid_forward_steps<C, kMaxItems>(a, blk, lens, bar, products,
                                   [&](int b, int k, int j) { return gates_s[b * R + k * hs + j]; });
#endif
}

// The fp32 grid forward with W_hh in registers (where a block's rows fit: fp32 LSTM 1024 on 128 blocks,
// ...). rnn_forward_grid_kernel's tile read a float4 of W and one of h from shared memory per 16 FMAs:
// its products ran at ~45% of the FMA rate. Here the 8 warps are ng = 8 / nwg row groups of nwg warps;
// a thread holds NR rows of its group (gate-major, k * hs + j) at NM float4 chunks of columns, chunk
// lane + 32 * (wg + nwg * m) for warp wg of its group: each warp-wide read of h is 512 contiguous bytes.
// Per sample it reads NM float4s of h and makes 4 * NR * NM FMAs; SP running samples go together (4
// for 8 rows: 2 measured 27.8 K clocks a step at LSTM 1024 x 32, 4 24.2 K, but one running sample then
// still pays for 4) and the warp's lanes combine their SP * NR partial sums with one reduce-scatter
// butterfly (store_lane_totals); the nwg warps' sums meet in shared memory, added in a fixed order by
// the cell. h_{t-1} of all the group's samples is staged at once (cp.async, in chunks of 8 samples,
// each awaited before its products): shared memory holds no weights, so it has the room.
constexpr int kGridFwdChunk = 8;  // samples per staged chunk of h
struct GridFwdRegsShape {
  int nr, nm;       // rows and float4 chunks of columns per thread
  int nwg, ng, kq;  // kq: columns padded to 128 * nm * nwg; ng = 0: the block's rows do not fit
  __host__ __device__ GridFwdRegsShape(int G, int H, int hs, int nr_, int nm_) : nr(nr_), nm(nm_) {
    const int Kp = round_up(H, 4);
    nwg = 1;
    while (nwg < kWarps && 128 * nm * nwg < Kp) nwg *= 2;
    kq = 128 * nm * nwg;
    ng = kWarps / nwg;
    // At most a quarter of the FMAs on padding columns, every row held.
    if (kq < Kp || 4 * kq > 5 * Kp || ng * nr < G * hs) ng = 0;
  }
};
// The (rows, chunks) per thread a kernel is built for, in the planner's order of preference.
constexpr int kGridFwdRegsShapes[][2] = {{8, 4}, {16, 2}, {8, 2}, {4, 8}, {32, 1}};
struct GridFwdRegsSmem {
  int h, part, lens, total;
  __host__ __device__ GridFwdRegsSmem(const Geometry& g, const GridFwdRegsShape& sh) {
    int off = 0;
    h = off, off += round_up(g.bs, kGridFwdChunk) * sh.kq * 4;
    part = off, off += round_up(sh.nwg * g.bs * sh.ng * sh.nr * 4, 16);
    lens = off, off += round_up(g.bs * 4, 16);
    total = off;
  }
};
// Whether a block's (sample, unit) pairs suit the kernels with W_hh in registers (fp32 only).
inline bool grid_regs_pairs_fit(const Geometry& g, bool fp32) { return fp32 && g.bs * g.hs <= kThreads * kGridRegItems; }
// The forward's first (rows, chunks) per thread of kGridFwdRegsShapes that holds the block's rows and
// whose staged h fits in `optin` bytes of shared memory; nr = 0 if none.
inline GridFwdRegsShape grid_fwd_regs_shape(const Geometry& g, int G, int64_t optin) {
  for (const auto& rc : kGridFwdRegsShapes) {
    const GridFwdRegsShape c(G, g.H, g.hs, rc[0], rc[1]);
    if (c.ng > 0 && GridFwdRegsSmem(g, c).total <= optin) return c;
  }
  return GridFwdRegsShape(G, g.H, g.hs, 0, 0);
}
// The kernel for a cell and (rows, chunks) per thread, one of kGridFwdRegsShapes: rnn_grid_forward_regs.cu.
const void* grid_forward_regs_kernel(Cell c, int nr, int nm);

template <Cell C, int NR, int NM>
__global__ void __launch_bounds__(kThreads, 1) rnn_forward_grid_regs_kernel(const ForwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int G = C == Cell::kLSTM ? 4 : 3;
  constexpr int SP = NR >= 8 ? (32 / NR > 0 ? 32 / NR : 1) : 4;  // samples per pass: SP * NR sums, at most 32
  const Geometry& g = a.g;
  const int H = g.H, hs = g.hs, Kp = round_up(H, 4);
  const GridFwdRegsShape sh(G, H, hs, NR, NM);
  const int kq = sh.kq, nwg = sh.nwg, ldp = sh.ng * NR;  // part_s: [wg][b][ldp]
  const Block blk(g);
  const int bv = blk.bv, tid = threadIdx.x, warp = tid / 32, lane = tid % 32, grp = warp / nwg, wg = warp % nwg;
  const int nchunks = ceil_div(bv, kGridFwdChunk);

  extern __shared__ __align__(16) unsigned char smem[];
  const GridFwdRegsSmem lay(g, sh);
  float* h_s = reinterpret_cast<float*>(smem + lay.h);  // [b][kq], zero past Kp
  float* part_s = reinterpret_cast<float*>(smem + lay.part);
  int* lens = reinterpret_cast<int*>(smem + lay.lens);

  float4 w[NR][NM];  // rows grp * NR + i, columns 4 * (lane + 32 * (wg + nwg * m)) ..
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const float* src = block_row(a.w_hh, G, g, blk, grp * NR + i);
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      const int c0 = 4 * (lane + 32 * (wg + nwg * m));
      float v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = src && c0 + e < H ? src[c0 + e] : 0.0f;
      w[i][m] = make_float4(v[0], v[1], v[2], v[3]);
    }
  }
  load_lengths(lens, a.lengths, g, blk);
  for (int e = tid; e < round_up(g.bs, kGridFwdChunk) * kq; e += kThreads) h_s[e] = 0.0f;
  GroupBarrier bar{Sync::kGrid, a.arrivals + blk.group, static_cast<unsigned>(g.nc), 0u};

  auto products = [&](int s, const float* in) {
    // Every chunk of running samples' h staged at once, a warp per sample (its lanes over the columns).
    for (int ch = 0; ch < nchunks; ++ch) {
      for (int b = ch * kGridFwdChunk + warp; b < min(bv, (ch + 1) * kGridFwdChunk); b += kWarps) {
        if (s >= lens[b]) continue;
        const float* src = in + static_cast<int64_t>(b) * Kp;
        for (int k4 = lane; k4 < Kp / 4; k4 += 32) cp_async16(h_s + b * kq + 4 * k4, src + 4 * k4);
      }
      cp_async_commit();
    }
    VLSEQ_MARK(0, 1, s);
    for (int ch = 0; ch < nchunks; ++ch) {
      wait_staged(ch, nchunks);
      const int bend = min(bv, (ch + 1) * kGridFwdChunk);
      for (int b = next_running(lens, s, ch * kGridFwdChunk, bend); b < bend;) {
        // SP running samples at a time (bend past the last): their sums share one butterfly.
        int idx[SP];
        idx[0] = b;
#pragma unroll
        for (int p = 1; p < SP; ++p) idx[p] = next_running(lens, s, idx[p - 1] + 1, bend);
        float acc[SP * NR];
#pragma unroll
        for (int i = 0; i < SP * NR; ++i) acc[i] = 0.0f;
#pragma unroll
        for (int m = 0; m < NM; ++m) {
          const int c0 = 4 * (lane + 32 * (wg + nwg * m));
          float4 x[SP];
#pragma unroll
          for (int p = 0; p < SP; ++p) x[p] = *reinterpret_cast<const float4*>(h_s + (idx[p] < bend ? idx[p] : b) * kq + c0);
#pragma unroll
          for (int i = 0; i < NR; ++i) {
            const float4 wv = w[i][m];
#pragma unroll
            for (int p = 0; p < SP; ++p) {
              float& sum = acc[p * NR + i];
              sum = fmaf(wv.x, x[p].x, sum), sum = fmaf(wv.y, x[p].y, sum);
              sum = fmaf(wv.z, x[p].z, sum), sum = fmaf(wv.w, x[p].w, sum);
            }
          }
        }
        // Total e: row e % NR of sample idx[e / NR], over this warp's columns.
        // (Scalars: an array read in the lambda was kept in local memory.)
        const int s1 = idx[SP > 1 ? 1 : 0], s2 = idx[SP > 2 ? 2 : 0], s3 = idx[SP > 3 ? 3 : 0];
        store_lane_totals(acc, 32, true, [&](int e, float v) {
          const int q = e / NR, sample = q == 0 ? b : q == 1 ? s1 : q == 2 ? s2 : s3;
          if (sample < bend) part_s[(wg * g.bs + sample) * ldp + grp * NR + e % NR] = v;
        });
        b = idx[SP - 1] < bend ? next_running(lens, s, idx[SP - 1] + 1, bend) : bend;
      }
    }
    VLSEQ_MARK(0, 2, s);
    __syncthreads();
  };
  grid_forward_steps<C, kGridRegItems>(a, blk, lens, bar, products, [&](int b, int k, int j) {
    float v = 0.0f;
    for (int q = 0; q < nwg; ++q) v += part_s[(q * g.bs + b) * ldp + k * hs + j];
    return v;
  });
#endif
}

// The backward's W_hh^T: unit k's row at wt[k * ldt], gate row r's chunk r / 4 at chunk
// (r / 4) ^ grid_swizzle(k / kGridRows); zero past the block's rows, the units and within the padding.
// Read as load_weights does (k fastest: the W_hh rows' reads coalesce).
template <typename WT>
__device__ __forceinline__ void load_weights_swizzled(WT* wt, int ldt, int ks, const float* w_hh, int G,
                                                      const Geometry& g, const Block& blk) {
  const int cols = round_up(round_up(g.H, 4), kGridRows);
  for (int e = threadIdx.x; e < ldt * cols; e += kThreads) {
    const int r = e / cols, k = e - r * cols;
    const float* row = block_row(w_hh, G, g, blk, r);
    const float v = row && k < g.H ? row[k] : 0.0f;
    const int chunk = (r / 4) ^ grid_swizzle(k / kGridRows, ks, sizeof(WT));
    wt[k * ldt + 4 * chunk + (r & 3)] = to_weight<WT>(v);
  }
}

// The step loop the grid backwards share: block set-up done (weights, lengths, dg_s zero, the first
// barrier), it runs the cells of this thread's (sample, unit) pairs and the exchange around them. Per
// step s (from the last): gather(parity, s + 1) makes this block's dh_t from what step s + 1 exchanged
// (the partials' sums, or the 16-bit kernel's products of the gate gradients; read back by sum_of(b, j));
// the cells write the gate gradients to dg_s[b * ldg + k * hs + j]; products(parity, s) sends this
// block's part of the samples running at s (partial dh_{t-1}, or the gate gradients); then the barrier,
// with the gate gradients' stores and the next step's loads between its arrive and its wait. Tagged (the
// 16-bit reduce-scatter kernel): no barrier; products sends tagged lines and gather polls them.
template <Cell C, int I, bool Tagged = false, typename Gather, typename SumOf, typename Products>
__device__ __forceinline__ void grid_backward_steps(const BackwardArgs& a, const Block& blk, const int* lens,
                                                    float* dg_s, int ldg, GroupBarrier& bar, int smax, Gather&& gather,
                                                    SumOf&& sum_of, Products&& products) {
  constexpr int G = C == Cell::kLSTM ? 4 : 3, F = backward_fields(C);
  const Geometry& g = a.g;
  const int H = g.H, hs = g.hs, j0 = blk.j0, b0 = blk.b0;
  const Items<I> it(blk.bv, blk.hv);
  float dh[I], dc[I], ddir[I];
#pragma unroll
  for (int i = 0; i < I; ++i) {
    dh[i] = dc[i] = ddir[i] = 0.0f;
    if (it.b[i] < 0) continue;
    const int64_t at = static_cast<int64_t>(b0 + it.b[i]) * H + j0 + it.j[i];
    if (a.dh_n) dh[i] = a.dh_n[at];
    if (a.dc_n) dc[i] = a.dc_n[at];
  }
  float pnext[I][F];
  auto prefetch = [&](int s) {
#pragma unroll
    for (int i = 0; i < I; ++i) {
      const int b = it.b[i];
      if (b < 0) continue;
      const int len = lens[b];
      if (s >= 0 && s < len) load_backward_fields<C>(a, b0 + b, j0 + it.j[i], len, s, pnext[i]);
      if (s >= 1 && s - 1 < len) load_backward_fields<C, F, true>(a, b0 + b, j0 + it.j[i], len, s - 1, pnext[i]);
    }
  };
  prefetch(smax - 1);
  for (int s = smax - 1; s >= 0; --s) {
    const int cur = s & 1;
    float p[I][F];
    copy_items(p, pnext);
    VLSEQ_MARK(1, 0, s);
    if (s + 1 < smax) gather(cur ^ 1, s + 1);  // dh_t from step s+1's partials
    VLSEQ_MARK(1, 1, s);
    float rg[I][4], dn[I];
    bool live[I];
#pragma unroll
    for (int i = 0; i < I; ++i) {
      const int b = it.b[i], j = it.j[i];
      live[i] = false;
      if (b < 0) continue;
      const int len = lens[b];
      if (s + 1 < len) dh[i] = sum_of(b, j) + ddir[i];
      float* dgb = dg_s + b * ldg + j;  // gate k at dgb[k * hs]
      if (s >= len) {
#pragma unroll
        for (int k = 0; k < G; ++k) dgb[k * hs] = 0.0f;
        continue;
      }
      live[i] = true;
      backward_cell<C, F>(p[i], dh[i], dc[i], ddir[i], rg[i], dn[i]);
#pragma unroll
      for (int k = 0; k < G; ++k) dgb[k * hs] = rg[i][k];
    }
    __syncthreads();
    VLSEQ_MARK(1, 2, s);
    products(cur, s);
    VLSEQ_MARK(1, 3, s);
    if constexpr (!Tagged) bar.arrive();
    VLSEQ_MARK(1, 4, s);
#pragma unroll
    for (int i = 0; i < I; ++i) {
      if (!live[i]) continue;
      const int b = it.b[i];
      store_gate_grads<C>(a, step_row(g, blk, b, lens[b], s), j0 + it.j[i], rg[i], dn[i]);
    }
    prefetch(s - 1);
    VLSEQ_MARK(1, 5, s);
    if constexpr (!Tagged) bar.wait();
  }
  gather(0, 0);
#pragma unroll
  for (int i = 0; i < I; ++i) {
    const int b = it.b[i];
    if (b < 0) continue;
    const int64_t o = static_cast<int64_t>(b0 + b) * H + j0 + it.j[i];
    a.dh0[o] = lens[b] > 0 ? sum_of(b, it.j[i]) + ddir[i] : dh[i];
    if constexpr (C == Cell::kLSTM) a.dc0[o] = dc[i];
  }
}

template <Cell C, typename WT, int BT>
__global__ void __launch_bounds__(kThreads, 1) rnn_backward_grid_kernel(const BackwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int G = C == Cell::kLSTM ? 4 : 3, RT = kGridRows, N = RT * BT;
  const Geometry& g = a.g;
  const int hs = g.hs, R = G * hs, Kp = round_up(g.H, 4), Rp = round_up(R, 4);
  const int Kx = g.nc * hs;  // exchange rows: every block's units (nc * hs >= H, a multiple of 4)
  const Block blk(g);
  const int rank = blk.rank, j0 = blk.j0, hv = blk.hv, bv = blk.bv, tid = threadIdx.x;
  const int bsp = round_up(g.bs, BT);

  extern __shared__ __align__(16) unsigned char smem[];
  const GridBackwardSmem lay(g, G, sizeof(WT), BT);
  const int ldt = lay.ldt;
  WT* wt_s = reinterpret_cast<WT*>(smem + lay.wt);  // [k][r]: W_hh transposed, own rows, swizzled
  float* dg_s = reinterpret_cast<float*>(smem + lay.dg);
  float4* red_s = reinterpret_cast<float4*>(smem + lay.red);
  int* lens = reinterpret_cast<int*>(smem + lay.lens);
  // Partial dh of sample b, unit k from block q at a step of parity `parity`: xchg(parity, q)[b * Kx + k].
  auto xchg = [&](int parity, int q) {
    return a.xchg + ((static_cast<int64_t>(parity) * blk.groups + blk.group) * g.nc + q) * g.bs * Kx;
  };

  // Product tiles: units RT * kt .. RT * kt + RT - 1, samples sb .. sb + BT - 1.
  const int nkt = ceil_div(Kp, RT), tiles = nkt * ceil_div(bv, BT), ks = grid_lanes(tiles, Rp / 4);
  load_weights_swizzled(wt_s, ldt, ks, a.w_hh, G, g, blk);
  for (int e = tid; e < bsp * Rp; e += kThreads) dg_s[e] = 0.0f;
  load_lengths(lens, a.lengths, g, blk);
  GroupBarrier bar{Sync::kGrid, a.arrivals + blk.group, static_cast<unsigned>(g.nc), 0u};
  const int smax = finish_setup(bar, lens, g.bs);

  // The sum of the nc partials of this block's units: P float4s (sample, 4 units), each summed by Q
  // threads over slices of the ranks into red_s[slice * P + pair], then the slices in order (sum_of).
  // Only samples still running at step s_next (those that read it) are loaded.
  const int nu4 = ceil_div(hv, 4), P = bv * nu4;
  const int Q = P >= kThreads ? 1 : min(16, min(g.nc, kThreads / max(P, 1)));
  auto gather = [&](int parity, int s_next) {
    const int64_t stride = static_cast<int64_t>(g.bs) * Kx / 4;
    for (int e = tid; e < P * Q; e += kThreads) {
      const int pair = e % P, slice = e / P, b = pair / nu4, u = pair - b * nu4;
      float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (s_next < lens[b]) {
        const float4* src = reinterpret_cast<const float4*>(xchg(parity, 0) + static_cast<int64_t>(b) * Kx + j0) + u;
        const int qa = slice * g.nc / Q, qb = (slice + 1) * g.nc / Q;
        // kGatherLoads loads in flight before the first add: the gather waits on L2, not on adds.
        for (int q0 = qa; q0 < qb; q0 += kGatherLoads) {
          float4 v[kGatherLoads];
#pragma unroll
          for (int u = 0; u < kGatherLoads; ++u)
            if (q0 + u < qb) v[u] = __ldcg(src + (q0 + u) * stride);
#pragma unroll
          for (int u = 0; u < kGatherLoads; ++u)
            if (q0 + u < qb) acc.x += v[u].x, acc.y += v[u].y, acc.z += v[u].z, acc.w += v[u].w;
        }
      }
      red_s[e] = acc;
    }
    __syncthreads();
  };
  auto sum_of = [&](int b, int j) {
    const float* r = reinterpret_cast<const float*>(red_s) + 4 * (b * nu4 + j / 4) + (j & 3);
    float v = 0.0f;
    for (int slice = 0; slice < Q; ++slice) v += r[4 * slice * P];
    return v;
  };
  // Partial dh_{t-1} over this block's rows for every unit, to this block's slot of parity cur.
  auto products = [&](int cur, int s) {
    float* part = xchg(cur, rank);
    for (int first_tile = 0; first_tile < tiles; first_tile += kThreads / ks) {
      const int tile = first_tile + tid / ks, q = tid % ks;
      const int kt = tile % nkt, sb = (tile / nkt) * BT;
      // Bit j: sample sb + j runs at step s (past the tiles, sb >= bv: none). Read once, not per store.
      unsigned running = 0;
#pragma unroll
      for (int j = 0; j < BT; ++j)
        if (sb + j < bv && s < lens[sb + j]) running |= 1u << j;
      const bool busy = running != 0;
      float acc[N];
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] = 0.0f;
      if (busy)
        tile_fma<RT, BT, kGridUnroll>(acc, wt_s + RT * kt * ldt, ldt, dg_s + sb * Rp, Rp, q, Rp / 4, ks,
                                      grid_swizzle(kt, ks, sizeof(WT)));
      // Unit u0 + i of sample sb + j goes to out[j * Kx + i]; units past H carry zeros (W^T's padding),
      // units past Kx would be the next sample's: not stored (Kx is a multiple of 4).
      const int u0 = RT * kt;
      float* out = part + static_cast<int64_t>(sb) * Kx + u0;
      if (ks == 1) {
        if (busy)
#pragma unroll
          for (int j = 0; j < BT; ++j, out += Kx) {
            if (!(running >> j & 1u)) continue;
#pragma unroll
            for (int i = 0; i < RT; i += 4)
              if (u0 + i < Kx)
                __stcg(reinterpret_cast<float4*>(out + i),
                       make_float4(acc[i * BT + j], acc[(i + 1) * BT + j], acc[(i + 2) * BT + j], acc[(i + 3) * BT + j]));
          }
      } else {
        store_lane_totals(acc, ks, busy, [&](int e, float v) {
          const int i = e / BT, j = e % BT;
          if (u0 + i < Kx && (running >> j & 1u)) __stcg(out + j * Kx + i, v);
        });
      }
    }
  };
  grid_backward_steps<C, kMaxItems>(a, blk, lens, dg_s, Rp, bar, smax, gather, sum_of, products);
#endif
}

// The fp32 grid backward with W_hh^T in registers (where a block's rows fit: fp32 LSTM 1024 on 128
// blocks, 512 on 128, ...). Shared memory then held only a step's gate gradients, which every lane of
// a warp reads at the same address (a broadcast): the shared-memory tile of rnn_backward_grid_kernel
// read a float4 of W^T per 8 FMAs and ran its products at ~40% of the FMA rate. Thread t < nq * ng
// holds units 4 * quad .. + 3 (quad = t % nq) of W^T for NR of the block's rows (row group t / nq;
// rows gate-major, k * hs + j): per sample it reads NR / 4 float4s of gate gradients, makes 4 * NR
// FMAs and stores the 4 units' partial sums as one float4. Partials go to their owner's region,
// [owner][sample][source][hs] with sources rank * ng + group: an owner reads each sample's partials
// as one contiguous run (a warp per sample, staged in shared memory, float4s over the lanes, then a
// butterfly over the lanes of each unit quad), where the source-major layout above read 32 bytes from
// each of nc places.
struct GridRegsShape {
  int nq, ng, nr;  // nr = 0: the block's rows do not fit (or hs / 4 is not a power of 2)
  __host__ __device__ GridRegsShape(int G, int H, int hs) {
    nq = round_up(H, 4) / 4;
    const int R = G * hs, nu4 = hs / 4;
    ng = nq > kThreads ? 0 : min(kThreads / nq, ceil_div(R, 8));
    nr = ng > 0 ? round_up(ceil_div(R, ng), 8) : 0;
    if (nr > 32 || hs % 4 != 0 || nu4 > 32 || (nu4 & (nu4 - 1)) != 0) nr = 0;
  }
};
// Samples whose partials the gather (gather_owned_partials) stages in shared memory at once, nsrc
// sources of hs units each: all of them where 160 KiB hold them, else a multiple of 8 (each warp then
// reuses only its own slots).
__host__ __device__ inline int grid_gather_samples(const Geometry& g, int nsrc) {
  const int per = nsrc * g.hs * 4, fit = 160 * 1024 / per;
  return g.bs <= fit ? g.bs : (fit / 8 > 1 ? fit / 8 : 1) * 8;
}
// The shared memory of the backward that sends partials to their owners: the step's gate gradients
// (bs x ldg, zero past R), the sums of the gathered partials (bs x hs), the staged partials of nsrc
// sources, the lengths.
struct GridOwnedSmem {
  int dg, red, stage, lens, total;
  __host__ __device__ GridOwnedSmem(const Geometry& g, int ldg, int nsrc) {
    int off = 0;
    dg = off, off += round_up(g.bs * ldg * 4, 16);
    red = off, off += round_up(g.bs * g.hs * 4, 16);
    stage = off, off += grid_gather_samples(g, nsrc) * nsrc * g.hs * 4;
    lens = off, off += round_up(g.bs * 4, 16);
    total = off;
  }
};
__host__ __device__ inline GridOwnedSmem grid_regs_smem(const Geometry& g, const GridRegsShape& sh) {
  return GridOwnedSmem(g, sh.ng * sh.nr, g.nc * sh.ng);
}
// Floats of their exchange buffer: two parities of every group's nc owners x bs samples x nsrc sources x hs.
__host__ __device__ inline int64_t grid_owned_exchange(const Geometry& g, int groups, int nsrc) {
  return 2 * static_cast<int64_t>(groups) * g.nc * g.bs * nsrc * g.hs;
}
#if defined(__CUDACC__)
// The partials owned by block q at a step of parity `parity` (an owner's region): sample b, source src
// at [(b * nsrc + src) * hs].
__device__ __forceinline__ float* owned_region(const BackwardArgs& a, const Block& blk, int parity, int q, int nsrc) {
  const Geometry& g = a.g;
  return a.xchg + ((static_cast<int64_t>(parity) * blk.groups + blk.group) * g.nc + q) * g.bs * nsrc * g.hs;
}
// Sums the partials of this block's units from its region: a warp per sample running at s_next stages
// the sample's contiguous partials in shared memory with cp.async, its lanes add every 32nd float4 (lane
// l always unit quad l % nu4), then a butterfly over the lanes of a quad; sample b's sums to red_s[b *
// nu4 ..]. Slots are reused by the warp that filled them (grid_gather_samples: all the samples or a
// multiple of 8), so no block-wide barrier until the sums' own. hs / 4 must be a power of 2. (Register
// loads, 8 in flight a lane, measured the same: 6,700 / 7,800 clocks a step against 7,300 / 7,400 at
// LSTM / GRU 1024 x 32, BENCHMARKS.md, twelfth session.) The same order every run: the same bits.
__device__ __forceinline__ void gather_owned_partials(const float* region, const int* lens, int s_next, int bv,
                                                      int nsrc, const Geometry& g, float4* stage_s, float4* red_s) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nu4 = g.hs / 4, n4 = nsrc * nu4;
  const int gs = grid_gather_samples(g, nsrc);
  const float4* base = reinterpret_cast<const float4*>(region);
  for (int c0 = 0; c0 < bv; c0 += gs) {
    const int c1 = min(bv, c0 + gs);
    __syncwarp();  // this warp's lanes are done with its slots of the last chunk
    for (int b = c0 + warp; b < c1; b += kWarps) {
      if (s_next >= lens[b]) continue;
      const float4* src = base + static_cast<int64_t>(b) * n4;
      float4* dst = stage_s + (b - c0) * n4;
      for (int e = lane; e < n4; e += 32) cp_async16(dst + e, src + e);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncwarp();  // every lane's copies, to the whole warp
    for (int b = c0 + warp; b < c1; b += kWarps) {
      if (s_next >= lens[b]) continue;
      const float4* src = stage_s + (b - c0) * n4;
      float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (int e = lane; e < n4; e += 32) {
        const float4 v = src[e];
        acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
      }
      for (int off = nu4; off < 32; off *= 2) {
        acc.x += __shfl_xor_sync(0xffffffffu, acc.x, off);
        acc.y += __shfl_xor_sync(0xffffffffu, acc.y, off);
        acc.z += __shfl_xor_sync(0xffffffffu, acc.z, off);
        acc.w += __shfl_xor_sync(0xffffffffu, acc.w, off);
      }
      if (lane < nu4) red_s[b * nu4 + lane] = acc;
    }
  }
  __syncthreads();
}
#endif
// The kernel for a cell and rows per thread (8, 16, 24 or 32): rnn_grid_backward_regs.cu.
const void* grid_backward_regs_kernel(Cell c, int nr);

template <Cell C, int NR>
__global__ void __launch_bounds__(kThreads, 1) rnn_backward_grid_regs_kernel(const BackwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int G = C == Cell::kLSTM ? 4 : 3;
  const Geometry& g = a.g;
  const int H = g.H, hs = g.hs;
  const GridRegsShape sh(G, H, hs);
  const int ldg = sh.ng * NR, nsrc = g.nc * sh.ng;
  const Block blk(g);
  const int bv = blk.bv, tid = threadIdx.x;

  extern __shared__ __align__(16) unsigned char smem[];
  const GridOwnedSmem lay = grid_regs_smem(g, sh);
  float* dg_s = reinterpret_cast<float*>(smem + lay.dg);
  float4* red_s = reinterpret_cast<float4*>(smem + lay.red);
  float4* stage_s = reinterpret_cast<float4*>(smem + lay.stage);
  int* lens = reinterpret_cast<int*>(smem + lay.lens);
  auto region = [&](int parity, int q) { return owned_region(a, blk, parity, q, nsrc); };

  const int quad = tid % sh.nq, grp = tid / sh.nq;
  const bool holder = grp < sh.ng;
  float w[NR][4];  // w[r][c] = W_hh[row r of the group][4 * quad + c]
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    const float* src = holder ? block_row(a.w_hh, G, g, blk, grp * NR + r) : nullptr;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int u = 4 * quad + c;
      w[r][c] = src && u < H ? src[u] : 0.0f;
    }
  }
  for (int e = tid; e < g.bs * ldg; e += kThreads) dg_s[e] = 0.0f;
  load_lengths(lens, a.lengths, g, blk);
  GroupBarrier bar{Sync::kGrid, a.arrivals + blk.group, static_cast<unsigned>(g.nc), 0u};
  const int smax = finish_setup(bar, lens, g.bs);

  auto gather = [&](int parity, int s_next) {
    gather_owned_partials(region(parity, blk.rank), lens, s_next, bv, nsrc, g, stage_s, red_s);
  };
  auto sum_of = [&](int b, int j) { return reinterpret_cast<const float*>(red_s)[b * hs + j]; };
  // This thread's 4 units' partials of the samples running at s, two samples at a time.
  auto products = [&](int cur, int s) {
    if (!holder) return;
    const int owner = 4 * quad / hs;
    float* out = region(cur, owner) + (blk.rank * sh.ng + grp) * hs + (4 * quad - owner * hs);
    const float* dg = dg_s + grp * NR;
    for (int b = next_running(lens, s, 0, bv); b < bv;) {
      const int b2 = next_running(lens, s, b + 1, bv), bb = b2 < bv ? b2 : b;
      float4 p1 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), p2 = p1;
#pragma unroll
      for (int r4 = 0; r4 < NR / 4; ++r4) {
        const float4 x1 = *reinterpret_cast<const float4*>(dg + b * ldg + 4 * r4);
        const float4 x2 = *reinterpret_cast<const float4*>(dg + bb * ldg + 4 * r4);
        const float v1[4] = {x1.x, x1.y, x1.z, x1.w}, v2[4] = {x2.x, x2.y, x2.z, x2.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float* wr = w[4 * r4 + i];
          p1.x = fmaf(wr[0], v1[i], p1.x), p1.y = fmaf(wr[1], v1[i], p1.y);
          p1.z = fmaf(wr[2], v1[i], p1.z), p1.w = fmaf(wr[3], v1[i], p1.w);
          p2.x = fmaf(wr[0], v2[i], p2.x), p2.y = fmaf(wr[1], v2[i], p2.y);
          p2.z = fmaf(wr[2], v2[i], p2.z), p2.w = fmaf(wr[3], v2[i], p2.w);
        }
      }
      __stcg(reinterpret_cast<float4*>(out + static_cast<int64_t>(b) * nsrc * hs), p1);
      if (b2 < bv) __stcg(reinterpret_cast<float4*>(out + static_cast<int64_t>(b2) * nsrc * hs), p2);
      b = b2 < bv ? next_running(lens, s, b2 + 1, bv) : bv;
    }
  };
  grid_backward_steps<C, kGridRegItems>(a, blk, lens, dg_s, ldg, bar, smax, gather, sum_of, products);
#endif
}

// The function NAME returning KERNEL for a cell, weight precision and batch tile (rnn_grid_forward.cu,
// rnn_grid_backward.cu, and the probe, which does not link the library).
#define VLSEQ_RNN_GRID_SWITCH(KERNEL, CELL, WT)                         \
  switch (bt) {                                                         \
    case 1: return reinterpret_cast<const void*>(&KERNEL<CELL, WT, 1>); \
    case 2: return reinterpret_cast<const void*>(&KERNEL<CELL, WT, 2>); \
    case 4: return reinterpret_cast<const void*>(&KERNEL<CELL, WT, 4>); \
    default: return reinterpret_cast<const void*>(&KERNEL<CELL, WT, 8>); \
  }
#define VLSEQ_RNN_GRID_TABLE(NAME, KERNEL)                                \
  const void* NAME(Cell c, Weights w, int bt) {                           \
    const bool lstm = c == Cell::kLSTM, fp32 = w == Weights::kFP32;       \
    if (lstm && fp32) VLSEQ_RNN_GRID_SWITCH(KERNEL, Cell::kLSTM, float)   \
    if (fp32) VLSEQ_RNN_GRID_SWITCH(KERNEL, Cell::kGRU, float)            \
    if (lstm) VLSEQ_RNN_GRID_SWITCH(KERNEL, Cell::kLSTM, __nv_bfloat16)   \
    VLSEQ_RNN_GRID_SWITCH(KERNEL, Cell::kGRU, __nv_bfloat16)              \
  }

// (rows, chunks) as in kGridFwdRegsShapes; the last, (32, 1), for anything else.
#define VLSEQ_RNN_GRID_FWD_REGS_CASES(KERNEL, CELL)                                     \
  if (nr == 8 && nm == 4) return reinterpret_cast<const void*>(&KERNEL<CELL, 8, 4>);   \
  if (nr == 16 && nm == 2) return reinterpret_cast<const void*>(&KERNEL<CELL, 16, 2>); \
  if (nr == 8 && nm == 2) return reinterpret_cast<const void*>(&KERNEL<CELL, 8, 2>);   \
  if (nr == 4 && nm == 8) return reinterpret_cast<const void*>(&KERNEL<CELL, 4, 8>);   \
  return reinterpret_cast<const void*>(&KERNEL<CELL, 32, 1>);
#define VLSEQ_RNN_GRID_FWD_REGS_TABLE(NAME, KERNEL)                      \
  const void* NAME(Cell c, int nr, int nm) {                             \
    if (c == Cell::kLSTM) { VLSEQ_RNN_GRID_FWD_REGS_CASES(KERNEL, Cell::kLSTM) } \
    VLSEQ_RNN_GRID_FWD_REGS_CASES(KERNEL, Cell::kGRU)                    \
  }
#define VLSEQ_RNN_GRID_REGS_SWITCH(KERNEL, CELL)                         \
  switch (nr) {                                                          \
    case 8: return reinterpret_cast<const void*>(&KERNEL<CELL, 8>);      \
    case 16: return reinterpret_cast<const void*>(&KERNEL<CELL, 16>);    \
    case 24: return reinterpret_cast<const void*>(&KERNEL<CELL, 24>);    \
    default: return reinterpret_cast<const void*>(&KERNEL<CELL, 32>);    \
  }
#define VLSEQ_RNN_GRID_REGS_TABLE(NAME, KERNEL)                                        \
  const void* NAME(Cell c, int nr) {                                                   \
    if (c == Cell::kLSTM) VLSEQ_RNN_GRID_REGS_SWITCH(KERNEL, Cell::kLSTM)              \
    VLSEQ_RNN_GRID_REGS_SWITCH(KERNEL, Cell::kGRU)                                     \
  }

#endif  // __CUDACC__

}  // namespace vlseq::rnn
