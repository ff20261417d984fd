// The grid layout's kernels: W_hh too large for a thread-block cluster (fp32 LSTM from hidden ~440 on)
// spread over up to one block per SM of a cooperative launch. The work split, the exchanges and the
// synchronisation protocol are the generic kernels' (rnn_kernels.cuh: block `rank` owns hidden units
// [rank*hs, rank*hs + hs); the forward all-gathers h, the backward reduce-scatters partial dh; both
// through double-buffered global buffers and the barrier on a per-group counter). What differs is
// that these kernels are built for many samples per block, where the generic ones were bound by
// shared-memory reads and by unoverlapped loads (fp32 LSTM 1024 at batch 32 ran 0.84x of cuDNN):
//  - products as register tiles of kGridRows rows x BT samples: a thread reads 8 + BT float4s from
//    shared memory for 32 * BT FMAs (the generic 2-row tile: 2 + BT for 8 * BT), so the reads no longer
//    bound them (the k loops issue ~70% of the time; the step's rest is the exchange through L2:
//    BENCHMARKS.md, eleventh session);
//  - the forward stages h_{t-1} of the group's samples in chunks of k columns with cp.async into two
//    buffers: the L2 reads of chunk c + 1 run under the products of chunk c (cp.async.cg reads L2,
//    never a stale L1 line);
//  - the lanes that split a tile's sums end with a reduce-scatter butterfly (store_lane_totals):
//    each level a lane keeps half of its values and adds its partner's half of them, 60 shuffles for
//    64 values over 16 lanes where a full butterfly takes 256;
//  - the backward sums the nc partials of its units with float4 loads spread over the block's threads
//    (slices of the ranks, then the slices in order: a fixed order, the same bits every run).
// Samples past their length are neither loaded, multiplied (a tile whose samples have all ended is
// skipped) nor delivered: nobody reads their products (a sample live at step s was live at s - 1).
#pragma once

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

// The longest length of samples [b, b + n) of the block's lengths (0 past the group's bs).
__device__ __forceinline__ int longest(const int* lens, int b, int n, int bs) {
  int m = 0;
  for (int i = b; i < min(b + n, bs); ++i) m = max(m, lens[i]);
  return m;
}

template <Cell C, typename WT, int BT>
__global__ void __launch_bounds__(kThreads, 1) rnn_forward_grid_kernel(const ForwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int G = C == Cell::kLSTM ? 4 : 3, RT = kGridRows, N = RT * BT;
  const Geometry& g = a.g;
  const int H = g.H, hs = g.hs, R = G * hs;
  const int Kp = round_up(H, 4), ldw = Kp + 4, kc = g.chunk, ldh = kc + 4, nch = ceil_div(Kp, kc);
  const Block blk(g);
  const int j0 = blk.j0, hv = blk.hv, b0 = blk.b0, bv = blk.bv, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int bsp = round_up(g.bs, BT);

  extern __shared__ __align__(16) unsigned char smem[];
  const GridForwardSmem lay(g, G, sizeof(WT), BT);
  WT* w_s = reinterpret_cast<WT*>(smem + lay.w);
  float* h_s = reinterpret_cast<float*>(smem + lay.h);
  float* gates_s = reinterpret_cast<float*>(smem + lay.gates);
  int* lens = reinterpret_cast<int*>(smem + lay.lens);
  // Exchange: h of every sample of the group, rows of Kp (the host zeroes the padding).
  auto xchg = [&](int parity) {
    return a.xchg + (static_cast<int64_t>(parity) * blk.groups + blk.group) * g.bs * Kp;
  };

  load_weights<false>(w_s, ldw, round_up(R, RT), ldw, a.w_hh, G, g, blk);
  load_lengths(lens, a.lengths, g, blk);
  for (int e = tid; e < 2 * bsp * ldh; e += kThreads) h_s[e] = 0.0f;
  const Items it(bv, hv);
  float h[kMaxItems], c[kMaxItems], bias[kMaxItems][G];
#pragma unroll
  for (int i = 0; i < kMaxItems; ++i) {
    h[i] = c[i] = 0.0f;
    if (it.b[i] < 0) continue;
    const int64_t at = static_cast<int64_t>(b0 + it.b[i]) * H + j0 + it.j[i];
    h[i] = a.h0[at];
    if constexpr (C == Cell::kLSTM) c[i] = a.c0[at];
#pragma unroll
    for (int q = 0; q < G; ++q) bias[i][q] = a.b_hh ? a.b_hh[q * H + j0 + it.j[i]] : 0.0f;
    __stcg(xchg(0) + static_cast<int64_t>(it.b[i]) * Kp + j0 + it.j[i], h[i]);
  }
  GroupBarrier bar{Sync::kGrid, a.arrivals + blk.group, static_cast<unsigned>(g.nc), 0u};
  const int smax = finish_setup(bar, lens, g.bs);

  // This thread's tile: rows r0 .. r0 + RT - 1 of W, samples sb .. sb + BT - 1; lanes q of ks split k.
  const int nrt = ceil_div(R, RT), tiles = nrt * ceil_div(bv, BT), ks = grid_lanes(tiles, kc / 4);
  const int tile = tid / ks, q = tid % ks, r0 = (tile % nrt) * RT, sb = (tile / nrt) * BT;
  const int tile_len = tile < tiles ? longest(lens, sb, BT, bv) : 0;

  float xnext[kMaxItems][G];
  load_step_inputs(a, blk, it, lens, 0, xnext);
  for (int s = 0; s < smax; ++s) {
    const int cur = s & 1;
    const float* in = xchg(cur);
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
    float x[kMaxItems][G];
#pragma unroll
    for (int i = 0; i < kMaxItems; ++i)
#pragma unroll
      for (int k = 0; k < G; ++k) x[i][k] = xnext[i][k];
    VLSEQ_MARK(0, 0, s);
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
    VLSEQ_MARK(0, 3, s);
    // The cell of this thread's (sample, unit) pairs still running; h to the exchange at once.
    float out[kMaxItems][4];
    bool live[kMaxItems];
#pragma unroll
    for (int i = 0; i < kMaxItems; ++i) {
      const int b = it.b[i], j = it.j[i];
      live[i] = b >= 0 && s < lens[b];
      if (!live[i]) continue;
      float gh[G];
#pragma unroll
      for (int k = 0; k < G; ++k) gh[k] = gates_s[b * R + k * hs + j] + bias[i][k];
      forward_cell<C>(x[i], gh, h[i], c[i], out[i]);
      __stcg(xchg(cur ^ 1) + static_cast<int64_t>(b) * Kp + j0 + j, h[i]);
    }
    VLSEQ_MARK(0, 4, s);
    bar.arrive();
    VLSEQ_MARK(0, 5, s);
    store_step_outputs<C>(a, blk, it, lens, s, live, h, c, out);
    load_step_inputs(a, blk, it, lens, s + 1, xnext);
    VLSEQ_MARK(0, 6, s);
    bar.wait();
  }
#pragma unroll
  for (int i = 0; i < kMaxItems; ++i) {
    if (it.b[i] < 0) continue;
    const int64_t o = static_cast<int64_t>(b0 + it.b[i]) * H + j0 + it.j[i];
    a.h_n[o] = h[i];
    if constexpr (C == Cell::kLSTM) a.c_n[o] = c[i];
  }
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
    float v = 0.0f;
    if (r < G * g.hs && k < g.H) {
      const int q = r / g.hs, j = r - q * g.hs;
      if (j < blk.hv) v = w_hh[static_cast<int64_t>(q * g.H + blk.j0 + j) * g.H + k];
    }
    const int chunk = (r / 4) ^ grid_swizzle(k / kGridRows, ks, sizeof(WT));
    wt[k * ldt + 4 * chunk + (r & 3)] = to_weight<WT>(v);
  }
}

template <Cell C, typename WT, int BT>
__global__ void __launch_bounds__(kThreads, 1) rnn_backward_grid_kernel(const BackwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int G = C == Cell::kLSTM ? 4 : 3, F = backward_fields(C), RT = kGridRows, N = RT * BT;
  const Geometry& g = a.g;
  const int H = g.H, hs = g.hs, R = G * hs, Kp = round_up(H, 4), Rp = round_up(R, 4);
  const int Kx = g.nc * hs;  // exchange rows: every block's units (nc * hs >= H, a multiple of 4)
  const Block blk(g);
  const int rank = blk.rank, j0 = blk.j0, hv = blk.hv, b0 = blk.b0, bv = blk.bv, tid = threadIdx.x;
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
  const Items it(bv, hv);
  float dh[kMaxItems], dc[kMaxItems], ddir[kMaxItems];
#pragma unroll
  for (int i = 0; i < kMaxItems; ++i) {
    dh[i] = dc[i] = ddir[i] = 0.0f;
    if (it.b[i] < 0) continue;
    const int64_t at = static_cast<int64_t>(b0 + it.b[i]) * H + j0 + it.j[i];
    if (a.dh_n) dh[i] = a.dh_n[at];
    if (a.dc_n) dc[i] = a.dc_n[at];
  }
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

  float pnext[kMaxItems][F];
  auto prefetch = [&](int s) {
#pragma unroll
    for (int i = 0; i < kMaxItems; ++i) {
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
    float p[kMaxItems][F];
#pragma unroll
    for (int i = 0; i < kMaxItems; ++i)
#pragma unroll
      for (int f = 0; f < F; ++f) p[i][f] = pnext[i][f];
    VLSEQ_MARK(1, 0, s);
    if (s + 1 < smax) gather(cur ^ 1, s + 1);  // dh_t from step s+1's partials
    VLSEQ_MARK(1, 1, s);
    float rg[kMaxItems][4], dn[kMaxItems];
    bool live[kMaxItems];
#pragma unroll
    for (int i = 0; i < kMaxItems; ++i) {
      const int b = it.b[i], j = it.j[i];
      live[i] = false;
      if (b < 0) continue;
      const int len = lens[b];
      if (s + 1 < len) dh[i] = sum_of(b, j) + ddir[i];
      float* dgb = dg_s + b * Rp + j;  // gate k at dgb[k * hs]
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
    // Partial dh_{t-1} over this block's rows for every unit, to this block's slot of parity cur.
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
    VLSEQ_MARK(1, 3, s);
    bar.arrive();
    VLSEQ_MARK(1, 4, s);
#pragma unroll
    for (int i = 0; i < kMaxItems; ++i) {
      if (!live[i]) continue;
      const int b = it.b[i];
      store_gate_grads<C>(a, step_row(g, blk, b, lens[b], s), j0 + it.j[i], rg[i], dn[i]);
    }
    prefetch(s - 1);
    VLSEQ_MARK(1, 5, s);
    bar.wait();
  }
  gather(0, 0);
#pragma unroll
  for (int i = 0; i < kMaxItems; ++i) {
    const int b = it.b[i];
    if (b < 0) continue;
    const int64_t o = static_cast<int64_t>(b0 + b) * H + j0 + it.j[i];
    a.dh0[o] = lens[b] > 0 ? sum_of(b, it.j[i]) + ddir[i] : dh[i];
    if constexpr (C == Cell::kLSTM) a.dc0[o] = dc[i];
  }
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

#endif  // __CUDACC__

}  // namespace vlseq::rnn
