// Where one step of the persistent LSTM/GRU kernels spends its time: block 0's thread 0 stamps
// clock64() at each phase boundary (VLSEQ_RNN_TIMING), averaged over the middle steps of one launch (the second
// of two: the first loads the code), and what the launch spends outside its steps (its time against the steps'
// span, block 0's clocks at the SM clock's rate during them, which the global timer gives: loading W_hh, the first
// barrier, the final stores). The rate is printed beside an idle spin's: MMA-heavy kernels can run slower clocks.
// Usage: step_timing H B nc [lstm|gru] [fp32|bf16] [groups] [bt]   (default LSTM, fp32, 1 group, the
// batch tile the planner would take; 480 steps, each group B samples on nc blocks): the generic kernels,
// then, in fp32, the fused ones and the reduce-scatter backward where they fit; nc > 16: the grid kernels,
// launched cooperatively, h staged in the chunks the planner would pick; both directions also with W_hh in
// registers and the forward with TF32 MMAs where they fit, and with W_hh in 16 bits (the forward, and the
// backward on blocks of its own, all-gather and, up to 4 samples, reduce-scatter) where they do. Several
// groups make the batch's tensors outgrow L2, as in the bench (7 groups of 5 samples: the LSTM 256 x 2 at
// batch 32). Built with -DVLSEQ_RNN_L2_PREFETCH=0, the fused kernels do not ask L2 for the step after
// next's inputs (the A/B of BENCHMARKS.md, ninth session).
#define VLSEQ_RNN_TIMING 1
#include <cstdio>
#include <cstdlib>
#include <climits>
#include <cstring>
#include <algorithm>
#include <vector>

#include "probe_launch.h"
#include "rnn_grid_tf32_kernels.cuh"
#include "rnn_scatter_kernel.cuh"

using namespace vlseq::rnn;

namespace vlseq::rnn {  // the library's kernel tables, instantiated here as rnn_forward.cu / rnn_backward.cu do
VLSEQ_RNN_KERNEL_TABLE(forward_kernel, rnn_forward_kernel, rnn_forward_fused_kernel)
VLSEQ_RNN_KERNEL_TABLE(backward_kernel, rnn_backward_kernel, rnn_backward_fused_kernel)
VLSEQ_RNN_SCATTER_TABLE(backward_scatter_kernel)
VLSEQ_RNN_GRID_TABLE(grid_forward_kernel, rnn_forward_grid_kernel)
VLSEQ_RNN_GRID_TABLE(grid_backward_kernel, rnn_backward_grid_kernel)
VLSEQ_RNN_GRID_REGS_TABLE(grid_backward_regs_kernel, rnn_backward_grid_regs_kernel)
VLSEQ_RNN_GRID_FWD_REGS_TABLE(grid_forward_regs_kernel, rnn_forward_grid_regs_kernel)
VLSEQ_RNN_GRID_TF32_FWD_TABLE(grid_forward_tf32_kernel, rnn_forward_grid_tf32_kernel)
VLSEQ_RNN_GRID_HALF_FWD_TABLE(grid_forward_half_kernel, rnn_forward_grid_half_kernel)
VLSEQ_RNN_GRID_HALF_BWD_TABLE(grid_backward_half_kernel, rnn_backward_grid_half_kernel)
VLSEQ_RNN_GRID_HALF_BWD_TABLE(grid_backward_half_scatter_kernel, rnn_backward_grid_half_scatter_kernel)
}  // namespace vlseq::rnn

// The SM clock's rate: clock64 against the global timer (ns) over a ~2 ms spin of one thread.
__global__ void clock_rate_kernel(double* ghz) {
  unsigned long long t0, t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  const long long c0 = clock64();
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  while (t1 - t0 < 2000000ull);
  *ghz = static_cast<double>(clock64() - c0) / static_cast<double>(t1 - t0);
}
double g_clock_ghz = 1.98;

float* upload(size_t n, float scale) {
  std::vector<float> h(n);
  for (auto& v : h) v = scale * (2.0f * rand() / RAND_MAX - 1.0f);
  float* d;
  cudaMalloc(&d, n * 4);
  cudaMemcpy(d, h.data(), n * 4, cudaMemcpyHostToDevice);
  return d;
}

// Each case launches twice, its barrier counters (`arrivals`, `counters` of them) and `zero_bytes` at `zero`
// (an exchange that must start zeroed, as the host zeroes it) zeroed before each: the first loads the kernel's
// code (lazy loading) and warms L2, the second is the one timed and reported.
// VLSEQ_PROBE_LAUNCHES=1 launches once (under Nsight Compute, whose kernel filters count launches).
float g_launch_ms = 0.0f;
template <typename A>
void launch(const void* kernel, const A& args, int blocks, int nc, int smem, bool grid = false,
            unsigned* arrivals = nullptr, int counters = 0, void* zero = nullptr, size_t zero_bytes = 0) {
  ProbeLaunch l(kernel, blocks, kThreads, smem, grid, grid ? 1 : nc);
  cudaEvent_t a, b;
  cudaEventCreate(&a), cudaEventCreate(&b);
  static long long zeros[2][8][4096];
  cudaError_t e = cudaSuccess;
  float ms = 0.0f;
  static const int launches = getenv("VLSEQ_PROBE_LAUNCHES") ? std::max(1, atoi(getenv("VLSEQ_PROBE_LAUNCHES"))) : 2;
  for (int rep = 0; rep < launches && e == cudaSuccess; ++rep) {
    if (arrivals) cudaMemset(arrivals, 0, counters * sizeof(unsigned));
    if (zero) cudaMemset(zero, 0, zero_bytes);
    cudaMemcpyToSymbol(g_step_clock, zeros, sizeof(zeros));
    cudaMemcpyToSymbol(g_step_ns, zeros, sizeof(g_step_ns));
    cudaEventRecord(a);
    void* params[] = {const_cast<A*>(&args)};
    e = cudaLaunchKernelExC(&l.cfg, kernel, params);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    cudaEventElapsedTime(&ms, a, b);
    if (e == cudaSuccess) e = cudaGetLastError();
  }
  g_launch_ms = e == cudaSuccess ? ms : 0.0f;
  printf("  launch %s, %.3f ms\n", cudaGetErrorString(e), ms);
}

// The SM clock's rate during a launch's steps (GHz): block 0's clocks against the global timer between the
// first and the last step it stamped both at (every 64th); the idle spin's rate where fewer than two are.
double steps_clock_ghz(int dir, const long long (&clk)[2][8][4096], const unsigned long long (&ns)[2][4096]) {
  int a = -1, b = -1;
  for (int s = 0; s < 4096; ++s) {
    if (!ns[dir][s] || !clk[dir][0][s]) continue;
    if (a < 0 || clk[dir][0][s] < clk[dir][0][a]) a = s;
    if (b < 0 || clk[dir][0][s] > clk[dir][0][b]) b = s;
  }
  if (a < 0 || a == b || ns[dir][b] <= ns[dir][a]) return g_clock_ghz;
  return static_cast<double>(clk[dir][0][b] - clk[dir][0][a]) / static_cast<double>(ns[dir][b] - ns[dir][a]);
}

void report(int dir, int phases, int T, const char* const* names) {
  static long long clk[2][8][4096];
  static unsigned long long ns[2][4096];
  cudaMemcpyFromSymbol(clk, g_step_clock, sizeof(clk));
  cudaMemcpyFromSymbol(ns, g_step_ns, sizeof(ns));
  const double ghz = steps_clock_ghz(dir, clk, ns);
  double sum[8] = {0};
  int n = 0;
  for (int s = 10; s < T - 10; ++s, ++n)
    for (int k = 0; k < phases; ++k) {
      long long next = k + 1 < phases ? clk[dir][k + 1][s] : clk[dir][0][dir == 0 ? s + 1 : s - 1];
      sum[k] += static_cast<double>(next - clk[dir][k][s]);
    }
  double total = 0;
  for (int k = 0; k < phases; ++k) total += sum[k] / n;
  printf("  %s step: %.0f cycles (%.2f us at %.2f GHz):", dir ? "backward" : "forward", total, total / (ghz * 1e3), ghz);
  for (int k = 0; k < phases; ++k) printf(" %s %.0f", names[k], sum[k] / n);
  printf("\n");
  // The steps' span (first step's start to the last's, plus one step) in clocks at the SM clock's rate during
  // them, against the launch's time.
  long long lo = LLONG_MAX, hi = 0;
  int stamped = 0;
  for (int s = 0; s < std::min(T, 4096); ++s)
    if (clk[dir][0][s]) lo = std::min(lo, clk[dir][0][s]), hi = std::max(hi, clk[dir][0][s]), ++stamped;
  if (stamped > 1 && g_launch_ms > 0) {
    const double steps_ms = (hi - lo) / (ghz * 1e6) * stamped / (stamped - 1);
    printf("  outside the steps: %.1f us (launch %.3f ms, %d steps %.3f ms at %.3f GHz; idle spin %.3f GHz)\n",
           (g_launch_ms - steps_ms) * 1e3, g_launch_ms, stamped, steps_ms, ghz, g_clock_ghz);
  }
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  {
    double* d;
    cudaMalloc(&d, sizeof(double));
    clock_rate_kernel<<<1, 1>>>(d);
    cudaMemcpy(&g_clock_ghz, d, sizeof(double), cudaMemcpyDeviceToHost);
    cudaFree(d);
  }
  const int H = argc > 1 ? atoi(argv[1]) : 256, B = argc > 2 ? atoi(argv[2]) : 1, nc = argc > 3 ? atoi(argv[3]) : 16;
  const bool lstm = !(argc > 4 && strcmp(argv[4], "gru") == 0);
  const bool bf16 = argc > 5 && strcmp(argv[5], "bf16") == 0;
  const int groups = argc > 6 ? atoi(argv[6]) : 1, Bt = B * groups;
  const Cell cell = lstm ? Cell::kLSTM : Cell::kGRU;
  const Weights wt = bf16 ? Weights::kBF16 : Weights::kFP32;
  const int T = 480, G = lstm ? 4 : 3, hs = (H + nc - 1) / nc, wbytes = bf16 ? 2 : 4;
  printf("%s H=%d B=%d T=%d %s, %d blocks per group, %d groups\n", lstm ? "LSTM" : "GRU", H, B, T, bf16 ? "bf16" : "fp32",
         nc, groups);
  Geometry g{Bt, T, H, nc, hs, B, B, nc > 1 ? Sync::kCluster : Sync::kLocal, 0};
  const int blocks = nc * groups;
  std::vector<int64_t> lens(Bt, T);
  int64_t* dlens;
  cudaMalloc(&dlens, Bt * 8);
  cudaMemcpy(dlens, lens.data(), Bt * 8, cudaMemcpyHostToDevice);
  float *xp = upload((size_t)Bt * T * G * H, 1), *w = upload((size_t)G * H * H, 0.06f), *bias = upload(G * H, 0.1f);
  float *h0 = upload(Bt * H, 0.5f), *c0 = upload(Bt * H, 0.5f);
  float *y = upload((size_t)Bt * T * H, 0), *hn = upload(Bt * H, 0), *cn = upload(Bt * H, 0);
  float *saved = upload((size_t)Bt * T * 4 * H, 0), *cs = upload((size_t)Bt * T * H, 0);
  const int bt = argc > 7 ? atoi(argv[7]) : B <= 1 ? 1 : B <= 2 ? 2 : B <= 4 ? 4 : 8;
  ForwardArgs fa{g, xp, w, bias, h0, lstm ? c0 : nullptr, dlens, nullptr, y, hn, lstm ? cn : nullptr, saved,
                 lstm ? cs : nullptr, nullptr, nullptr};
  static const char* fnames[] = {"matvec", "wait+sync", "cell+sync", "publish", "arrive", "stores+prefetch", "wait"};
  static const char* bnames[] = {"wait+sync", "sum-in+cell+sync", "matvec+deliver", "arrive", "stores+prefetch", "wait"};
  static const char* fused_names[] = {"products", "cell+send", "stores+prefetch", "wait"};
  const int Kp = (H + 3) / 4 * 4, Kb = 4 * H;
  const bool wide = !bf16 && !fits_fused(G, H, hs, B, bt, nc == 1) && fits_fused(G, H, hs, B, bt, nc == 1, true);
  const bool fused = !bf16 && (wide || fits_fused(G, H, hs, B, bt, nc == 1));
  if (nc > kMaxCluster) {  // the grid kernels
    g.sync = Sync::kGrid;
    cudaDeviceProp p;
    cudaGetDeviceProperties(&p, 0);
    for (int n = 1; n <= Kp / 16; ++n) {
      g.chunk = std::min(Kp, round_up(ceil_div(Kp, n), 16));
      if (GridForwardSmem(g, G, wbytes, bt).total <= static_cast<int>(p.sharedMemPerBlockOptin)) break;
    }
    printf(" grid, h staged %d columns at a time:\n", g.chunk);
    fa.g = g;
    float* fx;
    unsigned* arrivals;
    cudaMalloc(&fx, (size_t)2 * groups * B * Kp * 4);
    cudaMemset(fx, 0, (size_t)2 * groups * B * Kp * 4);
    cudaMalloc(&arrivals, groups * 4);
    fa.xchg = fx, fa.arrivals = arrivals;
    static const char* gf[] = {"stage0", "products", "reduce+sync", "cell", "arrive", "stores+prefetch", "wait"};
    launch(grid_forward_kernel(cell, wt, bt), fa, blocks, nc, GridForwardSmem(g, G, wbytes, bt).total, true, arrivals, groups);
    report(0, 7, T, gf);
    // The planner's choices (rnn.cu, grid_plan).
    const bool regs_pairs = grid_regs_pairs_fit(g, !bf16);
    const GridFwdRegsShape fsh = grid_fwd_regs_shape(g, G, p.sharedMemPerBlockOptin);
    if (regs_pairs && fsh.nr > 0) {
      printf(" W_hh in registers (%d rows x %d chunks per thread, %d warps per row group):\n", fsh.nr, fsh.nm, fsh.nwg);
      static const char* gfr[] = {"stage", "products", "sums+sync", "cell", "arrive", "stores+prefetch", "wait"};
      launch(grid_forward_regs_kernel(cell, fsh.nr, fsh.nm), fa, blocks, nc, GridFwdRegsSmem(g, fsh).total, true, arrivals, groups);
      report(0, 7, T, gfr);
    }
    const GridTf32FwdShape ftsh(G, H, hs);
    if (regs_pairs && ftsh.ks > 0) {
      printf(" TF32 on the tensor cores (%d m-tiles x %d k-steps per warp):\n", ftsh.mt, ftsh.ks);
      static const char* gft[] = {"stage", "mma", "sync", "cell", "arrive", "stores+prefetch", "wait"};
      launch(grid_forward_tf32_kernel(cell, ftsh.mt, ftsh.ks), fa, blocks, nc, GridTf32FwdSmem(g, ftsh).total, true, arrivals, groups);
      report(0, 7, T, gft);
    }
    const GridHalfFwdShape hsh(G, H, hs);
    for (int tagged = 0; regs_pairs && hsh.ks > 0 && tagged < 2; ++tagged) {
      // Both exchanges, whichever the planner would take (half_forward_tagged), each zeroed before each
      // launch as the host zeroes it (a tagged line left from the last launch would carry tags it waits for).
      printf(" W_hh and h in 16 bits, fp16 MMAs (%d m-tiles x %d k16-steps per warp), %s%s:\n", hsh.mt, hsh.ks,
             tagged ? "h in tagged lines" : "h in rows and a barrier", half_forward_tagged(nc, hs, B) == tagged ? " (planned)" : "");
      const size_t hbytes = grid_half_exchange(g, groups, tagged) * 4;
      float* hfx;
      cudaMalloc(&hfx, hbytes);
      ForwardArgs ha = fa;
      ha.xchg = hfx;
      static const char* rows[] = {"stage", "mma", "sync", "cell", "arrive", "stores+prefetch", "wait"};
      static const char* lines[] = {"poll", "mma", "sync", "cell", "lines", "stores+prefetch", "rest"};
      launch(grid_forward_half_kernel(cell, hsh.mt, hsh.ks, tagged), ha, blocks, nc, GridHalfFwdSmem(g, hsh, tagged).total,
             true, arrivals, groups, hfx, hbytes);
      report(0, 7, T, tagged ? lines : rows);
      cudaFree(hfx);
    }
    float *dy = upload((size_t)Bt * T * H, 1), *dgates = upload((size_t)Bt * T * G * H, 0);
    float *dh0 = upload(Bt * H, 0), *dc0 = upload(Bt * H, 0), *dghn = upload((size_t)Bt * T * H, 0);
    float* bx;
    cudaMalloc(&bx, (size_t)2 * groups * nc * B * nc * hs * 4);
    BackwardArgs ba{g, w, y, saved, lstm ? cs : nullptr, h0, lstm ? c0 : nullptr, dlens, nullptr, dy, nullptr, nullptr,
                    dgates, lstm ? nullptr : dghn, dh0, lstm ? dc0 : nullptr, bx, arrivals};
    static const char* gb[] = {"gather", "cell+sync", "products+partials", "arrive", "stores+prefetch", "wait"};
    launch(grid_backward_kernel(cell, wt, bt), ba, blocks, nc, GridBackwardSmem(g, G, wbytes, bt).total, true, arrivals, groups);
    report(1, 6, T, gb);
    const GridRegsShape sh(G, H, hs);
    if (regs_pairs && sh.nr > 0) {
      printf(" W_hh^T in registers (%d rows per thread, %d row groups):\n", sh.nr, sh.ng);
      float* rx;
      cudaMalloc(&rx, grid_owned_exchange(g, groups, nc * sh.ng) * 4);
      ba.xchg = rx;
      launch(grid_backward_regs_kernel(cell, sh.nr), ba, blocks, nc, grid_regs_smem(g, sh).total, true, arrivals, groups);
      report(1, 6, T, gb);
    }
    // The backward in 16 bits on its own blocks (16 units each, 32, 48 or 64 of them), the same groups.
    const int hnc = grid_half_backward_blocks(H);
    const GridHalfBwdShape hbsh(kHalfBwdUnits, hnc, B);
    if (hnc > 0 && hbsh.sb > 0 && hnc * groups <= p.multiProcessorCount) {
      printf(" W_hh and the gate gradients in 16 bits, fp16 MMAs (%d blocks, %d source blocks a warp):\n", hnc, hbsh.sb);
      Geometry hg = g;
      hg.nc = hnc, hg.hs = kHalfBwdUnits;
      float* hx;
      const size_t bytes = grid_half_backward_exchange(hg, G, groups) * 4;
      cudaMalloc(&hx, bytes);
      cudaMemset(hx, 0, bytes);
      BackwardArgs hb = ba;
      hb.g = hg, hb.xchg = hx, hb.arrivals = arrivals;
      static const char* gbh[] = {"stage+mma+sync", "cell+sync", "publish", "arrive", "stores+prefetch", "wait"};
      launch(grid_backward_half_kernel(cell, hbsh.sb), hb, hnc * groups, hnc, GridHalfBwdSmem(hg, G).total, true, arrivals, groups);
      report(1, 6, T, gbh);
      if (half_backward_scatter(hnc, B)) {  // the planner's kernel there; its lines zeroed before each launch
        printf(" the same by reduce-scatter, partial dh in tagged lines, no barrier (planned):\n");
        const size_t sbytes = grid_half_scatter_exchange(hg, groups) * 4;
        float* sx;
        cudaMalloc(&sx, sbytes);
        hb.xchg = sx;
        static const char* gbs[] = {"poll+sum+sync", "cell+sync", "mma+lines", "-", "stores+prefetch", "-"};
        launch(grid_backward_half_scatter_kernel(cell, hbsh.sb), hb, hnc * groups, hnc, GridHalfScatterSmem(hg, G).total, true,
               arrivals, groups, sx, sbytes);
        report(1, 6, T, gbs);
        cudaFree(sx);
      }
    }
    return 0;
  }
  for (bool f : {false, true}) {
    if (f && !fused) continue;
    if (f) printf(wide ? " fused (wide):\n" : " fused:\n");
    launch(forward_kernel(cell, wt, bt, f, nc == 1, wide), fa, blocks, nc, f ? FusedSmem(g, Kp, bt).total : ForwardSmem(g, G, wbytes, bt).total);
    report(0, f ? 4 : 7, T, f ? fused_names : fnames);
  }
  float *dy = upload((size_t)Bt * T * H, 1), *dgates = upload((size_t)Bt * T * G * H, 0);
  float *dh0 = upload(Bt * H, 0), *dc0 = upload(Bt * H, 0), *dghn = upload((size_t)Bt * T * H, 0);
  BackwardArgs ba{g, w, y, saved, lstm ? cs : nullptr, h0, lstm ? c0 : nullptr, dlens, nullptr, dy, nullptr, nullptr, dgates,
                  lstm ? nullptr : dghn, dh0, lstm ? dc0 : nullptr, nullptr, nullptr};
  for (bool f : {false, true}) {
    if (f && !fused) continue;
    if (f) printf(wide ? " fused (wide):\n" : " fused:\n");
    launch(backward_kernel(cell, wt, bt, f, nc == 1, wide), ba, blocks, nc,
           f ? FusedSmem(g, Kb, bt).total : BackwardSmem(g, G, wbytes, bt, backward_fields(cell)).total);
    report(1, f ? 4 : 6, T, f ? fused_names : bnames);
  }
  if (!bf16 && fits_scatter(H, hs, B, bt)) {
    static const char* scatter_names[] = {"cell+sync", "products+sync", "sums+send", "wait"};
    printf(" reduce-scatter:\n");
    launch(backward_scatter_kernel(cell, bt), ba, blocks, nc, ScatterSmem(g, bt).total);
    report(1, 4, T, scatter_names);
  }
  return 0;
}
