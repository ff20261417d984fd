// The grid layout's TF32 kernels (weights "tf32": cuDNN's allow_tf32 mode): the recurrent products on
// the tensor cores, mma.sync m16n8k8 with W_hh in registers (rounded to TF32 once) as one operand, and h
// (forward) or the gate gradients (backward) rounded to TF32 where the cells write them as the other;
// sums and state stay fp32. The cells and the barrier are the fp32 grid kernels' (rnn_grid_kernels.cuh:
// grid_forward_steps, grid_backward_steps); the forward's exchange too (it all-gathers h), while the
// backward all-gathers the gate gradients where the fp32 kernels reduce-scatter partial sums (below).
// The fp32 register kernels' products took ~16 K clocks a step each way at LSTM 1024 x 32 (twice the
// FMAs' issue time: shuffles, selects, bookkeeping); these take ~1 K of MMAs, so the step is left with
// the exchange.
//
// The k order inside an MMA is free (the sum is the same set of products), so k is permuted to let one
// float4 load give a lane its operands of two k-steps: in the pair of k-steps p (16 values of k, c0 ..
// c0 + 15), lane (g = lane / 4, t = lane % 4) holds slots t and t + 4 of k-step 2p as c0 + 4t and c0 +
// 4t + 1, and of k-step 2p + 1 as c0 + 4t + 2 and + 3: its operands from shared memory are the float4
// at c0 + 4t of its sample's row.
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

// The backward all-gathers the step's recurrent gate gradients instead of sending partial sums: the
// cells write their units' (rounded to TF32) to the exchange buffer, rows k * Hp + j (Hp = H rounded up
// to 4; padding rows zero), and every block multiplies all of them by its units' columns of W_hh,
// dh^T (samples x units) = G^T W[:, units]: M the samples (mt = 1 or 2 m-tiles of 16: at most 32 samples
// a group; with 4, W, the cells' state and the sums outgrew the registers), N the block's units (hs 4 or
// 8: one n-tile), K the kx rows, split over the warps (kp pairs of k-steps each, W in registers as the
// B fragments). A block then reads 4 * H floats a sample (512 KB a step at LSTM 1024 x 32, every
// block the same data, at the SM's intake of ~42 bytes a clock) where the partials cost a write of
// H floats a sample, their wait at the barrier and a gather of as many (BENCHMARKS.md: 7.5 K, 2.7 K and
// 7.8 K clocks of a 22.6 K step).
struct GridTf32BwdShape {
  int mt = 0, kp = 0, kx = 0, ldg = 0;  // kp = 0: no kernel fits
  __host__ __device__ GridTf32BwdShape(int G, int H, int hs, int bs) {
    const int pairs = ceil_div(G * round_up(H, 4), kWarps * 16), m = ceil_div(bs, 16);
    const int k = pairs <= 16 ? 16 : pairs <= 24 ? 24 : pairs <= 32 ? 32 : 0;
    if (k == 0 || m > 2 || (hs != 4 && hs != 8)) return;
    mt = m, kp = k, kx = kWarps * 16 * k, ldg = G * hs;
  }
};
// Each warp streams its rows through a ring of kTf32Stages shared-memory buffers (cp.async, one chunk of
// 64 / mt rows of every sample each: 4 KB at 16 * mt samples, each sample's row padded by 16 bytes),
// kTf32Stages - 1 chunks in flight while it multiplies one. -DVLSEQ_RNN_TF32_STAGES=n for the probe's A/B.
#ifndef VLSEQ_RNN_TF32_STAGES
#define VLSEQ_RNN_TF32_STAGES 4
#endif
constexpr int kTf32Stages = VLSEQ_RNN_TF32_STAGES;
// Its shared memory: the cells' gate gradients (bs x ldg), the warps' sums ([warp][16 * mt][8 units]),
// the warps' rings, the lengths.
struct GridTf32BwdSmem {
  int dg, part, stage, lens, total;
  __host__ __device__ GridTf32BwdSmem(const Geometry& g, const GridTf32BwdShape& sh) {
    int off = 0;
    dg = off, off += round_up(g.bs * sh.ldg * 4, 16);
    part = off, off += kWarps * 16 * sh.mt * 8 * 4;
    stage = off, off += kWarps * kTf32Stages * 16 * sh.mt * (64 / sh.mt + 4) * 4;
    lens = off, off += round_up(g.bs * 4, 16);
    total = off;
  }
};
// Floats of its exchange buffer (zeroed: the padding rows are never written): two parities of every
// group's bs samples x kx rows.
inline int64_t grid_tf32_exchange(const Geometry& g, int groups, const GridTf32BwdShape& sh) {
  return 2 * static_cast<int64_t>(groups) * g.bs * sh.kx;
}

// The kernels for a cell and shape: rnn_grid_forward_tf32.cu, rnn_grid_backward_tf32.cu.
const void* grid_forward_tf32_kernel(Cell c, int mt, int ks);
const void* grid_backward_tf32_kernel(Cell c, int mt, int kp);

#if defined(__CUDACC__)

__device__ __forceinline__ uint32_t tf32_bits(float x) { return __float_as_uint(round_tf32(x)); }

// d += a * b: a the 16 x 8 A (a0, a1: slot t of rows g, g + 8; a2, a3: slot t + 4), b its 8 x 8 B (slots
// t, t + 4 of column g), d the 16 x 8 C (rows g, g + 8; columns 2t, 2t + 1); a and b as TF32 bits.
__device__ __forceinline__ void mma_tf32(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// The forward's: A (W_hh) held as fragments, B (h) read as floats.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], float b0, float b1) {
  mma_tf32(d, a[0], a[1], a[2], a[3], __float_as_uint(b0), __float_as_uint(b1));
}

// A fragments of an m16n8k8 TF32 MMA from shared memory: lanes 8j .. 8j + 7 give the addresses of rows
// 0-7 (j = 0, 2) or 8-15 (j = 1, 3), k 0-3 (j = 0, 1) or 4-7 (j = 2, 3), 16 bytes each (ldmatrix of
// 16-bit pairs: a lane gets element t of row g of each 8 x 4 block, which is the fragment's layout).
__device__ __forceinline__ void ldsm_tf32_a(uint32_t (&a)[4], const float* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(smem_u32(p)));
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

template <Cell C, int MT, int KP>
__global__ void __launch_bounds__(kThreads, 1) rnn_backward_grid_tf32_kernel(const BackwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // A chunk: CR rows of every sample (rows LDR floats apart: 16 bytes of padding put the 8 rows of an
  // ldmatrix block on distinct banks), KC k-steps; NCH chunks a warp; KX rows of the exchange.
  constexpr int G = C == Cell::kLSTM ? 4 : 3, NB = kTf32Stages, BSP = 16 * MT, CR = 64 / MT;
  constexpr int LDR = CR + 4, KC = CR / 8, NCH = 2 * KP / KC, KX = kWarps * 16 * KP;
  static_assert(NB >= 2 && (2 * KP) % KC == 0, "a ring of two buffers at least; whole chunks");
  const Geometry& g = a.g;
  const int H = g.H, hs = g.hs, Hp = round_up(H, 4), kw = 16 * KP, ldg = G * hs;
  const Block blk(g);
  const int bv = blk.bv, tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gr = lane / 4, t = lane % 4;

  extern __shared__ __align__(16) unsigned char smem[];
  const GridTf32BwdSmem lay(g, GridTf32BwdShape(G, H, hs, g.bs));
  float* dg_s = reinterpret_cast<float*>(smem + lay.dg);      // [b][ldg]: gate k of unit j at k * hs + j
  float* part_s = reinterpret_cast<float*>(smem + lay.part);  // [warp][b][8]
  float* ring = reinterpret_cast<float*>(smem + lay.stage) + warp * NB * BSP * LDR;  // [buffer][b][LDR]
  int* lens = reinterpret_cast<int*>(smem + lay.lens);

  // B fragments: w[ks][i] = W_hh[row][unit j0 + gr] of exchange row warp * kw + 8 ks + t + 4i (k * Hp + j:
  // W_hh's row k * H + j), slots t and t + 4 of k-step ks (the A fragments come in k's own order).
  uint32_t w[2 * KP][2];
#pragma unroll
  for (int ks = 0; ks < 2 * KP; ++ks)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = warp * kw + 8 * ks + t + 4 * i, k = r / Hp, j = r - k * Hp;
      const bool real = k < G && j < H && gr < blk.hv;
      w[ks][i] = tf32_bits(real ? a.w_hh[static_cast<int64_t>(k * H + j) * H + blk.j0 + gr] : 0.0f);
    }
  for (int e = tid; e < g.bs * ldg; e += kThreads) dg_s[e] = 0.0f;
  load_lengths(lens, a.lengths, g, blk);
  GroupBarrier bar{Sync::kGrid, a.arrivals + blk.group, static_cast<unsigned>(g.nc), 0u};
  const int smax = finish_setup(bar, lens, g.bs);

  auto region = [&](int parity) {
    return a.xchg + (static_cast<int64_t>(parity) * blk.groups + blk.group) * g.bs * KX;
  };
  // A chunk's copies: lanes 2s and 2s + 1 copy a 32-byte sector of sample s + 16 * (i / SC), sector i %
  // SC (SC sectors a row), in copy i < 8; a lane's copies sit at two offsets from one address, in
  // immediates for every chunk (one address per copy cost registers). Each lane also gives ldmatrix the
  // row of its block (lane / 8: rows + 8, k + 4) in every k-step.
  constexpr int SC = CR / 8;
  float* const lane_ring = ring + (lane / 2) * LDR + 4 * (lane % 2);
  const float* const lane_a = ring + (8 * ((lane / 8) & 1) + lane % 8) * LDR + 4 * (lane / 16);
  // dh_t of the samples running at s_next: this warp's rows of every gate gradient of step s_next,
  // streamed through the ring, times its columns of W; the warps' sums to part_s.
  auto gather = [&](int parity, int s_next) {
    const unsigned run = __ballot_sync(0xffffffffu, lane < bv && s_next < lens[lane]);  // bit b: sample b runs
    const unsigned mine = run >> (lane / 2);  // bit 16 n: sample lane / 2 + 16 n runs
    const float* src = region(parity) + static_cast<int64_t>(lane / 2) * KX + warp * kw + 4 * (lane % 2);
    auto issue = [&](int c) {  // chunk c into buffer c % NB: only the running samples' rows
      if (c < NCH)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int n = i / SC, sc = i % SC;
          if (n < MT && ((mine >> (16 * n)) & 1))
            cp_async16(lane_ring + (c % NB) * BSP * LDR + 16 * n * LDR + 8 * sc, src + 16 * n * KX + c * CR + 8 * sc);
        }
      cp_async_commit();  // empty past the last chunk: the wait below counts groups
    };
    float acc[MT][2][4];  // two sums per m-tile (even and odd k-steps): twice the chains
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[m][e / 4][e % 4] = 0.0f;
#pragma unroll
    for (int c = 0; c < NB - 1; ++c) issue(c);
#pragma unroll
    for (int c = 0; c < NCH; ++c) {
      cp_async_wait<NB - 2>();  // chunk c has landed (this lane's copies)
      __syncwarp();             // every lane's copies, to the whole warp; chunk c - 1's buffer is free
      issue(c + NB - 1);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (((run >> (16 * m)) & 0xffffu) == 0) continue;
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
          const int ks = c * KC + kc;
          uint32_t x[4];
          ldsm_tf32_a(x, lane_a + (c % NB) * BSP * LDR + 16 * m * LDR + 8 * kc);
          mma_tf32(acc[m][ks % 2], x[0], x[1], x[2], x[3], w[ks][0], w[ks][1]);
        }
      }
    }
    // C: samples 16m + gr (+ 8), units 2t and 2t + 1.
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      float* dst = part_s + (warp * BSP + 16 * m + gr) * 8 + 2 * t;
      *reinterpret_cast<float2*>(dst) = make_float2(acc[m][0][0] + acc[m][1][0], acc[m][0][1] + acc[m][1][1]);
      *reinterpret_cast<float2*>(dst + 64) = make_float2(acc[m][0][2] + acc[m][1][2], acc[m][0][3] + acc[m][1][3]);
    }
    __syncthreads();
  };
  auto sum_of = [&](int b, int j) {  // the warps' sums in order: the same bits every run
    float v = 0.0f;
#pragma unroll
    for (int q = 0; q < kWarps; ++q) v += part_s[(q * BSP + b) * 8 + j];
    return v;
  };
  // This block's gate gradients of the samples running at s to the exchange buffer, a float4 of units a
  // thread (the float4 that holds unit H - 1 also writes zeros into the rows' padding; none past it).
  auto products = [&](int cur, int s) {
    float* dst = region(cur);
    const int q4 = hs / 4, per = G * q4;
    for (int e = tid; e < bv * per; e += kThreads) {
      const int b = e / per, r = e - b * per, k = r / q4, q = r - k * q4;
      if (s >= lens[b] || blk.j0 + 4 * q >= H) continue;
      const float4 v = *reinterpret_cast<const float4*>(dg_s + b * ldg + k * hs + 4 * q);
      __stcg(reinterpret_cast<float4*>(dst + static_cast<int64_t>(b) * KX + k * Hp + blk.j0 + 4 * q), v);
    }
  };
  // One (sample, unit) pair a thread: at most 32 samples of 8 units.
  grid_backward_steps<C, 1, true>(a, blk, lens, dg_s, ldg, bar, smax, gather, sum_of, products);
#endif
}

// The function NAME returning KERNEL for a cell and (m-tiles, k): the forward's (1 or 2; k-steps 8, 12 or
// 16), the backward's (1 or 2; pairs of k-steps 16, 24 or 32).
#define VLSEQ_RNN_GRID_TF32_FWD_CASES(KERNEL, CELL)                                    \
  if (mt == 1 && k == 8) return reinterpret_cast<const void*>(&KERNEL<CELL, 1, 8>);   \
  if (mt == 1 && k == 12) return reinterpret_cast<const void*>(&KERNEL<CELL, 1, 12>); \
  if (mt == 1) return reinterpret_cast<const void*>(&KERNEL<CELL, 1, 16>);            \
  if (k == 8) return reinterpret_cast<const void*>(&KERNEL<CELL, 2, 8>);              \
  if (k == 12) return reinterpret_cast<const void*>(&KERNEL<CELL, 2, 12>);            \
  return reinterpret_cast<const void*>(&KERNEL<CELL, 2, 16>);
#define VLSEQ_RNN_GRID_TF32_BWD_CASES(KERNEL, CELL)                                    \
  if (mt == 1 && k == 16) return reinterpret_cast<const void*>(&KERNEL<CELL, 1, 16>); \
  if (mt == 1 && k == 24) return reinterpret_cast<const void*>(&KERNEL<CELL, 1, 24>); \
  if (mt == 1) return reinterpret_cast<const void*>(&KERNEL<CELL, 1, 32>);            \
  if (k == 16) return reinterpret_cast<const void*>(&KERNEL<CELL, 2, 16>);            \
  if (k == 24) return reinterpret_cast<const void*>(&KERNEL<CELL, 2, 24>);            \
  return reinterpret_cast<const void*>(&KERNEL<CELL, 2, 32>);
#define VLSEQ_RNN_GRID_TF32_TABLE(NAME, KERNEL, CASES) \
  const void* NAME(Cell c, int mt, int k) {            \
    if (c == Cell::kLSTM) { CASES(KERNEL, Cell::kLSTM) } \
    CASES(KERNEL, Cell::kGRU)                          \
  }

#endif  // __CUDACC__

}  // namespace vlseq::rnn
