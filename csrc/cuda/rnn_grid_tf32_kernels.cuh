// The grid layout's TF32 kernels (weights "tf32": cuDNN's allow_tf32 mode): the recurrent products on
// the tensor cores, mma.sync m16n8k8 with W_hh in registers (rounded to TF32 once) as one operand, and h
// (forward) or the gate gradients (backward) rounded to TF32 where the cells write them as the other;
// sums and state stay fp32. The cells and the barrier are the fp32 grid kernels' (rnn_grid_kernels.cuh:
// grid_forward_steps, grid_backward_steps); the forward's exchange too (it all-gathers h), while the
// backward splits its product two ways (row groups and columns of blocks, below) where the fp32 kernels
// send every unit's partial sums to its owner. The fp32 register kernels' products took ~16 K clocks a
// step each way at LSTM 1024 x 32 (twice the FMAs' issue time: shuffles, selects, bookkeeping); these
// take ~1 K of MMAs, so the step is left with the exchange.
//
// The forward permutes k (the k order inside an MMA is free: the sum is the same set of products) to let
// one float4 load give a lane its B operands of two k-steps: in the pair of k-steps p (16 columns, c0 ..
// c0 + 15), lane (g = lane / 4, t = lane % 4) holds slots t and t + 4 of k-step 2p as c0 + 4t and c0 +
// 4t + 1, and of k-step 2p + 1 as c0 + 4t + 2 and + 3: its operands are the float4 at c0 + 4t of its
// sample's h. The backward's A fragments come whole from ldmatrix, in k's own order.
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

// The backward splits the product dh = W_hh^T g two ways. Blocks form row groups of kTf32RowGroup = Q
// consecutive blocks (p = rank / Q) and columns (q = rank % Q). Block (p, q) multiplies the gate
// gradients of its row group's units (G * Q * 8 rows, all-gathered within the row group) by W_hh's
// columns of the units its column owns (P = ceil(nc / Q) owners of 8), and sends each owner its partial
// sums, which the owner sums over the P row groups. A block then moves ~70 KB a step at LSTM 1024 x 32
// (P = 16): 4 KB of gate gradients out, 32 KB in, 16 KB of partials out and 16 KB in, where sending
// partials for all H units moved 256 KB (BENCHMARKS.md: 7.5 K clocks to write them, 2.7 K for their
// wait at the barrier, 7.8 K to gather them, of a 22.6 K step) and all-gathering every gate gradient
// 512 KB (L2-bound: the gather alone took 30 K clocks), at the price of a second barrier a step, within
// the row group. MMAs: M = the samples (two m-tiles: at most 32 a group), N = owners (an n-tile of 8
// units each: hs = 8; ntw of them a warp, warp w owners w + 8n), K = the row group's rows; W_hh in
// registers as the B fragments, the gate gradients as A fragments from shared memory (ldmatrix). Every
// (row group, column) pair needs its block, so nc is a multiple of Q (the planner rounds it up: blocks
// past H hold no units). Its step costs ~9.9 K clocks + ~0.2 K a sample at LSTM 1024 on 128 blocks,
// the fp32 register backward's ~5.9 K + ~0.7 K (BENCHMARKS.md, fourteenth session): it runs from 8
// samples a group on.
constexpr int kTf32RowGroup = 8, kTf32BwdMinSamples = 8;
struct GridTf32BwdShape {
  int ntw = 0, P = 0, rows = 0;  // ntw = 0: no kernel fits
  __host__ __device__ GridTf32BwdShape(int G, int hs, int nc, int bs) {
    const int P_ = nc / kTf32RowGroup, n = ceil_div(P_, kWarps);
    if (hs != 8 || nc % kTf32RowGroup != 0 || bs < kTf32BwdMinSamples || bs > 32 || n > 2) return;
    ntw = n, P = P_, rows = G * kTf32RowGroup * hs;
  }
};
// Its shared memory: the owner's (dg: the cells' gate gradients, red: sums, stage: the gathered
// partials of P sources, lens), then the row group's gate gradients ([32][rows + 4]: the 16-byte
// padding puts an ldmatrix block's 8 rows on distinct banks).
struct GridTf32BwdSmem {
  GridOwnedSmem own;
  int gg, total;
  __host__ __device__ GridTf32BwdSmem(const Geometry& g, int G, const GridTf32BwdShape& sh)
      : own(g, g.bs, G * g.hs, sh.P) {
    gg = own.total;
    total = gg + 32 * (sh.rows + 4) * 4;
  }
};
// Its exchange buffer (zeroed: the rows of units past H are read, never written), in floats:
// the owners' partials (owned_region, nsrc = P), then the row groups' gate gradients, [parity][group][p]
// [bs][rows]; and its barriers' counters, [group][P rows, then Q columns].
inline int64_t grid_tf32_exchange(const Geometry& g, int groups, const GridTf32BwdShape& sh) {
  return grid_owned_exchange(g, groups, sh.P) + 2 * static_cast<int64_t>(groups) * sh.P * g.bs * sh.rows;
}
inline int grid_tf32_counters(int groups, const GridTf32BwdShape& sh) { return groups * (sh.P + kTf32RowGroup); }

// The forward with W_hh in 16 bits (rnn_forward_grid_half_kernel), for weights "tf32" on a layout of its
// own: W_hh held in fp16 with a power-of-2 scale per row, h exchanged in fp16, the products m16n8k16 fp16
// MMAs summed in fp32. fp16 keeps TF32's 11 significant bits; the row's scale puts its largest weight in
// fp16's top binade, so only weights below 2^-29 of it lose bits (to an absolute error under 2^-40 of
// it), and h (|h| < 1) loses bits only below 2^-14, by at most 2^-25, TF32's own rounding there. Half the
// bytes a weight: a block holds 64 rows (LSTM 1024 on 64 blocks, half the GPU, 128 KB a block in 128
// registers a thread, as the TF32 forward's 32 rows), and half the bytes of h to stage a step, which
// bounds the grid forward's exchange (each SM's intake: BENCHMARKS.md, twelfth session).
// Warp w multiplies all mt m-tiles of 16 rows by columns w * 16 * ks .. (ks k16-steps: 6 or 8, kq = 128 *
// ks in all, at most a quarter of them padding); the warps' sums meet in shared memory.
constexpr int kMmaK16 = 16;  // k of an m16n8k16 MMA
struct GridHalfFwdShape {
  int mt = 0, ks = 0, kq = 0;  // ks = 0: no kernel fits
  __host__ __device__ GridHalfFwdShape(int G, int H, int hs) {
    const int Kp = round_up(H, 8), m = ceil_div(G * hs, 16);
    if (m < 3 || m > 4) return;
    for (int k = 6; k <= 8; k += 2)
      if (kWarps * kMmaK16 * k >= Kp && 4 * kWarps * kMmaK16 * k <= 5 * Kp) {
        mt = m, ks = k, kq = kWarps * kMmaK16 * k;
        return;
      }
  }
};
// Its shared memory: h_{t-1} in fp16 ([b][ldh], ldh = kq + 32 halves: the two samples of a quarter warp's
// 16-byte loads then fall on distinct banks), the warps' sums ([warp][b][ldp], as the TF32 forward's),
// the rows' scales, the lengths.
struct GridHalfFwdSmem {
  int ldh, ldp, h, part, scale, lens, total;
  __host__ __device__ GridHalfFwdSmem(const Geometry& g, const GridHalfFwdShape& sh) {
    const int bsp = round_up(g.bs, 8);
    ldh = sh.kq + 32, ldp = 16 * sh.mt + 4;
    int off = 0;
    h = off, off += round_up(bsp * ldh * 2, 16);
    part = off, off += round_up(kWarps * bsp * ldp * 4, 16);
    scale = off, off += 16 * sh.mt * 4;
    lens = off, off += round_up(g.bs * 4, 16);
    total = off;
  }
};
// Its exchange, in floats: [2][groups][bs][round_up(H, 8)] halves.
inline int64_t grid_half_exchange(const Geometry& g, int groups) {
  return static_cast<int64_t>(groups) * g.bs * round_up(g.H, 8);
}

// The kernels for a cell and shape: rnn_grid_forward_tf32.cu, rnn_grid_backward_tf32.cu.
const void* grid_forward_tf32_kernel(Cell c, int mt, int ks);
const void* grid_backward_tf32_kernel(Cell c, int ntw);
const void* grid_forward_half_kernel(Cell c, int mt, int ks);  // rnn_grid_forward_half.cu

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

// d += a * b in fp16 (m16n8k16, fp32 sums): a the 16 x 16 A (a0, a1: slots 2t, 2t + 1 of rows g, g + 8;
// a2, a3: slots 2t + 8, 2t + 9), b its 16 x 8 B (b0: slots 2t, 2t + 1 of column g; b1: 2t + 8, 2t + 9),
// each register two halves, the lower slot in the low half; d as mma_tf32's.
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t half2_bits(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Whether any of samples n0 .. n0 + 7 runs at step s (the same answer in every lane).
__device__ __forceinline__ bool tile_runs(const int* lens, int n0, int bv, int s) {
  const int lane = threadIdx.x % 32;
  return __any_sync(0xffffffffu, lane < 8 && n0 + lane < bv && s < lens[n0 + lane]);
}

// The forwards' staging of h_{t-1}: the rows (`row` elements apart at `in`, `chunks` 16-byte chunks each) of
// the samples running at s to h_s (rows ldh apart), each tile of 8 samples its own cp.async group, a warp per
// sample: tile n's MMAs (after wait_staged) run while the later tiles' rows arrive.
template <typename T>
__device__ __forceinline__ void stage_tiles(const T* in, int row, int chunks, T* h_s, int ldh, const int* lens, int bv,
                                            int s, int tiles) {
  constexpr int E = 16 / sizeof(T);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int n = 0; n < tiles; ++n) {
    const int b = 8 * n + warp;
    if (b < bv && s < lens[b]) {
      const T* src = in + static_cast<int64_t>(b) * row;
      for (int k = lane; k < chunks; k += 32) cp_async16(h_s + b * ldh + E * k, src + E * k);
    }
    cp_async_commit();
  }
}

template <Cell C, int MT, int KS>
__global__ void __launch_bounds__(kThreads, 1) rnn_forward_grid_tf32_kernel(const ForwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(kWarps == 8 && KS % 2 == 0, "a warp stages one sample of each tile of 8; k-steps in pairs");
  constexpr int G = C == Cell::kLSTM ? 4 : 3, KW = kMmaK * KS;  // KW: the warp's columns
  const Geometry& g = a.g;
  const int H = g.H, hs = g.hs, Kp = round_up(H, 4);
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
      const float* src = block_row(a.w_hh, G, g, blk, 16 * m + gr + 8 * half);
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = warp * KW + 16 * (ks / 2) + 4 * t + 2 * (ks % 2) + e;
          v[half][ks][e] = src && c < H ? src[c] : 0.0f;
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
    stage_tiles(in, Kp, Kp / 4, h_s, ldh, lens, bv, s, tiles);
    VLSEQ_MARK(0, 1, s);
    for (int n = 0; n < tiles; ++n) {
      wait_staged(n, tiles);
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

// The forward with W_hh in 16 bits (GridHalfFwdShape). k is permuted as in the TF32 forward, by pairs of
// k16-steps (32 columns from c0): lane (g, t) holds slots 2t, 2t + 1, 2t + 8, 2t + 9 of k16-step 2p as
// columns c0 + 8t .. c0 + 8t + 3 and those of k16-step 2p + 1 as c0 + 8t + 4 .. + 7, so one 16-byte load
// of its sample's h gives it the B operands of both.
template <Cell C, int MT, int KS>
__global__ void __launch_bounds__(kThreads, 1) rnn_forward_grid_half_kernel(const ForwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(kWarps == 8 && KS % 2 == 0, "a warp stages one sample of each tile of 8; k16-steps in pairs");
  constexpr int G = C == Cell::kLSTM ? 4 : 3, KW = kMmaK16 * KS, ROWS = 16 * MT;  // KW: the warp's columns
  const Geometry& g = a.g;
  const int H = g.H, hs = g.hs, Kx = round_up(H, 8);
  const Block blk(g);
  const int bv = blk.bv, tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gr = lane / 4, t = lane % 4;
  const int bsp = round_up(g.bs, 8), tiles = ceil_div(bv, 8);

  extern __shared__ __align__(16) unsigned char smem[];
  const GridHalfFwdSmem lay(g, GridHalfFwdShape(G, H, hs));
  const int ldh = lay.ldh, ldp = lay.ldp;
  __half* h_s = reinterpret_cast<__half*>(smem + lay.h);
  float* part_s = reinterpret_cast<float*>(smem + lay.part);
  float* scale_s = reinterpret_cast<float*>(smem + lay.scale);
  int* lens = reinterpret_cast<int*>(smem + lay.lens);

  // Row r's scale: 2^(e - 15) for its largest |w| = m 2^e, m in [0.5, 1) (1 for a row of zeros or a
  // padding row, or of an infinity: that stays infinite).
  for (int r = warp; r < ROWS; r += kWarps) {
    const float* src = block_row(a.w_hh, G, g, blk, r);
    float m = 0.0f;
    if (src)
      for (int c = lane; c < H; c += 32) m = fmaxf(m, fabsf(src[c]));
#pragma unroll
    for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    int e = 0;
    frexpf(m, &e);
    if (lane == 0) scale_s[r] = m > 0.0f && isfinite(m) ? ldexpf(1.0f, max(e - 15, -126)) : 1.0f;  // a normal float
  }
  __syncthreads();
  // A fragments: w[m][k][i] of rows 16m + gr (+ 8), k16-step k of this warp's columns (permuted as above),
  // the weights divided by their row's scale (exactly: a power of 2) and rounded to fp16.
  uint32_t w[MT][KS][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = 16 * m + gr + 8 * half;
      const float* src = block_row(a.w_hh, G, g, blk, row);
      const float inv = 1.0f / scale_s[row];
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const int c = warp * KW + 32 * (ks / 2) + 8 * t + 4 * (ks % 2);
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = src && c + e < H ? src[c + e] * inv : 0.0f;
        w[m][ks][half] = half2_bits(v[0], v[1]), w[m][ks][2 + half] = half2_bits(v[2], v[3]);
      }
    }
  load_lengths(lens, a.lengths, g, blk);
  for (int e = tid; e < bsp * ldh; e += kThreads) h_s[e] = __float2half_rn(0.0f);  // padding stays 0
  GroupBarrier bar{Sync::kGrid, a.arrivals + blk.group, static_cast<unsigned>(g.nc), 0u};

  auto products = [&](int s, const __half* in) {
    stage_tiles(in, Kx, Kx / 8, h_s, ldh, lens, bv, s, tiles);
    VLSEQ_MARK(0, 1, s);
    for (int n = 0; n < tiles; ++n) {
      wait_staged(n, tiles);
      if (!tile_runs(lens, 8 * n, bv, s)) continue;
      float acc[MT][4];  // one chain of MMAs per m-tile: 3-4 chains a warp, two warps a scheduler
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[m][e] = 0.0f;
      const __half* hb = h_s + (8 * n + gr) * ldh + warp * KW + 8 * t;
#pragma unroll
      for (int p = 0; p < KS / 2; ++p) {
        const uint4 x = *reinterpret_cast<const uint4*>(hb + 32 * p);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          mma_f16(acc[m], w[m][2 * p], x.x, x.y);
          mma_f16(acc[m], w[m][2 * p + 1], x.z, x.w);
        }
      }
      // C: rows 16m + gr (+ 8), samples 8n + 2t (+ 1); this warp's sums of them to part_s.
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          part_s[(warp * bsp + 8 * n + 2 * t + (e & 1)) * ldp + 16 * m + gr + 8 * (e / 2)] = acc[m][e];
    }
    VLSEQ_MARK(0, 2, s);
    __syncthreads();
  };
  grid_forward_steps<C, kGridRegItems, false, __half>(a, blk, lens, bar, products, [&](int b, int k, int j) {
    float v = 0.0f;
#pragma unroll
    for (int q = 0; q < kWarps; ++q) v += part_s[(q * bsp + b) * ldp + k * hs + j];
    return v * scale_s[k * hs + j];
  });
#endif
}

template <Cell C, int NTW>
__global__ void __launch_bounds__(kThreads, 1) rnn_backward_grid_tf32_kernel(const BackwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int G = C == Cell::kLSTM ? 4 : 3, Q = kTf32RowGroup, ROWS = G * Q * 8, KS = ROWS / 8, LDR = ROWS + 4;
  const Geometry& g = a.g;
  const int H = g.H, ldg = G * 8;
  const GridTf32BwdShape sh(G, 8, g.nc, g.bs);
  const int P = sh.P;
  const Block blk(g);
  const int bv = blk.bv, tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gr = lane / 4, t = lane % 4;
  const int p = blk.rank / Q, q = blk.rank % Q;  // row group, column (nc = P * Q)

  extern __shared__ __align__(16) unsigned char smem[];
  const GridTf32BwdSmem lay(g, G, sh);
  float* dg_s = reinterpret_cast<float*>(smem + lay.own.dg);  // [b][ldg]: gate k of unit j at k * 8 + j
  float4* red_s = reinterpret_cast<float4*>(smem + lay.own.red);
  float4* stage_s = reinterpret_cast<float4*>(smem + lay.own.stage);
  int* lens = reinterpret_cast<int*>(smem + lay.own.lens);
  float* gg_s = reinterpret_cast<float*>(smem + lay.gg);  // [b][LDR]: row k * Q * 8 + member * 8 + j

  // B fragments: w[n][ks][i] = W_hh[row][unit] for the row group's row 8 ks + t + 4i (gate k, unit p * Q
  // * 8 + u) and unit 8 o + gr of owner o = (warp + 8n) * Q + q (zero past H or nc).
  uint32_t w[NTW][KS][2];
#pragma unroll
  for (int n = 0; n < NTW; ++n) {
    const int owner = (warp + kWarps * n) * Q + q, col = 8 * owner + gr;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = 8 * ks + t + 4 * i, k = r / (Q * 8), unit = p * Q * 8 + r % (Q * 8);
        const bool real = owner < g.nc && col < H && unit < H;
        w[n][ks][i] = tf32_bits(real ? a.w_hh[static_cast<int64_t>(k * H + unit) * H + col] : 0.0f);
      }
  }
  for (int e = tid; e < g.bs * ldg; e += kThreads) dg_s[e] = 0.0f;
  load_lengths(lens, a.lengths, g, blk);
  unsigned* counters = a.arrivals + blk.group * (P + Q);
  GroupBarrier row_bar{Sync::kGrid, counters + p, static_cast<unsigned>(Q), 0u};
  GroupBarrier bar{Sync::kGrid, counters + P + q, static_cast<unsigned>(P), 0u};
  const int smax = finish_setup(bar, lens, g.bs);

  float* const gg_base = a.xchg + grid_owned_exchange(g, blk.groups, P);
  auto row_group = [&](int parity) {  // this row group's gate gradients at a step of that parity
    return gg_base + ((static_cast<int64_t>(parity) * blk.groups + blk.group) * P + p) * g.bs * ROWS;
  };
  auto gather = [&](int parity, int s_next) {
    gather_owned_partials(owned_region(a, blk, parity, blk.rank, P), lens, s_next, bv, P, g, stage_s, red_s);
  };
  auto sum_of = [&](int b, int j) { return reinterpret_cast<const float*>(red_s)[b * 8 + j]; };
  // Lanes 8j .. 8j + 7 give ldmatrix the rows of block j (rows + 8, k + 4) in every k-step.
  const float* const lane_a = gg_s + (8 * ((lane / 8) & 1) + lane % 8) * LDR + 4 * (lane / 16);
  auto products = [&](int cur, int s) {
    // This block's gate gradients of the samples running at s to its row group, a float4 a thread.
    float* rg = row_group(cur);
    for (int e = tid; e < bv * 2 * G; e += kThreads) {
      const int b = e / (2 * G), r = e - b * 2 * G, k = r / 2, h = r - 2 * k;
      if (s >= lens[b] || blk.j0 + 4 * h >= H) continue;
      __stcg(reinterpret_cast<float4*>(rg + b * ROWS + k * Q * 8 + q * 8 + 4 * h),
             *reinterpret_cast<const float4*>(dg_s + b * ldg + k * 8 + 4 * h));
    }
    row_bar.arrive();
    row_bar.wait();
    // The row group's, staged (only the running samples' rows: the others' products are not read).
    for (int e = tid; e < bv * (ROWS / 4); e += kThreads) {
      const int b = e / (ROWS / 4), c4 = e - b * (ROWS / 4);
      if (s < lens[b]) cp_async16(gg_s + b * LDR + 4 * c4, rg + b * ROWS + 4 * c4);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    const unsigned run = __ballot_sync(0xffffffffu, lane < bv && s < lens[lane]);  // bit b: sample b runs
    float acc[2][NTW][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int n = 0; n < NTW; ++n) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks)
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        if (((run >> (16 * m)) & 0xffffu) == 0) continue;
        uint32_t x[4];
        ldsm_tf32_a(x, lane_a + 16 * m * LDR + 8 * ks);
#pragma unroll
        for (int n = 0; n < NTW; ++n) mma_tf32(acc[m][n], x[0], x[1], x[2], x[3], w[n][ks][0], w[n][ks][1]);
      }
    // C: samples 16m + gr (+ 8), units 2t and 2t + 1 of owner n's 8: to its region, source p (lanes t
    // fill a 32-byte sector).
#pragma unroll
    for (int n = 0; n < NTW; ++n) {
      const int owner = (warp + kWarps * n) * Q + q;
      if (owner >= g.nc) continue;
      float* region = owned_region(a, blk, cur, owner, P) + p * 8 + 2 * t;
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int b = 16 * m + gr + 8 * h;
          if (b < bv && s < lens[b])
            __stcg(reinterpret_cast<float2*>(region + static_cast<int64_t>(b) * P * 8),
                   make_float2(acc[m][n][2 * h], acc[m][n][2 * h + 1]));
        }
    }
  };
  // One (sample, unit) pair a thread: at most 32 samples of 8 units.
  grid_backward_steps<C, 1, true>(a, blk, lens, dg_s, ldg, bar, smax, gather, sum_of, products);
#endif
}

// The forward's kernel for a cell and (m-tiles, k-steps): 1 or 2; 8, 12 or 16.
#define VLSEQ_RNN_GRID_TF32_FWD_TABLE(NAME, KERNEL)                                              \
  const void* NAME(Cell c, int mt, int k) {                                                      \
    if (c == Cell::kLSTM) { VLSEQ_RNN_GRID_TF32_FWD_CASES(KERNEL, Cell::kLSTM) }                 \
    VLSEQ_RNN_GRID_TF32_FWD_CASES(KERNEL, Cell::kGRU)                                            \
  }
#define VLSEQ_RNN_GRID_TF32_FWD_CASES(KERNEL, CELL)                                    \
  if (mt == 1 && k == 8) return reinterpret_cast<const void*>(&KERNEL<CELL, 1, 8>);   \
  if (mt == 1 && k == 12) return reinterpret_cast<const void*>(&KERNEL<CELL, 1, 12>); \
  if (mt == 1) return reinterpret_cast<const void*>(&KERNEL<CELL, 1, 16>);            \
  if (k == 8) return reinterpret_cast<const void*>(&KERNEL<CELL, 2, 8>);              \
  if (k == 12) return reinterpret_cast<const void*>(&KERNEL<CELL, 2, 12>);            \
  return reinterpret_cast<const void*>(&KERNEL<CELL, 2, 16>);
// The 16-bit forward's for a cell and (m-tiles, k16-steps): 3 or 4; 6 or 8.
#define VLSEQ_RNN_GRID_HALF_FWD_TABLE(NAME, KERNEL)                                    \
  const void* NAME(Cell c, int mt, int k) {                                            \
    if (c == Cell::kLSTM) { VLSEQ_RNN_GRID_HALF_FWD_CASES(KERNEL, Cell::kLSTM) }       \
    VLSEQ_RNN_GRID_HALF_FWD_CASES(KERNEL, Cell::kGRU)                                  \
  }
#define VLSEQ_RNN_GRID_HALF_FWD_CASES(KERNEL, CELL)                                  \
  if (mt == 3 && k == 6) return reinterpret_cast<const void*>(&KERNEL<CELL, 3, 6>); \
  if (mt == 3) return reinterpret_cast<const void*>(&KERNEL<CELL, 3, 8>);           \
  if (k == 6) return reinterpret_cast<const void*>(&KERNEL<CELL, 4, 6>);            \
  return reinterpret_cast<const void*>(&KERNEL<CELL, 4, 8>);
// The backward's for a cell and owners a warp (1 or 2).
#define VLSEQ_RNN_GRID_TF32_BWD_TABLE(NAME, KERNEL)                                               \
  const void* NAME(Cell c, int ntw) {                                                             \
    if (c == Cell::kLSTM) return ntw == 1 ? reinterpret_cast<const void*>(&KERNEL<Cell::kLSTM, 1>) \
                                          : reinterpret_cast<const void*>(&KERNEL<Cell::kLSTM, 2>); \
    return ntw == 1 ? reinterpret_cast<const void*>(&KERNEL<Cell::kGRU, 1>)                        \
                    : reinterpret_cast<const void*>(&KERNEL<Cell::kGRU, 2>);                       \
  }

#endif  // __CUDACC__

}  // namespace vlseq::rnn
