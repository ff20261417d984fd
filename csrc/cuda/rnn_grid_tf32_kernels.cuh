// The grid layout's kernels for weights "tf32" (cuDNN's allow_tf32 mode), products on the tensor cores:
// the TF32 forward (mma.sync m16n8k8 with W_hh in registers, rounded to TF32 once, as one operand and h
// rounded to TF32 where the cells write it as the other), and the forward and the backward with W_hh in 16
// bits (fp16 m16n8k16 MMAs: W_hh, and h or the gate gradients, with power-of-2 scales; below). Sums and
// state stay fp32. The cells and the barrier are the fp32 grid kernels' (rnn_grid_kernels.cuh:
// grid_forward_steps, grid_backward_steps). The fp32 register kernels' products took ~16 K clocks a step
// each way at LSTM 1024 x 32 (twice the FMAs' issue time: shuffles, selects, bookkeeping); these take ~1 K
// of MMAs, so the step is left with the exchange.
//
// The TF32 forward permutes k (the k order inside an MMA is free: the sum is the same set of products) to
// let one float4 load give a lane its B operands of two k-steps: in the pair of k-steps p (16 columns, c0
// .. c0 + 15), lane (g = lane / 4, t = lane % 4) holds slots t and t + 4 of k-step 2p as c0 + 4t and c0 +
// 4t + 1, and of k-step 2p + 1 as c0 + 4t + 2 and + 3: its operands are the float4 at c0 + 4t of its
// sample's h.
//
// A TF32 backward (the product split two ways over row groups and columns of blocks, two barriers a step)
// ran until the twenty-sixth session; the 16-bit backward's step measured 30-32% shorter at every batch it
// ran (BENCHMARKS.md), so it went (git history: rnn_backward_grid_tf32_kernel).
#pragma once

#include <type_traits>

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
// the rows' scales, the lengths; tagged: the block's new h in fp16 ([b][round_up(hs, 4)], for its lines).
struct GridHalfFwdSmem {
  int ldh, ldp, h, part, scale, lens, hx, total;
  __host__ __device__ GridHalfFwdSmem(const Geometry& g, const GridHalfFwdShape& sh, bool tagged) {
    const int bsp = round_up(g.bs, 8);
    ldh = sh.kq + 32, ldp = 16 * sh.mt + 4;
    int off = 0;
    h = off, off += round_up(bsp * ldh * 2, 16);
    part = off, off += round_up(kWarps * bsp * ldp * 4, 16);
    scale = off, off += 16 * sh.mt * 4;
    lens = off, off += round_up(g.bs * 4, 16);
    hx = off, off += tagged ? round_up(g.bs * round_up(g.hs, 4) * 2, 16) : 0;
    total = off;
  }
};
// Its exchange of h without a barrier a step (TaggedLines, rnn_grid_kernels.cuh): per step, one trip through
// L2 where the barrier takes three, but each line carries 8 bytes of h in 16 and every block polls every
// line of its group, so its cost grows with the lines polled a step, nc * nc * bs * ceil(hs / 4). LSTM 1024
// on 64 blocks (one H100): 3,352 / 3,674 / 4,065 / 4,438 / 13,485 clocks a step at 1 / 2 / 3 / 4 / 8 samples
// a group (16K-131K lines), against 4,990-5,269 with the barrier; LSTM 1001 at 3 samples on 112 blocks
// (113K lines) 16,876 against 5,055 (BENCHMARKS.md, thirty-third and thirty-fourth sessions). So it is
// taken only where it measured faster: up to 4 samples, 64 blocks and 64K lines.
constexpr int kHalfFwdTaggedMaxSamples = 4, kHalfFwdTaggedMaxBlocks = 64;
constexpr int64_t kHalfFwdTaggedMaxLines = 65536;
// The lines a group polls a step where each of its nc blocks polls, for each of bs samples, ceil(hs / 4) lines
// from every block (the tagged forward's h, the reduce-scatter backward's partial dh below).
inline int64_t tagged_lines_polled(int nc, int hs, int bs) {
  return static_cast<int64_t>(nc) * nc * bs * ceil_div(hs, 4);
}
inline bool half_forward_tagged(int nc, int hs, int bs) {
  return bs <= kHalfFwdTaggedMaxSamples && nc <= kHalfFwdTaggedMaxBlocks &&
         tagged_lines_polled(nc, hs, bs) <= kHalfFwdTaggedMaxLines;
}
// Its exchange, in floats: [2][groups][bs][round_up(H, 8)] halves; tagged, the lines
// [2][groups][bs][nc][ceil(hs / 4)] of 4 floats' bytes each (4 fp16 h and two tags).
inline int64_t grid_half_exchange(const Geometry& g, int groups, bool tagged) {
  return tagged ? 2 * static_cast<int64_t>(groups) * g.bs * g.nc * round_up(g.hs, 4)
                : static_cast<int64_t>(groups) * g.bs * round_up(g.H, 8);
}

// The backward with W_hh and the gate gradients in 16 bits (rnn_backward_grid_half_kernel), for weights
// "tf32" on a layout of its own: 16 units a block (LSTM 1024 on 64 blocks: two groups of 16 samples side by
// side at 32). Each block all-gathers every gate gradient of its group's running samples in fp16 (128 KB a
// step at 16 samples of LSTM 1024) and multiplies them by its units' columns of W_hh, held in fp16 with a
// power-of-2 scale per column (as the 16-bit forward's rows): one exchange and one barrier a step, where the
// TF32 backward's two-way split has two of each and sums partials from 16 sources after the second.
// - The gate gradients have no bound (|h| < 1 bounded the forward's exchange): a block publishes each
//   sample's G * 16 of them with a power-of-2 scale of their own that puts the largest in fp16's top binade,
//   so one loses bits only below 2^-29 of the largest of its block and sample (TF32 keeps the same 11
//   significant bits, with no such floor).
// - MMAs m16n8k16: M the block's 16 units (W_hh^T rows, A in registers), N the samples (tiles of 8), K the
//   group's gate gradients, [source block][gate][unit]: a k16-step is one gate of one source block, so each
//   source block's products sum on their own and enter the warp's total times its scale. Warp w takes
//   source blocks w * sb .. w * sb + sb - 1 (nc = 8 sb: LSTM 1024 on 64, 32 k16-steps a warp in 128
//   registers) and stages only their rows, in cp.async groups of two source blocks: no block barrier for
//   the staging, and the MMAs of one group run while the next arrive. The warps' sums meet in shared memory.
// - k is permuted inside a k16-step so that one 8-byte load gives a lane its B operands: lane (g, t) holds
//   slots 2t, 2t + 1, 2t + 8, 2t + 9 as rows 4t .. 4t + 3 of its sample's gate gradients.
constexpr int kHalfBwdUnits = 16, kHalfBwdMaxSamples = 16;
struct GridHalfBwdShape {
  int sb = 0;  // source blocks a warp (4, 6 or 8: the kernels built); 0: no kernel fits
  __host__ __device__ GridHalfBwdShape(int hs, int nc, int bs) {
    const int n = nc / kWarps;
    if (hs == kHalfBwdUnits && nc % kWarps == 0 && bs <= kHalfBwdMaxSamples && (n == 4 || n == 6 || n == 8)) sb = n;
  }
};
// Its blocks: 16 units each, rounded up to 32, 48 or 64 (the kernels built; the blocks past H hold none); 0
// past hidden 1024.
inline int grid_half_backward_blocks(int H) {
  const int n = ceil_div(H, kHalfBwdUnits);
  return n <= 32 ? 32 : n <= 48 ? 48 : n <= 64 ? 64 : 0;
}
// Its shared memory: the group's gate gradients in fp16 ([b][ldk], ldk = K + 16 halves: the 4 samples of a
// half warp's 8-byte loads fall on distinct banks), their scales ([b][warp * 8 + i]: source block warp * sb
// + i), the warps' sums ([warp][b][ldp], as the forwards'), the columns' scales, the cells' gate gradients
// ([b][G * 16]), the lengths.
struct GridHalfBwdSmem {
  int ldk, ldp, gg, gscale, part, wscale, dg, lens, total;
  __host__ __device__ GridHalfBwdSmem(const Geometry& g, int G) {
    const int bsp = round_up(g.bs, 8), K = g.nc * G * kHalfBwdUnits;
    ldk = K + 16, ldp = kHalfBwdUnits + 4;
    int off = 0;
    gg = off, off += round_up(bsp * ldk * 2, 16);
    gscale = off, off += bsp * 8 * kWarps * 4;
    part = off, off += kWarps * bsp * ldp * 4;
    wscale = off, off += kHalfBwdUnits * 4;
    dg = off, off += round_up(g.bs * G * kHalfBwdUnits * 4, 16);
    lens = off, off += round_up(g.bs * 4, 16);
    total = off;
  }
};
// Its exchange, in floats: the gate gradients, [2][groups][bs][K] halves, then their scales, [2][groups][bs]
// [8 * kWarps].
inline int64_t grid_half_backward_exchange(const Geometry& g, int G, int groups) {
  const int64_t rows = 2 * static_cast<int64_t>(groups) * g.bs;
  return rows * g.nc * G * kHalfBwdUnits / 2 + rows * 8 * kWarps;
}

// The 16-bit backward by reduce-scatter in tagged lines (rnn_backward_grid_half_scatter_kernel), for a few samples
// a group on the same blocks (16 units each, nc = 8 sb): no all-gather and no barrier a step. Each block multiplies
// its own G * 16 gate gradients of a sample by its rows of W_hh (held as the 16-bit forward holds them: fp16, a
// power-of-2 scale per row, folded into the gate gradients), which gives a partial dh for every unit, and sends
// each owner block its 16 units' partials in fp32 as 4 lines of 16 bytes; an owner polls the nc * 4 lines of each
// sample and sums the sources' partials in a fixed order. Each 4-byte word of a line carries its own step tag in
// its 2 low mantissa bits (a relative change under 2^-21, far below the fp16 products' rounding): a 4-byte
// access is single-copy atomic, so a word whose tag matches holds that step's value. The all-gather
// backward's step at one sample (LSTM 1024, 64 blocks) was staging + MMAs 2,625 clocks and the barrier's arrive
// and wait ~1,950 of 5,950; its gate gradients in tagged lines measured slower (69,632 lines polled a step,
// BENCHMARKS.md, thirty-fourth session). Here a step polls nc * nc * 4 lines a sample, 16,384 at LSTM 1024:
// what the 16-bit forward polls at one sample (its poll phase ~1,000 clocks). Measured on one H100 (LSTM 1024,
// 64 blocks a group): 4,281 / 4,731 / 5,291 clocks a step at 1 / 2 / 4 samples a group, against the all-gather's
// 5,947 / 5,954 / 6,196 (BENCHMARKS.md, thirty-fifth session).
constexpr int kHalfScatterMaxSamples = 4;
constexpr int64_t kHalfScatterMaxLines = 65536;
inline bool half_backward_scatter(int nc, int bs) {
  return bs <= kHalfScatterMaxSamples && tagged_lines_polled(nc, kHalfBwdUnits, bs) <= kHalfScatterMaxLines;
}
// Its exchange, in floats: the lines [2][groups][nc owners][bs][nc sources][4] of 4 floats' bytes each.
inline int64_t grid_half_scatter_exchange(const Geometry& g, int groups) {
  return 2 * static_cast<int64_t>(groups) * g.nc * g.bs * g.nc * (kHalfBwdUnits / 4) * 4;
}
// Its shared memory: the step's gate gradients in fp16, scaled ([b][ldg], ldg = G * 16 + 16 halves: a half warp's
// 8-byte loads of 4 samples then fall on distinct banks; 8 rows, the MMAs' N), their scales ([8]), the warps' sums
// of the polled partials ([warp][b][16]; in the set-up, the rows' largest weights, [warp][G * 16]), the rows'
// scales, the cells' gate gradients ([b][G * 16]), the lengths.
struct GridHalfScatterSmem {
  int ldg, gg, gscale, part, wscale, dg, lens, total;
  __host__ __device__ GridHalfScatterSmem(const Geometry& g, int G) {
    const int R = G * kHalfBwdUnits;
    ldg = R + 16;
    int off = 0;
    gg = off, off += round_up(8 * ldg * 2, 16);
    gscale = off, off += 8 * 4;
    part = off, off += kWarps * (g.bs * kHalfBwdUnits > R ? g.bs * kHalfBwdUnits : R) * 4;
    wscale = off, off += R * 4;
    dg = off, off += round_up(g.bs * R * 4, 16);
    lens = off, off += round_up(g.bs * 4, 16);
    total = off;
  }
};

// The kernels for a cell and shape, each in a translation unit of its own.
const void* grid_forward_tf32_kernel(Cell c, int mt, int ks);   // rnn_grid_forward_tf32.cu
const void* grid_forward_half_kernel(Cell c, int mt, int ks, bool tagged);  // rnn_grid_forward_half.cu
const void* grid_backward_half_kernel(Cell c, int sb);          // rnn_grid_backward_half.cu
const void* grid_backward_half_scatter_kernel(Cell c, int sb);  // rnn_grid_backward_half_scatter.cu

#if defined(__CUDACC__)

__device__ __forceinline__ uint32_t tf32_bits(float x) { return __float_as_uint(round_tf32(x)); }

// d += a * b: a the 16 x 8 A as TF32 bits (a[0], a[1]: slot t of rows g, g + 8; a[2], a[3]: slot t + 4),
// b0, b1 its 8 x 8 B (slots t, t + 4 of column g; TF32 values), d the 16 x 8 C (rows g, g + 8; columns 2t,
// 2t + 1). The TF32 forward's: W_hh held as A fragments, h read as floats.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], float b0, float b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
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

// The power-of-2 scale that puts m >= 0 (the largest |value| of a set held in fp16) in fp16's top binade,
// and its inverse: 2^(E - 141) for m's biased exponent E (m in [2^(E-127), 2^(E-126)), so m / scale is in
// [2^14, 2^15)), at least 2^-126 (a normal float, so that the inverse is finite too); 1 for m not finite
// (an infinity stays infinite, a NaN NaN). Bit operations: frexpf, ldexpf and a division took ~1 K clocks a
// step where a warp published two samples' gate gradients.
__device__ __forceinline__ float2 fp16_scale(float m) {
  const int E = max(static_cast<int>(__float_as_uint(m) >> 23), 15);
  if (E >= 255) return make_float2(1.0f, 1.0f);
  return make_float2(__uint_as_float(static_cast<unsigned>(E - 14) << 23), __uint_as_float(static_cast<unsigned>(268 - E) << 23));
}
// The inverse of a scale fp16_scale gave (a normal power of 2, 2^-126 .. 2^113), from its exponent bits: exact,
// as 1 / scale is, where the division's call to its slow path kept the prologues' loads of each row waiting.
__device__ __forceinline__ float fp16_scale_inverse(float scale) {
  return __uint_as_float((254u - (__float_as_uint(scale) >> 23)) << 23);
}

// A 16-bit backward's shared memory (GridHalfBwdSmem, GridHalfScatterSmem: the same fields) as pointers: the gate
// gradients in fp16, their scales, the warps' sums, W_hh's scales, the cells' gate gradients ([b][R]: gate k of
// unit j at k * 16 + j), the lengths.
struct HalfBwdShared {
  __half* gg;
  float *gscale, *part, *wscale, *dg;
  int* lens;
};
template <typename Layout>
__device__ __forceinline__ HalfBwdShared half_backward_shared(unsigned char* smem, const Layout& lay) {
  return {reinterpret_cast<__half*>(smem + lay.gg), reinterpret_cast<float*>(smem + lay.gscale),
          reinterpret_cast<float*>(smem + lay.part), reinterpret_cast<float*>(smem + lay.wscale),
          reinterpret_cast<float*>(smem + lay.dg),   reinterpret_cast<int*>(smem + lay.lens)};
}
// The 16-bit backwards' scales of n columns or rows of W_hh: fp16_scale of their largest |w|, the warps' maxima
// (part_s: [warp][n], written before the call) combined; a __syncthreads before and after.
__device__ __forceinline__ void scales_from_warps(const float* part_s, int n, float* scale_s) {
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < n) {
    float mm = 0.0f;
    for (int w = 0; w < kWarps; ++w) mm = fmaxf(mm, part_s[w * n + threadIdx.x]);
    scale_s[threadIdx.x] = fp16_scale(mm).x;
  }
  __syncthreads();
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

// One tile of 8 samples of the 16-bit forward's products in a warp: its MT m-tiles of W_hh (w: A fragments, k
// permuted as below) times h at hb (lane (g, t)'s sample of the tile, from the column 8t of the warp's), one chain
// of MMAs per m-tile (3-4 chains a warp, two warps a scheduler); the sums of rows 16m + g (+ 8) and the tile's
// samples 2t (+ 1) go to part_s's rows row0 + 2t (+ 1) (ldp floats apart). benchmarks/probe/wgmma_products.cu
// times it inside one SM.
template <int MT, int KS>
__device__ __forceinline__ void half_tile_products(const uint32_t (&w)[MT][KS][4], const __half* hb, float* part_s,
                                                   int row0, int ldp, int gr, int t) {
  float acc[MT][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[m][e] = 0.0f;
#pragma unroll
  for (int p = 0; p < KS / 2; ++p) {
    const uint4 x = *reinterpret_cast<const uint4*>(hb + 32 * p);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      mma_f16(acc[m], w[m][2 * p], x.x, x.y);
      mma_f16(acc[m], w[m][2 * p + 1], x.z, x.w);
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) part_s[(row0 + 2 * t + (e & 1)) * ldp + 16 * m + gr + 8 * (e / 2)] = acc[m][e];
}

// The forward with W_hh in 16 bits (GridHalfFwdShape). k is permuted as in the TF32 forward, by pairs of
// k16-steps (32 columns from c0): lane (g, t) holds slots 2t, 2t + 1, 2t + 8, 2t + 9 of k16-step 2p as
// columns c0 + 8t .. c0 + 8t + 3 and those of k16-step 2p + 1 as c0 + 8t + 4 .. + 7, so one 16-byte load
// of its sample's h gives it the B operands of both.
// TAGGED: h through the tagged exchange (half_forward_tagged), else rows and a barrier a step.
template <Cell C, int MT, int KS, bool TAGGED>
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
  const GridHalfFwdSmem lay(g, GridHalfFwdShape(G, H, hs), TAGGED);
  const int ldh = lay.ldh, ldp = lay.ldp;
  __half* h_s = reinterpret_cast<__half*>(smem + lay.h);
  float* part_s = reinterpret_cast<float*>(smem + lay.part);
  float* scale_s = reinterpret_cast<float*>(smem + lay.scale);
  int* lens = reinterpret_cast<int*>(smem + lay.lens);
  __half* hx_s = reinterpret_cast<__half*>(smem + lay.hx);

  // Row r's scale: fp16_scale of its largest |w| (of 0 for a padding row, whose weights stay 0).
  for (int r = warp; r < ROWS; r += kWarps) {
    const float* src = block_row(a.w_hh, G, g, blk, r);
    float m = 0.0f;
    if (src)
      for (int c = lane; c < H; c += 32) m = fmaxf(m, fabsf(src[c]));
#pragma unroll
    for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (lane == 0) scale_s[r] = fp16_scale(m).x;
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
      const float inv = fp16_scale_inverse(scale_s[row]);
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
  if constexpr (TAGGED)
    for (int e = tid; e < g.bs * round_up(hs, 4); e += kThreads) hx_s[e] = __float2half_rn(0.0f);  // units past hv: 0
  GroupBarrier bar{Sync::kGrid, a.arrivals + blk.group, static_cast<unsigned>(g.nc), 0u};

  // in: the tagged lines (TAGGED) or the exchange's rows of h_{t-1}.
  auto products = [&](int s, const auto& in) {
    if constexpr (TAGGED)
      poll_h_lines(in, s, hs, h_s, ldh, lens, bv);
    else
      stage_tiles(in, Kx, Kx / 8, h_s, ldh, lens, bv, s, tiles);
    VLSEQ_MARK(0, 1, s);
    for (int n = 0; n < tiles; ++n) {
      if constexpr (!TAGGED) wait_staged(n, tiles);
      if (!tile_runs(lens, 8 * n, bv, s)) continue;
      half_tile_products(w, h_s + (8 * n + gr) * ldh + warp * KW + 8 * t, part_s, warp * bsp + 8 * n, ldp, gr, t);
    }
    VLSEQ_MARK(0, 2, s);
    __syncthreads();
  };
  grid_forward_steps<C, kGridRegItems, false, __half, TAGGED>(a, blk, lens, bar, products, [&](int b, int k, int j) {
    float v = 0.0f;
#pragma unroll
    for (int q = 0; q < kWarps; ++q) v += part_s[(q * bsp + b) * ldp + k * hs + j];
    return v * scale_s[k * hs + j];
  }, TAGGED ? hx_s : nullptr);
#endif
}

template <Cell C, int SB>
__global__ void __launch_bounds__(kThreads, 1) rnn_backward_grid_half_kernel(const BackwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(kWarps == 8 && SB % 2 == 0, "source blocks staged in pairs");
  constexpr int G = C == Cell::kLSTM ? 4 : 3, U = kHalfBwdUnits, R = G * U, KW = SB * R, NG = SB / 2;
  // The gathered row of a sample: nc = kWarps * SB source blocks (GridHalfBwdShape), known here, so that
  // the staging's and the products' offsets are immediates.
  constexpr int K = kWarps * SB * R, LDK = K + 16;
  const Geometry& g = a.g;
  const int H = g.H;
  const Block blk(g);
  const int bv = blk.bv, tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gr = lane / 4, t = lane % 4;
  const int bsp = round_up(g.bs, 8), tiles = ceil_div(bv, 8);

  extern __shared__ __align__(16) unsigned char smem[];
  const GridHalfBwdSmem lay(g, G);  // (its ldk: LDK)
  const int ldp = lay.ldp;
  const auto [gg_s, gscale_s, part_s, wscale_s, dg_s, lens] = half_backward_shared(smem, lay);

  // Column j0 + u's scale, fp16_scale of its largest |w| over the G * H rows (of 0 past the block's units).
  // Each lane reads the weights its A fragments take (below; together they cover every row < G * H), 128
  // independent loads for each of its two units, where a loop over the rows (unrolled 4 deep by nvcc) made 64
  // trips to memory a lane; the maxima meet over the quad (shuffles), then over the warps (part_s).
  {
#pragma unroll 1
    for (int half = 0; half < 2; ++half) {
      const int u = gr + 8 * half;
      const float* col = a.w_hh + blk.j0 + u;
      float m = 0.0f;
#pragma unroll
      for (int i = 0; i < SB; ++i)
#pragma unroll
        for (int k = 0; k < G; ++k)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = (warp * SB + i) * U + 4 * t + e;
            if (u < blk.hv && r < H) m = fmaxf(m, fabsf(col[static_cast<int64_t>(k * H + r) * H]));
          }
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      if (t == 0) part_s[warp * U + u] = m;
    }
    scales_from_warps(part_s, U, wscale_s);
  }
  // A fragments: w[i][k] = W_hh^T of units gr (+ 8) and the rows of gate k of source block q = warp * SB + i,
  // units q * U + 4t .. + 3 (permuted as above; zero past H or the block's units), over the column's scale.
  uint32_t w[SB][G][4];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int u = gr + 8 * half;
    const bool mine = u < blk.hv;
    const float inv = fp16_scale_inverse(wscale_s[u]);
    const float* col = a.w_hh + blk.j0 + u;
#pragma unroll
    for (int i = 0; i < SB; ++i)
#pragma unroll
      for (int k = 0; k < G; ++k) {
        const int r0 = (warp * SB + i) * U + 4 * t;
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e)
          v[e] = mine && r0 + e < H ? col[static_cast<int64_t>(k * H + r0 + e) * H] * inv : 0.0f;
        w[i][k][half] = half2_bits(v[0], v[1]), w[i][k][2 + half] = half2_bits(v[2], v[3]);
      }
  }
  for (int e = tid; e < bsp * LDK; e += kThreads) gg_s[e] = __float2half_rn(0.0f);
  for (int e = tid; e < bsp * 8 * kWarps; e += kThreads) gscale_s[e] = 0.0f;
  for (int e = tid; e < g.bs * R; e += kThreads) dg_s[e] = 0.0f;  // units past hv stay 0
  load_lengths(lens, a.lengths, g, blk);
  GroupBarrier bar{Sync::kGrid, a.arrivals + blk.group, static_cast<unsigned>(g.nc), 0u};
  const int smax = finish_setup(bar, lens, g.bs);

  // The exchange: a step of parity p's gate gradients of sample b, source block q, at gates(p) + b * K + q *
  // R; their scale at scales(p) + b * 8 * kWarps + (q / SB) * 8 + q % SB.
  auto gates = [&](int parity) {
    return reinterpret_cast<__half*>(a.xchg) + (static_cast<int64_t>(parity) * blk.groups + blk.group) * g.bs * K;
  };
  float* const scale_base = a.xchg + 2 * static_cast<int64_t>(blk.groups) * g.bs * K / 2;
  auto scales = [&](int parity) {
    return scale_base + (static_cast<int64_t>(parity) * blk.groups + blk.group) * g.bs * 8 * kWarps;
  };
  // The staging's lanes: lane (b0, c) = (lane / 16, lane % 16) copies 16-byte chunk c of each of its
  // group's two source blocks of samples b0, b0 + 2, ..., b0 + 14 (the lanes past C16 chunks copy none), so
  // that every copy is at a constant offset from the lane's first (immediates in the instructions: where
  // each copy computed its sample, chunk and 64-bit address, the staging took ~960 of the warp's ~1,400
  // instructions a step; twenty-seventh session, Nsight Compute).
  constexpr int C16 = 2 * R / 8;  // 16-byte chunks of a sample's two source blocks: 16 (LSTM), 12 (GRU)
  const int b0 = lane / 16, c16 = lane % 16;
  // dh of step s_next - 1 for this block's units: the gate gradients of step s_next (parity) of the samples
  // running then, this warp's source blocks staged and multiplied, the warps' sums to part_s.
  auto gather = [&](int parity, int s_next) {
    unsigned staged = 0;  // bit j: sample b0 + 2j runs at s_next (this lane copies its chunk)
#pragma unroll
    for (int j = 0; j < kHalfBwdMaxSamples / 2; ++j) {
      const int b = b0 + 2 * j;
      if (c16 < C16 && b < bv && s_next < lens[b]) staged |= 1u << j;
    }
    const __half* src = gates(parity) + b0 * K + warp * KW + 8 * c16;
    __half* dst = gg_s + b0 * LDK + warp * KW + 8 * c16;
#pragma unroll
    for (int n = 0; n < NG; ++n) {
#pragma unroll
      for (int j = 0; j < kHalfBwdMaxSamples / 2; ++j)
        if (staged >> j & 1u) cp_async16(dst + 2 * j * LDK + n * 2 * R, src + 2 * j * K + n * 2 * R);
      if (n == 0 && lane < 2 * bv && s_next < lens[lane / 2]) {  // the samples' scales of this warp's blocks
        const int e = (lane / 2) * 8 * kWarps + 4 * (lane % 2);
        cp_async16(gscale_s + e + warp * 8, scales(parity) + e + warp * 8);
      }
      cp_async_commit();
    }
    const bool run0 = tile_runs(lens, 0, bv, s_next), run1 = tiles > 1 && tile_runs(lens, 8, bv, s_next);
    float tot[2][4] = {};
    // Group n's products for the tiles M0 .. M0 + NT - 1: the 2 * NT chains of G MMAs (one per source
    // block and tile, each with its own scales) interleaved, where one chain at a time left the tensor
    // pipe waiting on each MMA's result.
    auto products = [&](int n, auto m0, auto nt) {
      constexpr int M0 = decltype(m0)::value, NT = decltype(nt)::value;
      float p[2][NT][4] = {};
#pragma unroll
      for (int k = 0; k < G; ++k)
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int m = 0; m < NT; ++m) {
            const uint2 x = *reinterpret_cast<const uint2*>(gg_s + (8 * (M0 + m) + gr) * LDK + warp * KW +
                                                            (2 * n + i) * R + k * U + 4 * t);
            mma_f16(p[i][m], w[2 * n + i][k], x.x, x.y);
          }
      // C: units gr (+ 8), samples 8m + 2t (+ 1): each sample's sums times its scale for the source block.
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int m = 0; m < NT; ++m) {
          const float* sc = gscale_s + (8 * (M0 + m) + 2 * t) * 8 * kWarps + warp * 8 + 2 * n + i;
          const float s0 = sc[0], s1 = sc[8 * kWarps];
          float(&d)[4] = tot[M0 + m];
          d[0] += p[i][m][0] * s0, d[1] += p[i][m][1] * s1, d[2] += p[i][m][2] * s0, d[3] += p[i][m][3] * s1;
        }
    };
    using I0 = std::integral_constant<int, 0>;
    using I1 = std::integral_constant<int, 1>;
    using I2 = std::integral_constant<int, 2>;
#pragma unroll
    for (int n = 0; n < NG; ++n) {
      wait_staged(n, NG, true);
      if (run0 && run1)
        products(n, I0{}, I2{});
      else if (run0)
        products(n, I0{}, I1{});
      else if (run1)
        products(n, I1{}, I1{});
    }
#pragma unroll
    for (int m = 0; m < 2; ++m)
      if (m < tiles)  // (bsp = 8 * tiles: a second tile's rows would be the next warp's)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          part_s[(warp * bsp + 8 * m + 2 * t + (e & 1)) * ldp + gr + 8 * (e / 2)] = tot[m][e];
    __syncthreads();
  };
  auto sum_of = [&](int b, int j) {
    float v = 0.0f;
#pragma unroll
    for (int q = 0; q < kWarps; ++q) v += part_s[(q * bsp + b) * ldp + j];
    return v * wscale_s[j];
  };
  // This block's gate gradients of the samples running at s to the exchange, a warp per sample: scaled by
  // fp16_scale of their largest, two a lane (a warp's stores: one 128-byte run).
  auto publish = [&](int cur, int s) {
    for (int b = warp; b < bv; b += kWarps) {
      if (s >= lens[b]) continue;
      const bool two = 2 * lane < R;
      const float v0 = two ? dg_s[b * R + 2 * lane] : 0.0f, v1 = two ? dg_s[b * R + 2 * lane + 1] : 0.0f;
      float m = fmaxf(fabsf(v0), fabsf(v1));
#pragma unroll
      for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
      const float2 scale = fp16_scale(m);  // (scale, 1 / scale)
      if (two)
        __stcg(reinterpret_cast<unsigned*>(gates(cur) + static_cast<int64_t>(b) * K + blk.rank * R + 2 * lane),
               half2_bits(v0 * scale.y, v1 * scale.y));
      if (lane == 0) __stcg(scales(cur) + b * 8 * kWarps + (blk.rank / SB) * 8 + blk.rank % SB, scale.x);
    }
  };
  // One (sample, unit) pair a thread: at most 16 samples of 16 units.
  grid_backward_steps<C, 1>(a, blk, lens, dg_s, R, bar, smax, gather, sum_of, publish);
#endif
}

// The tagged words of the reduce-scatter backward: a step's tag (1 or 2: two buffers by step parity, so the
// value a word held before, two steps earlier, carries the other tag, and the zeroed buffer neither) in the 2
// low bits of an fp32 partial. A partial that overflowed to infinity arrives as a NaN (the tag makes its
// mantissa nonzero); a NaN stays a NaN.
__device__ __forceinline__ unsigned scatter_tag(int s) { return ((s >> 1) & 1) + 1; }
__device__ __forceinline__ unsigned with_tag(float v, unsigned tag) { return (__float_as_uint(v) & ~3u) | tag; }
__device__ __forceinline__ bool tagged_as(const uint4& v, unsigned tag) {
  return (((v.x ^ tag) | (v.y ^ tag) | (v.z ^ tag) | (v.w ^ tag)) & 3u) == 0;
}
__device__ __forceinline__ float4 untagged(const uint4& v) {
  return make_float4(__uint_as_float(v.x & ~3u), __uint_as_float(v.y & ~3u), __uint_as_float(v.z & ~3u),
                     __uint_as_float(v.w & ~3u));
}

// The backward by reduce-scatter (half_backward_scatter, above). Warp w multiplies the block's R = G * 16 rows
// (K: one k16-step a gate, the rows of units 4t .. 4t + 3 as slots 2t, 2t + 1, 2t + 8, 2t + 9, as the
// all-gather kernel's) by columns w * 16 * SB ..: SB m-tiles, taken in pairs so that lane (gr, t) ends with 4
// consecutive columns of a sample, one line: row gr + 8e of m-tile 2p + h is column 32p + 4gr + 2h + e of the
// warp's. The samples (N) are tiles of 8 (at most 4 run). Every block sends every owner (the blocks past H
// too, whose units' partials are zero and nobody reads) its lines for each sample running, and polls its own.
// Safe without a barrier by TaggedLines' argument (rnn_grid_kernels.cuh): a block sends step s into buffer s & 1
// only after it read step s + 1's lines from every block, each sent after that block had read step s + 2's from
// buffer s & 1; a reader that saw step s + 2's word (or the zero) sees step s's next, never an older one.
template <Cell C, int SB>
__global__ void __launch_bounds__(kThreads, 1) rnn_backward_grid_half_scatter_kernel(const BackwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(kWarps == 8 && SB % 2 == 0, "m-tiles in pairs");
  constexpr int G = C == Cell::kLSTM ? 4 : 3, U = kHalfBwdUnits, R = G * U, NC = kWarps * SB, LQ = U / 4;
  constexpr int KW = U * SB, LDG = R + 16;  // KW: the warp's columns
  const Geometry& g = a.g;
  const int H = g.H;
  const Block blk(g);
  const int bv = blk.bv, tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gr = lane / 4, t = lane % 4;
  const int64_t ldw = H;

  extern __shared__ __align__(16) unsigned char smem[];
  const GridHalfScatterSmem lay(g, G);  // (its ldg: LDG)
  const auto [gg_s, gscale_s, part_s, wscale_s, dg_s, lens] = half_backward_shared(smem, lay);

  // This lane's weights: rows k * H + j0 + 4t + e (gate k, unit 4t + e; none past the block's units) at columns
  // warp * KW + 32p + 4gr + f (none past H).
  auto weight = [&](int k, int e, int p, int f) {
    const int u = 4 * t + e, c = warp * KW + 32 * p + 4 * gr + f;
    return u < blk.hv && c < H ? a.w_hh[(k * ldw + blk.j0 + u) * ldw + c] : 0.0f;
  };
  // Row r's scale: fp16_scale of its largest |w|, from the weights each lane loads for its fragments (their
  // maxima over the lanes of a quad column, then over the warps).
  {
    float m[G][4];
#pragma unroll
    for (int k = 0; k < G; ++k)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        m[k][e] = 0.0f;
#pragma unroll
        for (int p = 0; p < SB / 2; ++p)
#pragma unroll
          for (int f = 0; f < 4; ++f) m[k][e] = fmaxf(m[k][e], fabsf(weight(k, e, p, f)));
#pragma unroll
        for (int off = 4; off < 32; off *= 2) m[k][e] = fmaxf(m[k][e], __shfl_xor_sync(0xffffffffu, m[k][e], off));
        if (gr == 0) part_s[warp * R + k * U + 4 * t + e] = m[k][e];
      }
    scales_from_warps(part_s, R, wscale_s);
  }
  // A fragments: w[m][k] of m-tile m = 2p + h, gate k: rows gr (+ 8) are columns 32p + 4gr + 2h (+ 1), slots 2t,
  // 2t + 1 (2t + 8, 2t + 9) units 4t, 4t + 1 (4t + 2, 4t + 3); each weight over its row's scale (exact).
  uint32_t w[SB][G][4];
#pragma unroll
  for (int k = 0; k < G; ++k) {
    float inv[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) inv[e] = fp16_scale_inverse(wscale_s[k * U + 4 * t + e]);
#pragma unroll
    for (int m = 0; m < SB; ++m)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int f = 2 * (m % 2) + i;
        w[m][k][i] = half2_bits(weight(k, 0, m / 2, f) * inv[0], weight(k, 1, m / 2, f) * inv[1]);
        w[m][k][2 + i] = half2_bits(weight(k, 2, m / 2, f) * inv[2], weight(k, 3, m / 2, f) * inv[3]);
      }
  }
  for (int e = tid; e < 8 * LDG; e += kThreads) gg_s[e] = __float2half_rn(0.0f);
  for (int e = tid; e < 8; e += kThreads) gscale_s[e] = 0.0f;
  for (int e = tid; e < g.bs * R; e += kThreads) dg_s[e] = 0.0f;  // units past hv stay 0
  load_lengths(lens, a.lengths, g, blk);
  GroupBarrier bar{Sync::kGrid, a.arrivals + blk.group, static_cast<unsigned>(g.nc), 0u};
  const int smax = finish_setup(bar, lens, g.bs);

  // Owner o's line l of source q, sample b, in buffer `parity`: lines(parity) + ((o * bs + b) * NC + q) * LQ + l.
  auto lines = [&](int parity) {
    return reinterpret_cast<uint4*>(a.xchg) + (static_cast<int64_t>(parity) * blk.groups + blk.group) * NC * g.bs * NC * LQ;
  };
  // dh of step s_next - 1 for this block's units: thread q * LQ + l (warps < SB) polls line l of source q of each
  // sample running at s_next, in rounds: each round loads the lines not yet tagged again, together (one trip to
  // L2 a round for all of them; polled one after the other, each took trips of its own, and a step at 2-4
  // samples a group measured 21-73% longer). Then the warp's 8 sources are summed by a butterfly over the lanes
  // of a quad column (the same order in every lane), the warps' sums to part_s ([warp][b][U]).
  auto gather = [&](int parity, int s_next) {
    if (warp < SB) {
      const unsigned tag = scatter_tag(s_next);
      const uint4* in = lines(parity) + static_cast<int64_t>(blk.rank) * g.bs * NC * LQ + tid;
      uint4 v[kHalfScatterMaxSamples];
      unsigned pending = 0;  // bit b: sample b's line not yet tagged
#pragma unroll
      for (int b = 0; b < kHalfScatterMaxSamples; ++b)
        if (b < bv && s_next < lens[b]) v[b] = load_tagged(in + b * NC * LQ), pending |= 1u << b;
      for (;;) {
#pragma unroll
        for (int b = 0; b < kHalfScatterMaxSamples; ++b)
          if ((pending >> b & 1u) && tagged_as(v[b], tag)) pending &= ~(1u << b);
        if (!pending) break;
#pragma unroll
        for (int b = 0; b < kHalfScatterMaxSamples; ++b)
          if (pending >> b & 1u) v[b] = load_tagged(in + b * NC * LQ);
      }
#pragma unroll
      for (int b = 0; b < kHalfScatterMaxSamples; ++b) {
        if (b >= bv || s_next >= lens[b]) continue;  // the same in every lane
        float4 x = untagged(v[b]);
#pragma unroll
        for (int off = 4; off < 32; off *= 2) {
          x.x += __shfl_xor_sync(0xffffffffu, x.x, off), x.y += __shfl_xor_sync(0xffffffffu, x.y, off);
          x.z += __shfl_xor_sync(0xffffffffu, x.z, off), x.w += __shfl_xor_sync(0xffffffffu, x.w, off);
        }
        if (gr == 0) *reinterpret_cast<float4*>(part_s + (warp * g.bs + b) * U + 4 * t) = x;
      }
    }
    __syncthreads();
  };
  auto sum_of = [&](int b, int j) {
    float v = 0.0f;
#pragma unroll
    for (int q = 0; q < SB; ++q) v += part_s[(q * g.bs + b) * U + j];
    return v;
  };
  // This block's partials of the samples running at s to their owners: the gate gradients times their rows'
  // scales, in fp16 over fp16_scale of their largest (a warp per sample), the MMAs, the sums times that scale.
  auto scatter = [&](int cur, int s) {
    for (int b = warp; b < bv; b += kWarps) {
      if (s >= lens[b]) continue;
      const bool two = 2 * lane < R;
      const float v0 = two ? dg_s[b * R + 2 * lane] * wscale_s[2 * lane] : 0.0f;
      const float v1 = two ? dg_s[b * R + 2 * lane + 1] * wscale_s[2 * lane + 1] : 0.0f;
      float m = fmaxf(fabsf(v0), fabsf(v1));
#pragma unroll
      for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
      const float2 scale = fp16_scale(m);  // (scale, 1 / scale)
      if (two) *reinterpret_cast<uint32_t*>(gg_s + b * LDG + 2 * lane) = half2_bits(v0 * scale.y, v1 * scale.y);
      if (lane == 0) gscale_s[b] = scale.x;
    }
    __syncthreads();
    float acc[SB][4];
#pragma unroll
    for (int m = 0; m < SB; ++m)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][e] = 0.0f;
    uint2 x[G];
#pragma unroll
    for (int k = 0; k < G; ++k) x[k] = *reinterpret_cast<const uint2*>(gg_s + gr * LDG + k * U + 4 * t);
#pragma unroll
    for (int k = 0; k < G; ++k)
#pragma unroll
      for (int m = 0; m < SB; ++m) mma_f16(acc[m], w[m][k], x[k].x, x[k].y);
    // C: rows gr (+ 8), samples 2t (+ 1): lane (gr, t) holds columns 32p + 4gr .. + 3 of sample 2t + i, units
    // 4 (gr % 4) .. of owner warp * SB + 2p + gr / 4.
    const unsigned tag = scatter_tag(s);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int b = 2 * t + i;
      if (b >= bv || s >= lens[b]) continue;
      const float sc = gscale_s[b];
      uint4* out = lines(cur) + (static_cast<int64_t>(warp * SB + gr / 4) * g.bs + b) * NC * LQ + blk.rank * LQ + gr % 4;
#pragma unroll
      for (int p = 0; p < SB / 2; ++p)
        store_line(out + static_cast<int64_t>(2 * p) * g.bs * NC * LQ, with_tag(acc[2 * p][i] * sc, tag),
                   with_tag(acc[2 * p][2 + i] * sc, tag), with_tag(acc[2 * p + 1][i] * sc, tag),
                   with_tag(acc[2 * p + 1][2 + i] * sc, tag));
    }
  };
  // One (sample, unit) pair a thread: at most 4 samples of 16 units.
  grid_backward_steps<C, 1, true>(a, blk, lens, dg_s, R, bar, smax, gather, sum_of, scatter);
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
#define VLSEQ_RNN_GRID_HALF_FWD_TABLE(NAME, KERNEL)                                       \
  const void* NAME(Cell c, int mt, int k, bool tagged) {                                  \
    if (tagged) {                                                                         \
      if (c == Cell::kLSTM) { VLSEQ_RNN_GRID_HALF_FWD_CASES(KERNEL, Cell::kLSTM, true) }  \
      VLSEQ_RNN_GRID_HALF_FWD_CASES(KERNEL, Cell::kGRU, true)                             \
    }                                                                                     \
    if (c == Cell::kLSTM) { VLSEQ_RNN_GRID_HALF_FWD_CASES(KERNEL, Cell::kLSTM, false) }   \
    VLSEQ_RNN_GRID_HALF_FWD_CASES(KERNEL, Cell::kGRU, false)                              \
  }
#define VLSEQ_RNN_GRID_HALF_FWD_CASES(KERNEL, CELL, T)                                      \
  if (mt == 3 && k == 6) return reinterpret_cast<const void*>(&KERNEL<CELL, 3, 6, T>); \
  if (mt == 3) return reinterpret_cast<const void*>(&KERNEL<CELL, 3, 8, T>);           \
  if (k == 6) return reinterpret_cast<const void*>(&KERNEL<CELL, 4, 6, T>);            \
  return reinterpret_cast<const void*>(&KERNEL<CELL, 4, 8, T>);
// The 16-bit backwards' (all-gather, reduce-scatter) for a cell and source blocks a warp (4, 6 or 8).
#define VLSEQ_RNN_GRID_HALF_BWD_TABLE(NAME, KERNEL)                     \
  const void* NAME(Cell c, int sb) {                                    \
    if (c == Cell::kLSTM) { VLSEQ_RNN_GRID_HALF_BWD_CASES(KERNEL, Cell::kLSTM) } \
    VLSEQ_RNN_GRID_HALF_BWD_CASES(KERNEL, Cell::kGRU)                   \
  }
#define VLSEQ_RNN_GRID_HALF_BWD_CASES(KERNEL, CELL)                  \
  if (sb == 4) return reinterpret_cast<const void*>(&KERNEL<CELL, 4>); \
  if (sb == 6) return reinterpret_cast<const void*>(&KERNEL<CELL, 6>); \
  return reinterpret_cast<const void*>(&KERNEL<CELL, 8>);

#endif  // __CUDACC__

}  // namespace vlseq::rnn
