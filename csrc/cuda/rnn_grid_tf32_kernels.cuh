// The grid layout's TF32 kernels (weights "tf32": cuDNN's allow_tf32 mode): the recurrent products on
// the tensor cores, mma.sync m16n8k8 with W_hh in registers as the A fragments, rounded to TF32 once, and
// h (forward) or the gate gradients (backward) rounded to TF32 where the cells write them; sums and state
// stay fp32. The work split, the exchanges, the barrier and the cells are the fp32 grid kernels'
// (rnn_grid_kernels.cuh: grid_forward_steps, grid_backward_steps, the backward's owner-major partials and
// gather). The fp32 register kernels' products took ~16 K clocks a step each way at LSTM 1024 x 32
// (twice the FMAs' issue time: shuffles, selects, bookkeeping); these take ~1 K of MMAs, so the step is
// left with the exchange.
//
// The k order inside an MMA is free (the sum is the same set of products), so the columns are permuted
// to let one float4 load give a lane its B operands of two k-steps: in the pair of k-steps p (16
// columns c0 .. c0 + 15), lane (g = lane / 4, t = lane % 4) holds slots t and t + 4 of k-step 2p as
// columns c0 + 4t and c0 + 4t + 1, and of k-step 2p + 1 as c0 + 4t + 2 and + 3: its B operands are the
// float4 at column c0 + 4t of its sample's row. Rows of A (forward: W_hh's rows; backward: the units)
// are placed as the stores want them.
#pragma once

#include "rnn_grid_kernels.cuh"

namespace vlseq::rnn {

constexpr int kMmaK = 8;  // k of an m16n8k8 MMA; its M is 16, its N (samples) 8

// The forward: warp w multiplies all the block's rows (mt m-tiles of 16) by columns w * 8 * ks .. (ks
// k-steps: 8, 12 or 16, the kernels built; kq = 64 * ks in all, at most a quarter of them padding); the
// warps' sums meet in shared memory.
struct GridTf32FwdShape {
  int mt = 0, ks = 0, kq = 0;  // ks = 0: no kernel fits
  __host__ __device__ GridTf32FwdShape(int G, int H, int hs) {
    const int Kp = round_up(H, 4), m = ceil_div(G * hs, 16);
    if (m > 2) return;
    for (int k = 8; k <= 16; k += 4)
      if (kWarps * kMmaK * k >= Kp && 4 * kWarps * kMmaK * k <= 5 * Kp) {
        mt = m, ks = k, kq = kWarps * kMmaK * k;
        return;
      }
  }
};
// Its shared memory: h_{t-1} of the group's samples ([b][ldh], ldh = kq + 16: a quarter warp's float4
// loads, two samples x 4 lanes, then fall on distinct banks), the warps' sums ([warp][b][ldp], ldp =
// 16 * mt + 4: the C fragments' stores likewise), the lengths.
struct GridTf32FwdSmem {
  int ldh, ldp, h, part, lens, total;
  __host__ __device__ GridTf32FwdSmem(const Geometry& g, const GridTf32FwdShape& sh) {
    const int bsp = round_up(g.bs, 8);
    ldh = sh.kq + 16, ldp = 16 * sh.mt + 4;
    int off = 0;
    h = off, off += bsp * ldh * 4;
    part = off, off += round_up(kWarps * bsp * ldp * 4, 16);
    lens = off, off += round_up(g.bs * 4, 16);
    total = off;
  }
};

// The backward: warp w computes the partials of units w * 16 * mt .. (mt even: a lane's 2 * mt units of
// a sample are consecutive, float4 stores) over the block's rows as ks k-steps (even, rows padded with
// zero gate gradients); each block is one source of its units' owners' partials (nsrc = nc).
struct GridTf32BwdShape {
  int mt = 0, ks = 0, ldg = 0;  // ks = 0: no kernel fits
  __host__ __device__ GridTf32BwdShape(int G, int H, int hs) {
    const int Kp = round_up(H, 4), nu4 = hs / 4;
    const int m = round_up(ceil_div(Kp, kWarps * 16), 2), k = round_up(ceil_div(G * hs, kMmaK), 2);
    // The gather sums float4s of units over the lanes of a quad: hs / 4 a power of 2, at most 32.
    if (m > 8 || k > 4 || hs % 4 != 0 || nu4 > 32 || (nu4 & (nu4 - 1)) != 0) return;
    mt = m, ks = k, ldg = round_up(kMmaK * k, 32) + 16;  // the float4 loads of dg: distinct banks
  }
};

// The backward's shared memory (the gate gradients of whole tiles of 8 samples: the MMAs read them all).
__host__ __device__ inline int tiles_of(const Geometry& g) { return ceil_div(g.bs, 8); }
__host__ __device__ inline GridOwnedSmem grid_tf32_bwd_smem(const Geometry& g, const GridTf32BwdShape& sh) {
  return GridOwnedSmem(g, 8 * tiles_of(g), sh.ldg, g.nc);
}

// The kernels for a cell and shape: rnn_grid_forward_tf32.cu, rnn_grid_backward_tf32.cu.
const void* grid_forward_tf32_kernel(Cell c, int mt, int ks);
const void* grid_backward_tf32_kernel(Cell c, int mt, int ks);

#if defined(__CUDACC__)

__device__ __forceinline__ uint32_t tf32_bits(float x) { return __float_as_uint(round_tf32(x)); }

// d += a * b: a 16 x 8 tile of A (rows g, g + 8; slots t, t + 4), b its 8 x 8 B (slots t, t + 4 of
// sample g), d its 16 x 8 C (rows g, g + 8; samples 2t, 2t + 1).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], float b0, float b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
}

// Whether any of samples n0 .. n0 + 7 runs at step s (the same answer in every lane).
__device__ __forceinline__ bool tile_runs(const int* lens, int n0, int bv, int s) {
  const int lane = threadIdx.x % 32;
  return __any_sync(0xffffffffu, lane < 8 && n0 + lane < bv && s < lens[n0 + lane]);
}

template <Cell C, int MT, int KS>
__global__ void __launch_bounds__(kThreads, 1) rnn_forward_grid_tf32_kernel(const ForwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(kWarps == 8 && KS % 2 == 0, "a warp stages one sample of each tile of 8; k-steps in pairs");
  constexpr int G = C == Cell::kLSTM ? 4 : 3, KW = kMmaK * KS;  // KW: the warp's columns
  const Geometry& g = a.g;
  const int H = g.H, hs = g.hs, R = G * hs, Kp = round_up(H, 4);
  const Block blk(g);
  const int bv = blk.bv, tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gr = lane / 4, t = lane % 4;
  const int bsp = round_up(g.bs, 8), tiles = ceil_div(bv, 8);

  extern __shared__ __align__(16) unsigned char smem[];
  const GridTf32FwdSmem lay(g, GridTf32FwdShape(G, H, hs));
  const int ldh = lay.ldh, ldp = lay.ldp;
  float* h_s = reinterpret_cast<float*>(smem + lay.h);
  float* part_s = reinterpret_cast<float*>(smem + lay.part);
  int* lens = reinterpret_cast<int*>(smem + lay.lens);

  // A fragments: w[m][k] of rows 16m + gr (+ 8), k-step k of this warp's columns (permuted as above).
  uint32_t w[MT][KS][4];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    float v[2][KS][2];  // [row half][k-step][slot half]
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = 16 * m + gr + 8 * half, k = row / hs, j = row - k * hs;
      const bool real = row < R && j < blk.hv;
      const float* src = a.w_hh + static_cast<int64_t>(k * H + blk.j0 + j) * H;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = warp * KW + 16 * (ks / 2) + 4 * t + 2 * (ks % 2) + e;
          v[half][ks][e] = real && c < H ? src[c] : 0.0f;
        }
    }
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      w[m][ks][0] = tf32_bits(v[0][ks][0]), w[m][ks][1] = tf32_bits(v[1][ks][0]);
      w[m][ks][2] = tf32_bits(v[0][ks][1]), w[m][ks][3] = tf32_bits(v[1][ks][1]);
    }
  }
  load_lengths(lens, a.lengths, g, blk);
  for (int e = tid; e < bsp * ldh; e += kThreads) h_s[e] = 0.0f;  // padding columns and samples stay 0
  GroupBarrier bar{Sync::kGrid, a.arrivals + blk.group, static_cast<unsigned>(g.nc), 0u};

  auto products = [&](int s, const float* in) {
    // Each tile of 8 samples its own cp.async group, a warp per sample: tile n's MMAs run while the
    // later tiles' rows arrive.
    for (int n = 0; n < tiles; ++n) {
      const int b = 8 * n + warp;
      if (b < bv && s < lens[b]) {
        const float* src = in + static_cast<int64_t>(b) * Kp;
        for (int k4 = lane; k4 < Kp / 4; k4 += 32) cp_async16(h_s + b * ldh + 4 * k4, src + 4 * k4);
      }
      cp_async_commit();
    }
    VLSEQ_MARK(0, 1, s);
    for (int n = 0; n < tiles; ++n) {
      switch (min(tiles - 1 - n, 3)) {  // tile n's group done: at most tiles - 1 - n still in flight
        case 0: cp_async_wait<0>(); break;
        case 1: cp_async_wait<1>(); break;
        case 2: cp_async_wait<2>(); break;
        default: cp_async_wait<3>(); break;
      }
      __syncthreads();
      if (!tile_runs(lens, 8 * n, bv, s)) continue;
      float acc[MT][2][4];  // two sums per m-tile (even and odd pairs of k-steps): twice the chains
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[m][e / 4][e % 4] = 0.0f;
      const float* hb = h_s + (8 * n + gr) * ldh + warp * KW + 4 * t;
#pragma unroll
      for (int p = 0; p < KS / 2; ++p) {
        const float4 x = *reinterpret_cast<const float4*>(hb + 16 * p);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          mma_tf32(acc[m][p % 2], w[m][2 * p], x.x, x.y);
          mma_tf32(acc[m][p % 2], w[m][2 * p + 1], x.z, x.w);
        }
      }
      // C: rows 16m + gr (+ 8), samples 8n + 2t (+ 1); this warp's sums of them to part_s.
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          part_s[(warp * bsp + 8 * n + 2 * t + (e & 1)) * ldp + 16 * m + gr + 8 * (e / 2)] = acc[m][0][e] + acc[m][1][e];
    }
    VLSEQ_MARK(0, 2, s);
    __syncthreads();
  };
  grid_forward_steps<C, kGridRegItems, true>(a, blk, lens, bar, products, [&](int b, int k, int j) {
    float v = 0.0f;
#pragma unroll
    for (int q = 0; q < kWarps; ++q) v += part_s[(q * bsp + b) * ldp + k * hs + j];
    return v;
  });
#endif
}

template <Cell C, int MT, int KS>
__global__ void __launch_bounds__(kThreads, 1) rnn_backward_grid_tf32_kernel(const BackwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(MT % 2 == 0 && KS % 2 == 0, "units in float4s; k-steps in pairs");
  constexpr int G = C == Cell::kLSTM ? 4 : 3;
  const Geometry& g = a.g;
  const int H = g.H, hs = g.hs, R = G * hs, nsrc = g.nc;
  const int ldg = GridTf32BwdShape(G, H, hs).ldg;
  const Block blk(g);
  const int bv = blk.bv, tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gr = lane / 4, t = lane % 4;
  const int tiles = ceil_div(bv, 8);

  extern __shared__ __align__(16) unsigned char smem[];
  const GridOwnedSmem lay = grid_tf32_bwd_smem(g, GridTf32BwdShape(G, H, hs));
  float* dg_s = reinterpret_cast<float*>(smem + lay.dg);  // [b][ldg], rows past R and samples past bs zero
  float4* red_s = reinterpret_cast<float4*>(smem + lay.red);
  float4* stage_s = reinterpret_cast<float4*>(smem + lay.stage);
  int* lens = reinterpret_cast<int*>(smem + lay.lens);

  // A fragments: w[m][k] = W_hh^T of units unit(m, 0) (row gr of the m-tile) and unit(m, 1) (row gr +
  // 8), rows of W_hh as k-step k's slots (permuted as above). Lanes gr and gr ^ 1 (4 apart) hold the two
  // halves of 8 consecutive units (two float4s of a 32-byte sector: an owner's 8 units of a sample
  // where hs is 8), for MT / 2 such runs: each store instruction then writes whole sectors (with a
  // lane's 2 * MT units consecutive, every sector took two half writes: the step's partials 24.9 K
  // clocks at LSTM 1024 x 32 against 15.5 K for the FFMA kernel, BENCHMARKS.md, thirteenth session).
  const int u0 = warp * 16 * MT + (gr / 2) * 4 * MT + 4 * (gr % 2);
  auto unit = [&](int m, int half) { return u0 + 8 * (m / 2) + 2 * (m % 2) + half; };
  uint32_t w[MT][KS][4];
#pragma unroll
  for (int ks = 0; ks < KS; ++ks)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = 16 * (ks / 2) + 4 * t + 2 * (ks % 2) + e, k = row / hs, j = row - k * hs;
      const bool real = row < R && j < blk.hv;
      const float* src = a.w_hh + static_cast<int64_t>(k * H + blk.j0 + j) * H;
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int u = unit(m, half);
          w[m][ks][2 * e + half] = tf32_bits(real && u < H ? src[u] : 0.0f);
        }
    }
  for (int e = tid; e < 8 * tiles_of(g) * ldg; e += kThreads) dg_s[e] = 0.0f;
  load_lengths(lens, a.lengths, g, blk);
  GroupBarrier bar{Sync::kGrid, a.arrivals + blk.group, static_cast<unsigned>(g.nc), 0u};
  const int smax = finish_setup(bar, lens, g.bs);

  auto gather = [&](int parity, int s_next) {
    gather_owned_partials(owned_region(a, blk, parity, blk.rank, nsrc), lens, s_next, bv, nsrc, g, stage_s, red_s);
  };
  auto sum_of = [&](int b, int j) { return reinterpret_cast<const float*>(red_s)[b * hs + j]; };
  // The partials of the samples running at s, a tile of 8 at a time: a lane's 2 * MT units of samples
  // 8n + 2t and + 1, as float4s (units unit(2q, 0) ..) to their owners (units past H are W's zero
  // padding: not stored).
  auto products = [&](int cur, int s) {
    for (int n = 0; n < tiles; ++n) {
      if (!tile_runs(lens, 8 * n, bv, s)) continue;
      float acc[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.0f;
      const float* db = dg_s + (8 * n + gr) * ldg + 4 * t;
#pragma unroll
      for (int p = 0; p < KS / 2; ++p) {
        const float4 x = *reinterpret_cast<const float4*>(db + 16 * p);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          mma_tf32(acc[m], w[m][2 * p], x.x, x.y);
          mma_tf32(acc[m], w[m][2 * p + 1], x.z, x.w);
        }
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int b = 8 * n + 2 * t + e;
        if (b >= bv || s >= lens[b]) continue;
#pragma unroll
        for (int q = 0; q < MT / 2; ++q) {
          const int u = unit(2 * q, 0), owner = u / hs;
          if (u >= H) break;
          float* out = owned_region(a, blk, cur, owner, nsrc) + (static_cast<int64_t>(b) * nsrc + blk.rank) * hs + (u - owner * hs);
          __stcg(reinterpret_cast<float4*>(out),
                 make_float4(acc[2 * q][e], acc[2 * q][2 + e], acc[2 * q + 1][e], acc[2 * q + 1][2 + e]));
        }
      }
    }
  };
  grid_backward_steps<C, kGridRegItems, true>(a, blk, lens, dg_s, ldg, bar, smax, gather, sum_of, products);
#endif
}

// The function NAME returning KERNEL for a cell and (m-tiles, k-steps): the forward's (1 or 2, one of
// 8, 12, 16), the backward's (2, 4, 6 or 8; 2 or 4).
#define VLSEQ_RNN_GRID_TF32_FWD_CASES(KERNEL, CELL)                                          \
  if (mt == 1 && ks == 8) return reinterpret_cast<const void*>(&KERNEL<CELL, 1, 8>);    \
  if (mt == 1 && ks == 12) return reinterpret_cast<const void*>(&KERNEL<CELL, 1, 12>);  \
  if (mt == 1) return reinterpret_cast<const void*>(&KERNEL<CELL, 1, 16>);              \
  if (ks == 8) return reinterpret_cast<const void*>(&KERNEL<CELL, 2, 8>);               \
  if (ks == 12) return reinterpret_cast<const void*>(&KERNEL<CELL, 2, 12>);             \
  return reinterpret_cast<const void*>(&KERNEL<CELL, 2, 16>);
#define VLSEQ_RNN_GRID_TF32_BWD_CASES(KERNEL, CELL)                                   \
  if (ks == 2) {                                                                       \
    if (mt == 2) return reinterpret_cast<const void*>(&KERNEL<CELL, 2, 2>);            \
    if (mt == 4) return reinterpret_cast<const void*>(&KERNEL<CELL, 4, 2>);            \
    if (mt == 6) return reinterpret_cast<const void*>(&KERNEL<CELL, 6, 2>);            \
    return reinterpret_cast<const void*>(&KERNEL<CELL, 8, 2>);                         \
  }                                                                                    \
  if (mt == 2) return reinterpret_cast<const void*>(&KERNEL<CELL, 2, 4>);              \
  if (mt == 4) return reinterpret_cast<const void*>(&KERNEL<CELL, 4, 4>);              \
  if (mt == 6) return reinterpret_cast<const void*>(&KERNEL<CELL, 6, 4>);              \
  return reinterpret_cast<const void*>(&KERNEL<CELL, 8, 4>);
#define VLSEQ_RNN_GRID_TF32_TABLE(NAME, KERNEL, CASES)              \
  const void* NAME(Cell c, int mt, int ks) {                        \
    if (c == Cell::kLSTM) { CASES(KERNEL, Cell::kLSTM) }            \
    CASES(KERNEL, Cell::kGRU)                                       \
  }

#endif  // __CUDACC__

}  // namespace vlseq::rnn
