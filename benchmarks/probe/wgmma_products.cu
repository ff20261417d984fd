// What the 16-bit grid forward's products phase could cost with wgmma instead of mma.sync: a block holds 64
// rows of W_hh (LSTM 1024: 16 units x 4 gates) x 1,024 columns in fp16 in its registers (128 a thread), h_{t-1}
// of NS samples sits in shared memory, and each step multiplies them, the warps' partial sums meet in shared
// memory and are added (as the cell does), and h_t is written back (tanh of the sums, so each step depends on the
// one before). No exchange: only what happens inside one SM, the phase the kernel's step_timing calls "mma".
//   mma    the landed scheme (rnn_forward_grid_half_kernel): warp w all 4 m-tiles x its eighth of the columns,
//          m16n8k16 mma.sync in chains per m-tile, one tile of 8 samples at a time, 8 partial sums a value;
//   wgmma  warpgroup q (warps 4q .. 4q + 3) the 64 rows x half the columns, 32 wgmma m64nNk16 with W_hh as the
//          A operand in registers (the same fragment layout per warp as mma.sync's A) and h as B from shared
//          memory (no swizzle, K-major core matrices of 8 samples x 8 columns), 2 partial sums a value: one
//          chain of 32 dependent wgmmas (wgmma), or 4 chains of 8 on accumulators of their own (wgmma4).
// Built with the extension's include paths (csrc/include, csrc/cuda, torch's): run_on_gpu.sh products.
// Usage: wgmma_products [samples=16 (8 or 16)] [blocks=128] [steps=480]
// Prints the products phase's clocks a step (block 0) and the whole step's, and each variant's largest error
// against a float64 product of the same fp16 operands after one step.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "rnn_grid_tf32_kernels.cuh"  // the landed kernel's products of a tile (half_tile_products) and half2_bits

constexpr int kThreads = 256, kRows = 64, kCols = 1024;

#define CHECK(x)                                                                             \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

using vlseq::rnn::half2_bits;
using vlseq::rnn::half_tile_products;

// The shared-memory matrix descriptor of a K-major operand without swizzle: core matrices of 8 rows x 16 bytes,
// each 128 contiguous bytes; lbo the bytes between core matrices along K, sbo along M / N.
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return static_cast<uint64_t>((a >> 4) & 0x3FFF) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32);
}

// d += A * B, A 64 x 16 in registers (each warp of the warpgroup its 16 rows, as mma.sync's A), B 16 x N.
template <int N>
__device__ __forceinline__ void wgmma_f16(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b);
template <>
__device__ __forceinline__ void wgmma_f16<16>(float (&d)[8], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, "
      "%12, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <>
__device__ __forceinline__ void wgmma_f16<8>(float (&d)[4], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// h in shared memory. mma: [sample][kLdh] (the landed kernel's rows, 32 halves of padding). wgmma: core matrices
// [column chunk of 8][sample group of 8][8 samples][8 columns]: LBO (along K) = NS / 8 * 128, SBO = 128.
constexpr int kLdh = kCols + 32;
template <bool WG, int NS>
__device__ __forceinline__ int h_index(int n, int k) {
  if constexpr (WG)
    return ((k / 8) * (NS / 8) + n / 8) * 64 + (n % 8) * 8 + k % 8;
  else
    return n * kLdh + k;
}

template <bool WG, int NS, int CH = 1>
__global__ void __launch_bounds__(kThreads, 1)
    products_kernel(const float* __restrict__ w_g, const float* __restrict__ h0, int steps, float* __restrict__ out,
                    long long* __restrict__ clocks) {
  extern __shared__ __align__(128) unsigned char smem[];
  __half* h_s = reinterpret_cast<__half*>(smem);
  float* part_s = reinterpret_cast<float*>(smem + (WG ? NS * kCols * 2 : NS * kLdh * 2));
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gr = lane / 4, t = lane % 4;
  for (int e = tid; e < NS * kCols; e += kThreads) h_s[h_index<WG, NS>(e / kCols, e % kCols)] = __float2half_rn(h0[e]);
  auto W = [&](int r, int c) { return w_g[r * kCols + c]; };
  // A fragments: mma, w[m][ks] of m-tile m, k16-step ks of columns warp * 128 ..; wgmma, w[s] of rows 16 * (warp
  // % 4) .., k16-step s of columns (warp / 4) * 512 ...
  constexpr int KS = WG ? 32 : 8, MT = WG ? 1 : 4;
  uint32_t w[MT][KS][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      const int r = WG ? 16 * (warp % 4) + gr : 16 * m + gr;
      // mma: k permuted as the landed kernel's (slots 2t, 2t + 1, 2t + 8, 2t + 9 of k16-step 2p + i are columns
      // warp * 128 + 32p + 8t + 4i .. + 3: one 16-byte load of h gives both steps' B); wgmma: k in order.
      const int c = WG ? (warp / 4) * 512 + 16 * s + 2 * t : warp * 128 + 32 * (s / 2) + 8 * t + 4 * (s % 2);
      const int c8 = WG ? c + 8 : c + 2;
      w[m][s][0] = half2_bits(W(r, c), W(r, c + 1));
      w[m][s][1] = half2_bits(W(r + 8, c), W(r + 8, c + 1));
      w[m][s][2] = half2_bits(W(r, c8), W(r, c8 + 1));
      w[m][s][3] = half2_bits(W(r + 8, c8), W(r + 8, c8 + 1));
    }
  constexpr int P = WG ? 2 : 8;  // partial sums a value
  constexpr int LDP = kRows + 4;
  long long phase = 0, total = 0;
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  for (int step = 0; step < steps; ++step) {
    const long long t0 = clock64();
    if constexpr (WG) {
      constexpr int NA = NS / 2;
      float chains[CH][NA];
#pragma unroll
      for (int c = 0; c < CH; ++c) {
#pragma unroll
        for (int i = 0; i < NA; ++i) chains[c][i] = 0.0f;
        fence_operands(chains[c]);
      }
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
      const int q = warp / 4;
#pragma unroll
      for (int s = 0; s < KS; ++s)
        wgmma_f16<NS>(chains[s % CH], w[0][s], smem_desc(h_s + (q * 64 + 2 * s) * (NS / 8) * 64, NS / 8 * 128, 128));
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
      for (int c = 0; c < CH; ++c) fence_operands(chains[c]);
      float acc[NA];
#pragma unroll
      for (int i = 0; i < NA; ++i) {
        acc[i] = chains[0][i];
#pragma unroll
        for (int c = 1; c < CH; ++c) acc[i] += chains[c][i];
      }
      // D: rows 16 * (warp % 4) + gr (+ 8), samples 8j + 2t (+ 1): acc[4j + e].
#pragma unroll
      for (int j = 0; j < NS / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          part_s[(q * NS + 8 * j + 2 * t + (e & 1)) * LDP + 16 * (warp % 4) + gr + 8 * (e / 2)] = acc[4 * j + e];
    } else {
#pragma unroll
#pragma unroll
      for (int n = 0; n < NS / 8; ++n)
        half_tile_products(w, h_s + (8 * n + gr) * kLdh + warp * 128 + 8 * t, part_s, warp * NS + 8 * n, LDP, gr, t);
    }
    __syncthreads();
    const long long t1 = clock64();
    // The sums (the cell's reads), then h_t: column k of sample n from row k % 64's sum.
    for (int e = tid; e < NS * kRows; e += kThreads) {
      const int n = e / kRows, r = e % kRows;
      float v = 0.0f;
#pragma unroll
      for (int p = 0; p < P; ++p) v += part_s[(p * NS + n) * LDP + r];
      if (step == 0 && blockIdx.x == 0) out[e] = v;
      part_s[(P * NS + n) * LDP + r] = v;
    }
    __syncthreads();
    for (int e = tid; e < NS * kCols; e += kThreads) {
      const int n = e / kCols, k = e % kCols;
      h_s[h_index<WG, NS>(n, k)] = __float2half_rn(tanhf(0.05f * part_s[(P * NS + n) * LDP + k % kRows] + 1e-3f * (k % 7)));
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    phase += t1 - t0, total += clock64() - t0;
  }
  if (blockIdx.x == 0 && tid == 0) clocks[0] = phase, clocks[1] = total;
}

template <bool WG, int NS, int CH = 1>
void run(const char* name, int blocks, int steps, const float* w_d, const float* h_d, const std::vector<double>& ref) {
  const int smem = (WG ? NS * kCols * 2 : NS * kLdh * 2) + ((WG ? 2 : 8) + 1) * NS * (kRows + 4) * 4;
  CHECK(cudaFuncSetAttribute(products_kernel<WG, NS, CH>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  float* out_d;
  long long* clk_d;
  CHECK(cudaMalloc(&out_d, NS * kRows * 4));
  CHECK(cudaMalloc(&clk_d, 16));
  products_kernel<WG, NS, CH><<<blocks, kThreads, smem>>>(w_d, h_d, 1, out_d, clk_d);  // warm-up and the check
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<float> out(NS * kRows);
  CHECK(cudaMemcpy(out.data(), out_d, out.size() * 4, cudaMemcpyDeviceToHost));
  double err = 0.0, scale = 0.0;
  for (size_t i = 0; i < out.size(); ++i) err = std::fmax(err, std::fabs(out[i] - ref[i])), scale = std::fmax(scale, std::fabs(ref[i]));
  std::vector<long long> phase, total;
  for (int rep = 0; rep < 5; ++rep) {
    products_kernel<WG, NS, CH><<<blocks, kThreads, smem>>>(w_d, h_d, steps, out_d, clk_d);
    CHECK(cudaDeviceSynchronize());
    long long c[2];
    CHECK(cudaMemcpy(c, clk_d, 16, cudaMemcpyDeviceToHost));
    phase.push_back(c[0]), total.push_back(c[1]);
  }
  std::sort(phase.begin(), phase.end()), std::sort(total.begin(), total.end());
  std::printf("%-6s %2d samples, %3d blocks: products %6.0f clocks a step, whole step %6.0f; error after one step %.2e of the largest (%.3g)\n",
              name, NS, blocks, static_cast<double>(phase[2]) / steps, static_cast<double>(total[2]) / steps, err / scale, scale);
  CHECK(cudaFree(out_d));
  CHECK(cudaFree(clk_d));
}

template <int NS>
void both(int blocks, int steps) {
  std::vector<float> w(kRows * kCols), h(NS * kCols);
  uint32_t x = 12345u;
  auto rnd = [&]() { x = x * 1664525u + 1013904223u; return static_cast<float>((x >> 8) & 0xFFFF) / 32768.0f - 1.0f; };
  for (auto& v : w) v = 0.1f * rnd();
  for (auto& v : h) v = rnd();
  // The reference of the fp16-rounded operands, in float64: [sample][row].
  std::vector<double> ref(NS * kRows, 0.0);
  for (int n = 0; n < NS; ++n)
    for (int r = 0; r < kRows; ++r) {
      double s = 0.0;
      for (int k = 0; k < kCols; ++k)
        s += static_cast<double>(__half2float(__float2half_rn(w[r * kCols + k]))) * __half2float(__float2half_rn(h[n * kCols + k]));
      ref[n * kRows + r] = s;
    }
  float *w_d, *h_d;
  CHECK(cudaMalloc(&w_d, w.size() * 4));
  CHECK(cudaMalloc(&h_d, h.size() * 4));
  CHECK(cudaMemcpy(w_d, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(h_d, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
  run<false, NS>("mma", blocks, steps, w_d, h_d, ref);
  run<true, NS>("wgmma", blocks, steps, w_d, h_d, ref);
  run<true, NS, 4>("wgmma4", blocks, steps, w_d, h_d, ref);
  CHECK(cudaFree(w_d));
  CHECK(cudaFree(h_d));
}

int main(int argc, char** argv) {
  const int ns = argc > 1 ? std::atoi(argv[1]) : 16, blocks = argc > 2 ? std::atoi(argv[2]) : 128,
            steps = argc > 3 ? std::atoi(argv[3]) : 480;
  if (ns == 8)
    both<8>(blocks, steps);
  else if (ns == 16)
    both<16>(blocks, steps);
  else
    std::fprintf(stderr, "samples: 8 or 16\n");
  return 0;
}
