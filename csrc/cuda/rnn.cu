// Host side of the persistent recurrent kernels (rnn_kernels.cuh, rnn_fused_kernels.cuh,
// rnn_scatter_kernel.cuh, rnn_grid_kernels.cuh, rnn_grid_tf32_kernels.cuh): the layout of a layer on the
// GPU (plan_layer), the launches, and the outputs.
//
// Layout choice: W_hh (G*H x H) is split over nc blocks by hidden unit. Thread-block clusters of
// nc <= 16 hold it when it fits (fp32: H up to about 440 for an LSTM), and then each cluster
// runs bs samples with no coordination with other clusters: many samples, or many one-sample
// calls on other streams, run side by side. Where a block's share of W_hh fits in registers and its
// samples in one batch tile (fp32, fits_fused), the fused kernels run it; the backward may instead
// be the fused one with a reduce-scatter (fits_scatter), faster from two samples per block on.
// Bigger layers spread over up to one block per SM and synchronise through global memory (kGrid,
// launched cooperatively; rnn_grid_kernels.cuh; with weights "tf32" their products run on the tensor
// cores where a kernel has the shape, rnn_grid_tf32_kernels.cuh). The choice minimises a cost model of
// one step (products, cell, exchange and barrier, in clocks) times the number of waves of groups that
// do not fit on the GPU at once, for the forward and the backward launch each (in clusters they may
// take different layouts; on the grid one for both, but for the kernels with W_hh in 16 bits, which take
// their own); BENCHMARKS.md has what it picks and what that measures.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <tuple>

#include "entry.h"
#include "rnn_grid_tf32_kernels.cuh"

namespace vlseq::rnn {
namespace {

// Product tile width for a batch of nb samples: the smallest of 1, 2, 4, 8 that covers it (wider
// batches take several tiles).
int batch_tile(int nb) { return nb <= 1 ? 1 : nb <= 2 ? 2 : nb <= 4 ? 4 : 8; }

std::mutex g_mutex;  // guards the caches below (several threads issue work for several GPUs)

// Lets `kernel` use all the shared memory a block can have and clusters of 16, once per device.
void prepare(const void* kernel, int device, int smem_optin) {
  static std::set<std::pair<const void*, int>> done;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!done.insert({kernel, device}).second) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
}

// How many groups of nc blocks (each with `smem` bytes) can be resident at once; 0 if none.
int resident_groups(const void* kernel, Sync sync, int nc, int64_t smem, const cudaDeviceProp& p) {
  if (sync == Sync::kCluster) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(nc);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = nc, attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
      (void)cudaGetLastError();  // an unsupported size is an answer, not an error
      return 0;
    }
    return clusters;
  }
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return per_sm * p.multiProcessorCount / nc;
}

// Which kernel runs a direction: the backward has a third, the fused one with a reduce-scatter.
enum class Kernel { kGeneric, kFused, kScatter };

// Clocks of one step in one direction of a cluster or single-block layout, fitted to the step
// timings of benchmarks/probe/step_timing.cu on an H200 (hidden 64-256, LSTM and GRU, 1-16 blocks,
// 1-8 samples per block): the generic kernels and the fused forward to the seventh session's run 2, the
// fused backwards to the eighth session's run 3, within about 12%. The fused forward measures 5-35%
// below it since. A refit of the fused kernels in clusters to the twenty-first session's step timings
// (LSTM and GRU 256 on 8 wide and 16 plain blocks) was tried and reverted: it sent fp32 LSTM 256 at 32
// samples to 3 a block on 8 wide blocks (a faster forward, a slower all-gather backward), whose forward
// + backward measured 1-3% slower than 5 a block on 16 (the reduce-scatter backward) and its training
// step 4.5% slower; and hidden 64 from a single block to clusters (BENCHMARKS.md, twenty-first session).
//   generic   products from shared memory: ~850 + 0.58 per 128 B of W read per batch tile + 3.2 per
//             FMA-clock (the block's FMAs over 128 lanes, samples padded to the tile, counted as an
//             LSTM's: the GRU's three gates take as long as four); the cell, output stores and next
//             step's loads ~1,100; the exchange ~850 plus the floats each block sends (bs * hs to
//             each of nc blocks); the backward's delivery of H * bs partial sums by single-float
//             stores, ~2.2 clocks each past the first sample's;
//   fused     forward ~1,300 plus, per sample, its FMA-clocks, each warp's reads of h and the
//             block's single-float sends (~1 clock each) and ~150 of cell; backward (all-gather)
//             ~720 plus, per sample, twice its FMA-clocks, each warp's reads of the 4 * H gate
//             gradients and the block's float4 sends (single blocks: another ~500); a cluster's wait
//             for its peers, ~300 more per step than a single block's __syncthreads;
//   scatter   backward (reduce-scatter) ~1,900 plus, per sample, twice its FMA-clocks, a float4
//             send per 4 units and ~80: slower than the all-gather at one sample (its two
//             __syncthreads and the sums of the partials are on every step's path), up to 45%
//             faster at eight. Since its sends were made cheaper (twenty-second session) it measures
//             0-27% below this (hidden 64-256, 1-16 blocks, 1-5 samples a block; twenty-third
//             session), but the fused all-gather measures below its own estimate too, and the pair
//             still picks the faster backward at 12 of the 15 shapes timed (the three others cost
//             2-5%). Refitting the scatter alone would pick the slower one at two of them (LSTM 128
//             on 16 blocks and 64 on one, 2 samples a block): not done.
double direction_clocks(bool backward, Kernel kernel, Sync sync, int G, int hs, int H, int bs, int bt, int nc,
                        int wbytes) {
  const bool cluster = sync == Sync::kCluster;
  const double R = G * hs, K = round_up(H, 4), fma = 4.0 * hs * K / 128.0;
  if (kernel == Kernel::kScatter) return 1900.0 + bs * (2.0 * fma + K / 4.0 + 80.0);
  if (kernel == Kernel::kFused) {
    const double sends = cluster ? hs * nc : 0.0, wait = cluster ? 300.0 : 0.0;
    if (!backward) return 1300.0 + wait + bs * (R * K / 128.0 + kWarps * K * 4.0 / 128.0 + sends + 150.0);
    const double per_sample = 4.0 * hs * H / 128.0 + kWarps * 4.0 * H * 4.0 / 128.0 + sends;
    return 720.0 + wait + bs * (2.0 * per_sample + (cluster ? 0.0 : 500.0));
  }
  const double fmas = fma * round_up(bs, bt), wread = R * K * wbytes / 128.0 * ceil_div(bs, bt);
  const double products = 850.0 + 0.58 * wread + 3.16 * fmas, cell = 1100.0 + 50.0 * ceil_div(bs * hs, kThreads);
  const double exchange = cluster ? 850.0 + 0.12 * bs * hs * nc : 300.0 + 150.0 * bs;
  const double forward = products + cell + exchange;
  return backward ? forward + 400.0 + 2.2 * H * (bs - 1) : forward;
}

// Clocks of one step of the grid kernels, forward plus backward (an estimate from their structure, not
// fitted): the products at 128 FMAs a clock or their tiles' shared-memory reads at 128 bytes a clock,
// whichever bounds (with W_hh in registers, `fregs` / `regs`: the FMAs of the rows held, padding
// included, on the threads that hold them; the TF32 forward, `ftf32`: its MMAs); L2 at ~2.9 KB a clock
// for the whole GPU (forward: every block reads every sample's h, under the products; backward: the
// partials written under the products, read after the barrier); ~2,500 a direction for the cell and the
// barrier. The steps measure 2-2.5x
// this (the shared-memory tiles' products run at ~45% of the FMA rate, the register kernels issue about
// half the time: BENCHMARKS.md, eleventh and twelfth sessions), but it ranks the layouts as they
// measured: 128 blocks over 86 for fp32 LSTM 1024 at 32 samples, and for bf16 two groups of 64 blocks
// over one of 128.
struct GridClocks {
  double forward = 0, backward = 0;
};
GridClocks grid_clocks(int G, int hs, int H, int bs, int bt, int nc, int groups, int wbytes, const GridFwdRegsShape* fregs,
                       const GridRegsShape* regs, const GridTf32FwdShape* ftf32) {
  const double R8 = round_up(G * hs, kGridRows), Kp = round_up(H, 4), bsp = round_up(bs, bt);
  const double fma = R8 * Kp * bsp / 128.0;
  const double smem = (R8 / kGridRows) * (bsp / bt) * (Kp / 4.0) * (kGridRows * 4.0 * wbytes + bt * 16.0) / 128.0;
  const double l2 = static_cast<double>(groups) * nc * bs * Kp * 4.0 / 2900.0;
  const double products = std::max(fma, smem);
  // The TF32 kernels: a warp's MMAs, two warps to a scheduler, ~4 clocks each.
  const double tiles = ceil_div(bs, 8);
  const double forward = ftf32   ? 8.0 * ftf32->mt * ftf32->ks * tiles
                         : fregs ? static_cast<double>(fregs->ng) * fregs->nr * fregs->kq * bs / 128.0
                                 : products;
  const double backward = regs ? static_cast<double>(regs->ng) * regs->nr * Kp * bs / 128.0 * kThreads / (regs->nq * regs->ng)
                               : products;
  return {std::max(forward, l2) + 2500.0, backward + l2 + 2500.0};
}
// The tagged exchange's clocks a step in place of a barrier's: ~500, and ~320 for each 16K lines polled (16K: a
// sample of LSTM 1024 on 64 blocks, whose forward measured 3,352 / 3,674 / 4,413 clocks a step at 1 / 2 / 4
// samples against 4,990-5,154 with the barrier: BENCHMARKS.md, thirty-third session).
double tagged_poll_clocks(int nc, int hs, int bs) {
  return 500.0 + static_cast<double>(tagged_lines_polled(nc, hs, bs)) * 320.0 / 16384.0;
}
// The forward with W_hh in 16 bits: its MMAs (~1.4x the TF32 forward's clocks a tile of samples, as
// measured: 1,267-1,405 a tile against 900-1,011, each MMA twice the products) or its staging of the
// group's h in fp16 at an SM's intake, ~42 bytes a clock (what bounded the exchange measured on its own, at
// 16 blocks as at 128: BENCHMARKS.md, twelfth session; the older kernels' estimate above charges L2 for the
// whole GPU instead), and ~2,500 for the cell and barrier, or tagged_poll_clocks with the tagged exchange.
double half_forward_clocks(const GridHalfFwdShape& sh, int H, int nc, int hs, int bs) {
  const double mmas = 11.0 * sh.mt * sh.ks * ceil_div(bs, 8);
  const double intake = static_cast<double>(bs) * round_up(H, 8) * 2.0 / 42.0;
  return std::max(mmas, intake) + (half_forward_tagged(nc, hs, bs) ? tagged_poll_clocks(nc, hs, bs) : 2500.0);
}
// The backward with W_hh and the gate gradients in 16 bits: as the forward's, its MMAs (sb * G a warp and
// tile of samples) or its staging of the group's gate gradients (G * 16 * nc halves a sample).
double half_backward_clocks(const GridHalfBwdShape& sh, int G, int nc, int bs) {
  const double mmas = 11.0 * sh.sb * G * ceil_div(bs, 8);
  const double intake = static_cast<double>(bs) * nc * G * kHalfBwdUnits * 2.0 / 42.0;
  return std::max(mmas, intake) + 2500.0;
}
// By reduce-scatter in tagged lines (half_backward_scatter): its MMAs (the same count) and polls as the tagged
// forward's (tagged_poll_clocks), one after the other. It ranks the kernel first
// where it measured fastest: LSTM 1024 on 64 blocks, 4,281 / 4,731 / 5,291 clocks a step at 1 / 2 / 4 samples a
// group against the all-gather's 5,947-6,196 and the fp32 register backward's 6,136 at one (BENCHMARKS.md,
// thirty-fifth session).
double half_scatter_clocks(const GridHalfBwdShape& sh, int G, int nc, int bs) {
  return 11.0 * sh.sb * G * ceil_div(bs, 8) + tagged_poll_clocks(nc, kHalfBwdUnits, bs);
}

struct Cost {
  double clocks = 0;
  LaunchPlan launch;
  bool ok = false;
  void offer(double c, const LaunchPlan& l) {
    if (!ok || c < clocks) clocks = c, launch = l, ok = true;
  }
};

struct Pair {
  double clocks = 0;
  LaunchPlan forward, backward;
  bool ok = false;
  void offer(double c, const LaunchPlan& f, const LaunchPlan& b) {
    if (!ok || c < clocks) clocks = c, forward = f, backward = b, ok = true;
  }
};

// What cluster_plan found over the block counts it was asked about: the best forward and backward on one
// layout, and the best fused forward on wide blocks and reduce-scatter backward, each on its own layout.
// Only that mixed pair is taken (where it is the cheapest): measured at 32 samples of hidden 256, the wide
// blocks' forward costs 25-42% less a step than the 16-block one and they have no reduce-scatter backward,
// which costs 20-27% less than their all-gather one (BENCHMARKS.md, twenty-first session). Other mixed
// pairs the model ranked first measured slower (GRU 128 at 32 samples, twenty-second session).
struct Choices {
  Pair joint;
  Cost wide_forward, scatter_backward;
  Pair best() const {  // ok false: none
    Pair pair = joint;
    if (wide_forward.ok && scatter_backward.ok)
      pair.offer(wide_forward.clocks + scatter_backward.clocks, wide_forward.launch, scatter_backward.launch);
    return pair;
  }
};

// The launches for nc blocks per group (cluster or local) with the fewest estimated clocks (Choices).
void cluster_plan(Cell cell, Weights precision, int H, int B, int nc, int sms, const cudaDeviceProp& p, int device,
                  Choices& choices) {
  const Weights w = stored_weights(precision);  // no tensor-core kernels here: tf32 runs as fp32
  const int G = num_gates(cell), wbytes = w == Weights::kFP32 ? 4 : 2, F = backward_fields(cell);
  const int hs = ceil_div(H, nc);
  if (ceil_div(H, hs) != nc) return;  // a block would hold no unit
  const Sync sync = nc == 1 ? Sync::kLocal : Sync::kCluster;
  const int64_t optin = static_cast<int64_t>(p.sharedMemPerBlockOptin);
  // Every group count, each with its fewest samples per group (bs rising: the first bs of a count).
  int last_groups = 0;
  for (int bs = 1; bs <= B; ++bs) {
    const int groups = ceil_div(B, bs);
    if (groups == last_groups) continue;
    last_groups = groups;
    if (bs * hs > kThreads * kMaxItems) break;  // the cell phase holds at most kMaxItems pairs per thread
    const int bt = batch_tile(bs);
    const Geometry g{B, 1, H, nc, hs, bs, bs, sync, 0};
    const bool local = sync == Sync::kLocal;
    // The wide kernels where only they hold the block's units (the plain ones need fewer registers).
    const bool wide = w == Weights::kFP32 && !fits_fused(G, H, hs, bs, bt, local) &&
                      fits_fused(G, H, hs, bs, bt, local, true);
    const bool can_fuse = w == Weights::kFP32 && (wide || fits_fused(G, H, hs, bs, bt, local));
    const bool can_scatter = w == Weights::kFP32 && fits_scatter(H, hs, bs, bt);
    const int64_t generic_fwd = ForwardSmem(g, G, wbytes, bt).total, generic_bwd = BackwardSmem(g, G, wbytes, bt, F).total;
    if (!can_fuse && !can_scatter && std::max(generic_fwd, generic_bwd) > optin) break;  // only grows with bs
    // Each kernel that fits: the forward generic or fused (k 0, 1); the backward generic, fused
    // (all-gather) or reduce-scatter (k 2, 3, 4). Its clocks of a step, and its resident groups.
    struct Option {
      LaunchPlan launch;
      double step = 0;
      int resident = 0;
    };
    Option options[5];
    for (int k = 0; k < 5; ++k) {
      const bool backward = k >= 2, fused = k == 1 || k == 3, scatter = k == 4;
      if (fused && !can_fuse) continue;
      if (scatter && !can_scatter) continue;
      const int64_t smem = !backward ? (fused ? FusedSmem(g, round_up(H, 4), bt).total : generic_fwd)
                           : scatter ? ScatterSmem(g, bt).total
                           : fused   ? FusedSmem(g, 4 * H, bt).total
                                     : generic_bwd;
      if (smem > optin) continue;
      const void* kernel = !backward ? forward_kernel(cell, w, bt, fused, local, wide)
                           : scatter ? backward_scatter_kernel(cell, bt)
                                     : backward_kernel(cell, w, bt, fused, local, wide);
      prepare(kernel, device, p.sharedMemPerBlockOptin);
      Option& o = options[k];
      o.resident = std::min(resident_groups(kernel, sync, nc, smem, p), sms / nc);
      const Kernel kind = scatter ? Kernel::kScatter : fused ? Kernel::kFused : Kernel::kGeneric;
      o.step = direction_clocks(backward, kind, sync, G, hs, H, bs, bt, nc, wbytes);
      LaunchPlan& l = o.launch;
      l.sync = static_cast<int>(sync), l.nc = nc, l.hs = hs, l.bs = bs, l.chunk = bs, l.groups = groups, l.bt = bt;
      l.fused = fused, l.scatter = scatter, l.wide = wide && fused, l.smem = smem;
    }
    // The waves of `resident` groups; none within a budget of SMs (the groups past it would take SMs
    // beyond it).
    auto waves = [&](int resident) {
      return resident <= 0 || (sms < p.multiProcessorCount && groups > resident) ? 0 : ceil_div(groups, resident);
    };
    for (int f = 0; f < 2; ++f) {
      for (int b = 2; b < 5; ++b) {
        const int n = waves(std::min(options[f].resident, options[b].resident));
        if (n) choices.joint.offer(n * (options[f].step + options[b].step), options[f].launch, options[b].launch);
      }
    }
    if (wide && waves(options[1].resident))
      choices.wide_forward.offer(waves(options[1].resident) * options[1].step, options[1].launch);
    if (waves(options[4].resident))
      choices.scatter_backward.offer(waves(options[4].resident) * options[4].step, options[4].launch);
  }
}

// A launch of a kernel with W_hh in 16 bits, on a grid layout of its own.
LaunchPlan half_launch(int nc, int hs, int bs, int groups, int64_t smem) {
  LaunchPlan l;
  l.sync = static_cast<int>(Sync::kGrid), l.nc = nc, l.hs = hs, l.bs = bs, l.chunk = bs, l.groups = groups, l.bt = 8;
  l.fused = l.half = true, l.smem = smem;
  return l;
}

// The forward with W_hh in 16 bits on a layout of its own (the forward and the backward share only global
// tensors), where its estimate beats `clocks`, the chosen forward's: 33-64 rows a block (3-4 m-tiles: LSTM
// hidden 1024 on 64 blocks), as many groups as the SMs hold with at least kHalfFwdMinSamples samples each.
// Below that it was slower than the TF32 forward: one sample, LSTM 1024, 5,261 clocks a step on 64 blocks
// against 4,769 on 128; 16 samples a group on 2 x 64 blocks, 7,201 against 9,904 for 32 on 128 (BENCHMARKS.md,
// twenty-fourth session). Its blocks need no multiple of 4 units (that is the backward's float4 sums).
// `min_samples`: 1 where no other forward fits the SMs given (grid_plan). With the tagged exchange
// (half_forward_tagged) it also runs below min_samples, and spread over as many groups as the SMs hold, where
// its estimate wins: LSTM 1024 at one sample measured 3,353 clocks a step on 64 blocks against the TF32
// forward's 4,846 on 128 (0.99 against 1.31 ms a launch), and at 8 samples two groups of 4 tagged on 64
// blocks each 4,524 (1.26 ms) against one group of 8 on 114 blocks with the barrier, 4,928 (1.35 ms;
// BENCHMARKS.md, thirty-fourth session).
constexpr int kHalfFwdMinSamples = 8;
void half_forward_plan(Cell cell, int H, int B, int sms, const cudaDeviceProp& p, int device, LaunchPlan& forward,
                       double clocks, int min_samples = kHalfFwdMinSamples) {
  const int G = num_gates(cell);
  const int64_t optin = static_cast<int64_t>(p.sharedMemPerBlockOptin);
  for (int hs = ceil_div(33, G); G * hs <= 64; ++hs) {
    const GridHalfFwdShape sh(G, H, hs);
    const int nc = ceil_div(H, hs);
    if (sh.ks == 0 || nc > sms || nc <= kMaxCluster || ceil_div(H, nc) != hs) continue;
    // Samples a group: at least min_samples each, or (tagged only) as few as the SMs allow.
    const int packed = ceil_div(B, std::min(sms / nc, std::max(1, B / min_samples))), spread = ceil_div(B, sms / nc);
    for (int i = 0; i < (spread < packed ? 2 : 1); ++i) {
      const int bs = i ? spread : packed, groups = ceil_div(B, bs);
      if (bs * hs > kThreads * kGridRegItems) continue;
      const Geometry g{B, 1, H, nc, hs, bs, bs, Sync::kGrid, 0};
      const bool tagged = half_forward_tagged(nc, hs, bs);
      if ((B < min_samples || i) && !tagged) continue;
      const int64_t smem = GridHalfFwdSmem(g, sh, tagged).total;
      if (smem > optin) continue;
      const void* kernel = grid_forward_half_kernel(cell, sh.mt, sh.ks, tagged);
      prepare(kernel, device, p.sharedMemPerBlockOptin);
      if (resident_groups(kernel, Sync::kGrid, nc, smem, p) < groups) continue;
      const double c = half_forward_clocks(sh, H, nc, hs, bs);
      if (c >= clocks) continue;
      clocks = c;
      forward = half_launch(nc, hs, bs, groups, smem);
    }
  }
}

// The backward with W_hh and the gate gradients in 16 bits on a layout of its own, where its estimate beats
// `clocks`, the chosen backward's: 16 units a block on 32, 48 or 64 blocks, as many groups as the SMs hold,
// at most kHalfBwdMaxSamples samples each, from 2 samples on. Its step measured 30-32% shorter than the TF32
// backward's (gone since) and the fp32 register one's from 2 samples on (LSTM 1024, 2 groups of 16 samples
// on 64 blocks: 11,328 clocks, against 16,235 for 32 on 128; 2 groups of 1: 5,979 against ~6,600), but
// the same at one (5,992 against 5,936), where the fp32 kernel keeps fp32 (BENCHMARKS.md, twenty-sixth
// session). `min_batch`: 1 where no other backward fits the SMs given (grid_plan). Up to 4 samples a group
// (half_backward_scatter) the reduce-scatter kernel runs instead, at any batch, one sample included: 4,281
// clocks a step at one sample of LSTM 1024, where the fp32 kernel took 6,136 (thirty-fifth session).
constexpr int kHalfBwdMinBatch = 2;
void half_backward_plan(Cell cell, int H, int B, int sms, const cudaDeviceProp& p, int device, LaunchPlan& backward,
                        double clocks, int min_batch = kHalfBwdMinBatch) {
  const int G = num_gates(cell), nc = grid_half_backward_blocks(H);
  if (nc == 0 || nc > sms) return;
  const int bs = ceil_div(B, std::min(sms / nc, B)), groups = ceil_div(B, bs);
  const bool scatter = half_backward_scatter(nc, bs);
  if (B < min_batch && !scatter) return;
  const GridHalfBwdShape sh(kHalfBwdUnits, nc, bs);
  if (sh.sb == 0) return;
  const Geometry g{B, 1, H, nc, kHalfBwdUnits, bs, bs, Sync::kGrid, 0};
  const int64_t smem = scatter ? GridHalfScatterSmem(g, G).total : GridHalfBwdSmem(g, G).total;
  if (smem > static_cast<int64_t>(p.sharedMemPerBlockOptin)) return;
  const void* kernel = scatter ? grid_backward_half_scatter_kernel(cell, sh.sb) : grid_backward_half_kernel(cell, sh.sb);
  prepare(kernel, device, p.sharedMemPerBlockOptin);
  const double c = scatter ? half_scatter_clocks(sh, G, nc, bs) : half_backward_clocks(sh, G, nc, bs);
  if (resident_groups(kernel, Sync::kGrid, nc, smem, p) < groups || c >= clocks) return;
  backward = half_launch(nc, kHalfBwdUnits, bs, groups, smem);
}

// The grid plan (W_hh over more than 16 blocks, rnn_grid_kernels.cuh): every group resident at once
// (one block per SM), hs a multiple of 4 (the backward sums its units' partials as float4s), h staged
// in the fewest chunks of columns whose two buffers fit beside W_hh.
void grid_plan(Cell cell, Weights precision, int H, int B, int sms, const cudaDeviceProp& p, int device,
               LayerPlan& best) {
  const Weights w = stored_weights(precision);
  const int G = num_gates(cell), wbytes = w == Weights::kFP32 ? 4 : 2, Kp = round_up(H, 4);
  const bool tf32 = precision == Weights::kTF32;
  const int64_t optin = static_cast<int64_t>(p.sharedMemPerBlockOptin);
  double best_clocks = 0, forward_clocks = 0, backward_clocks = 0;
  for (int hs = 4; hs < Kp; hs += 4) {
    const int nc = ceil_div(H, hs);
    if (nc > sms) continue;
    if (nc <= kMaxCluster) break;  // a cluster holds it (or W_hh fits nowhere, only more so with fewer blocks)
    if (static_cast<int64_t>(round_up(G * hs, kGridRows)) * (Kp + 4) * wbytes > optin) break;  // grows with hs
    const int bs = ceil_div(B, sms / nc), groups = ceil_div(B, bs), bt = batch_tile(bs);
    if (bs * hs > kThreads * kMaxItems || ceil_div(G * hs, kGridRows) * ceil_div(bs, bt) > kThreads) continue;
    Geometry g{B, 1, H, nc, hs, bs, 0, Sync::kGrid, 0};
    int64_t fwd = 0;
    for (int n = 1; n <= Kp / 16 && g.chunk == 0; ++n) {
      g.chunk = std::min(Kp, round_up(ceil_div(Kp, n), 16));
      fwd = GridForwardSmem(g, G, wbytes, bt).total;
      if (fwd > optin) g.chunk = 0;
    }
    if (g.chunk == 0) continue;
    // Each direction with W_hh in registers where the block's rows fit them (fp32): the forward in tf32 on
    // the tensor cores where a kernel has the shape, else with FMAs.
    const bool few_pairs = grid_regs_pairs_fit(g, w == Weights::kFP32);
    const GridTf32FwdShape ftsh(G, H, hs);
    const bool ftf32 = tf32 && few_pairs && ftsh.ks > 0 && GridTf32FwdSmem(g, ftsh).total <= optin;
    const GridFwdRegsShape fsh = few_pairs && !ftf32 ? grid_fwd_regs_shape(g, G, optin) : GridFwdRegsShape(G, H, hs, 0, 0);
    const bool fregs = fsh.nr > 0;
    if (ftf32) fwd = GridTf32FwdSmem(g, ftsh).total;
    if (fregs) fwd = GridFwdRegsSmem(g, fsh).total;
    const GridRegsShape sh(G, H, hs);
    const bool regs = few_pairs && sh.nr > 0;
    const int64_t bwd = regs ? grid_regs_smem(g, sh).total : GridBackwardSmem(g, G, wbytes, bt).total;
    if (bwd > optin) continue;
    const void* fk = ftf32   ? grid_forward_tf32_kernel(cell, ftsh.mt, ftsh.ks)
                     : fregs ? grid_forward_regs_kernel(cell, fsh.nr, fsh.nm)
                             : grid_forward_kernel(cell, w, bt);
    const void* bk = regs ? grid_backward_regs_kernel(cell, sh.nr) : grid_backward_kernel(cell, w, bt);
    prepare(fk, device, p.sharedMemPerBlockOptin);
    prepare(bk, device, p.sharedMemPerBlockOptin);
    const int resident = std::min(resident_groups(fk, Sync::kGrid, nc, fwd, p), resident_groups(bk, Sync::kGrid, nc, bwd, p));
    if (resident < groups) continue;
    const GridClocks est = grid_clocks(G, hs, H, bs, bt, nc, groups, wbytes, fregs ? &fsh : nullptr, regs ? &sh : nullptr,
                                       ftf32 ? &ftsh : nullptr);
    const double clocks = est.forward + est.backward;
    if (best.ok && clocks >= best_clocks) continue;
    best_clocks = clocks, forward_clocks = est.forward, backward_clocks = est.backward;
    LaunchPlan l;  // both directions: one layout, each its kernel
    l.sync = static_cast<int>(Sync::kGrid), l.nc = nc, l.hs = hs, l.bs = bs, l.chunk = g.chunk, l.groups = groups;
    l.bt = bt;
    best.ok = true, best.forward = best.backward = l;
    best.forward.fused = fregs || ftf32, best.forward.tf32 = ftf32, best.forward.smem = fwd;
    best.forward.regs_rows = fsh.nr, best.forward.regs_chunks = fsh.nm;
    best.backward.fused = regs, best.backward.smem = bwd;
  }
  if (best.ok && tf32) {
    half_forward_plan(cell, H, B, sms, p, device, best.forward, forward_clocks);
    half_backward_plan(cell, H, B, sms, p, device, best.backward, backward_clocks);
  } else if (tf32) {
    // W_hh in fp32 fits none of the SMs given (LSTM 1024 within half the GPU, where a two-layer stack is
    // pipelined: vlseq_ext.nn.concurrency): the 16-bit kernels alone, at any batch they hold. At one sample
    // they measured 1-10% slower a step than the fp32 ones on the whole GPU (above), which the layers
    // running at once more than repay (LSTM 1024 x 2: 1.28x; BENCHMARKS.md, twenty-eighth session).
    LaunchPlan f, b;
    const double any = std::numeric_limits<double>::infinity();
    half_forward_plan(cell, H, B, sms, p, device, f, any, 1);
    half_backward_plan(cell, H, B, sms, p, device, b, any, 1);
    if (f.half && b.half) best.ok = true, best.forward = f, best.backward = b;
  }
}

Geometry geometry(const LaunchPlan& plan, const Sizes& z, bool reverse) {
  return Geometry{static_cast<int>(z.B), static_cast<int>(z.T), static_cast<int>(z.H), plan.nc, plan.hs, plan.bs,
                  plan.chunk, static_cast<Sync>(plan.sync), reverse ? 1 : 0};
}

GridRegsShape regs_shape(const LaunchPlan& plan, const Sizes& z) {
  return GridRegsShape(num_gates(z.cell), static_cast<int>(z.H), plan.hs);
}
// The TF32 kernels of the plan's shape (grid_plan chose them only where they exist).
const void* tf32_forward_kernel(const LaunchPlan& plan, const Sizes& z) {
  const GridTf32FwdShape sh(num_gates(z.cell), static_cast<int>(z.H), plan.hs);
  return grid_forward_tf32_kernel(z.cell, sh.mt, sh.ks);
}
const void* half_forward_kernel(const LaunchPlan& plan, const Sizes& z) {
  const GridHalfFwdShape sh(num_gates(z.cell), static_cast<int>(z.H), plan.hs);
  return grid_forward_half_kernel(z.cell, sh.mt, sh.ks, half_forward_tagged(plan.nc, plan.hs, plan.bs));
}
const void* half_backward_kernel(const LaunchPlan& plan, const Sizes& z) {
  const int sb = GridHalfBwdShape(plan.hs, plan.nc, plan.bs).sb;
  return half_backward_scatter(plan.nc, plan.bs) ? grid_backward_half_scatter_kernel(z.cell, sb)
                                                 : grid_backward_half_kernel(z.cell, sb);
}

template <typename Args>
void launch(const void* kernel, const Args& args, const LaunchPlan& plan, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(plan.groups * plan.nc);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = plan.smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr = {};
  if (plan.sync == static_cast<int>(Sync::kCluster)) {
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = plan.nc, attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
  } else {
    attr.id = cudaLaunchAttributeCooperative;  // kGrid: every block resident at once (its barrier needs it)
    attr.val.cooperative = 1;
  }
  cfg.attrs = &attr;
  cfg.numAttrs = plan.sync == static_cast<int>(Sync::kLocal) ? 0 : 1;
  void* params[] = {const_cast<Args*>(&args)};
  C10_CUDA_CHECK(cudaLaunchKernelExC(&cfg, kernel, params));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

const float* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->const_data_ptr<float>() : nullptr;
}

// The fused kernels' grouping of the samples (rnn_fused_kernels.cuh): their indices longest first,
// sorted on the device (no host sync; stable, so the same groups every run). One sample needs none.
at::Tensor samples_by_length(const at::Tensor& lengths, bool fused) {
  return fused && lengths.numel() > 1 ? at::argsort(lengths, /*stable=*/true, /*dim=*/0, /*descending=*/true)
                                      : at::Tensor();
}

// "local 1 blocks x 32 groups, 64 units and 1 samples per block": what vlseq_ext.nn.concurrency reads.
std::string layout_text(const LaunchPlan& l) {
  static const char* names[] = {"local", "cluster", "grid"};
  return std::string(names[l.sync]) + " " + std::to_string(l.nc) + " blocks x " + std::to_string(l.groups) +
         " groups, " + std::to_string(l.hs) + " units and " + std::to_string(l.bs) + " samples per block";
}
std::string kib(int64_t bytes) { return std::to_string(bytes / 1024); }

// A bf16 layer on the tf32 plan (LayerPlan::bf16_as_tf32): that plan, its sizes, and W_hh rounded to bfloat16.
std::tuple<LayerPlan, Sizes, at::Tensor> as_tf32(const LayerPlan& layer, const Sizes& z, const at::Tensor& w_hh) {
  LayerPlan plan = layer;
  plan.bf16_as_tf32 = false;
  Sizes sizes = z;
  sizes.weights = Weights::kTF32;
  return {plan, sizes, w_hh.to(at::kBFloat16).to(at::kFloat)};
}

// The grid kernels of the launches given (f, b: the forward's, the backward's; null: not described here),
// "(forward and backward)" saying which direction each applies to.
std::string grid_kernels_text(const LaunchPlan* f, const LaunchPlan* b) {
  auto which = [](bool fwd, bool bwd) {
    return std::string(" (") + (fwd ? "forward" : "") + (fwd && bwd ? " and " : "") + (bwd ? "backward" : "") + ")";
  };
  const bool fhalf = f && f->half, bhalf = b && b->half, fregs = f && f->fused && !fhalf, bregs = b && b->fused && !bhalf;
  const bool ftf32 = f && f->tf32;
  std::string s = f && !f->fused ? ", h staged " + std::to_string(f->chunk) + " columns at a time" : "";
  if (fregs || bregs) s += ", W_hh in registers" + which(fregs, bregs);
  if (fhalf || bhalf)
    s += std::string(fhalf && bhalf ? ", W_hh, h and the gate gradients" : fhalf ? ", W_hh and h" : ", W_hh and the gate gradients") +
         " in 16 bits, fp16 products on the tensor cores" + which(fhalf, bhalf);
  if (fhalf && half_forward_tagged(f->nc, f->hs, f->bs)) s += ", h passed in tagged lines, no barrier a step (forward)";
  if (bhalf && half_backward_scatter(b->nc, b->bs)) s += ", partial dh passed in tagged lines, no barrier a step (backward)";
  if (ftf32) s += ", TF32 products on the tensor cores (forward)";
  return s;
}

}  // namespace

// One layout: "<layout>, <kernels>, shared memory F/B KiB". Two (a forward and a backward on layouts of
// their own: Choices in clusters, the 16-bit forward on the grid): "<forward layout>, <its kernel>, shared
// memory F KiB; backward: <layout>, <its kernel>, shared memory B KiB" (vlseq_ext.nn.concurrency reads the
// layouts).
std::string LayerPlan::describe() const {
  if (!ok) return "";
  if (bf16_as_tf32) {
    LayerPlan plan = *this;
    plan.bf16_as_tf32 = false;
    return plan.describe() + ", W_hh rounded to bfloat16";
  }
  const LaunchPlan &f = forward, &b = backward;
  const bool grid = f.sync == static_cast<int>(Sync::kGrid);
  if (grid && !f.same_layout(b))
    return layout_text(f) + grid_kernels_text(&f, nullptr) + ", shared memory " + kib(f.smem) + " KiB; backward: " +
           layout_text(b) + grid_kernels_text(nullptr, &b) + ", shared memory " + kib(b.smem) + " KiB";
  if (!f.same_layout(b)) {
    auto kernel = [](const LaunchPlan& l) {
      return l.fused || l.scatter ? std::string(", fused cell and W_hh in registers") +
                                        (l.scatter ? ", by reduce-scatter" : "") + (l.wide ? ", 8 chunks a lane" : "")
                                  : std::string();
    };
    return layout_text(f) + kernel(f) + ", shared memory " + kib(f.smem) + " KiB; backward: " + layout_text(b) +
           kernel(b) + ", shared memory " + kib(b.smem) + " KiB";
  }
  return layout_text(f) + (grid ? grid_kernels_text(&f, &b) : "") +
         (!grid && (f.fused || b.fused || b.scatter)
              ? std::string(", fused cell and W_hh in registers (") + (f.fused ? "forward" : "") +
                    (f.fused && (b.fused || b.scatter) ? " and " : "") + (b.fused || b.scatter ? "backward" : "") + ")" +
                    (b.scatter ? ", the backward by reduce-scatter" : "") + (f.wide || b.wide ? ", 8 chunks a lane" : "")
              : "") +
         ", shared memory " + kib(f.smem) + "/" + kib(b.smem) + " KiB";
}

LayerPlan plan_layer(Cell cell, Weights weights, int64_t hidden, int64_t batch, int device, int64_t max_blocks) {
  if (weights == Weights::kBF16) {  // the tf32 plan where there is one (LayerPlan::bf16_as_tf32)
    LayerPlan plan = plan_layer(cell, Weights::kTF32, hidden, batch, device, max_blocks);
    if (plan.ok) {
      plan.bf16_as_tf32 = true;
      return plan;
    }
  }
  using Key = std::tuple<int, int, int64_t, int64_t, int, int64_t>;
  static std::map<Key, LayerPlan> cache;
  const Key key{static_cast<int>(cell), static_cast<int>(weights), hidden, batch, device, max_blocks};
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  // (ATen/cuda/CUDAContext.h would give cached properties, but it needs the cuSPARSE headers, which
  // a pip-installed CUDA toolkit does not put where the build looks.)
  cudaDeviceProp p;
  LayerPlan plan;
  if (cudaGetDeviceProperties(&p, device) != cudaSuccess) {
    (void)cudaGetLastError();
    plan.why_not = "the properties of CUDA device " + std::to_string(device) + " could not be read";
    return plan;
  }
  if (p.major < 9) {
    plan.why_not = "the kernels need thread-block clusters (compute capability 9.0 or newer); this GPU is " +
                   std::to_string(p.major) + "." + std::to_string(p.minor);
  } else if (hidden > (1 << 16) || batch > (1 << 24)) {
    plan.why_not = "hidden size or batch beyond the kernels' limits";
  } else {
    const int H = static_cast<int>(hidden), B = static_cast<int>(batch);
    // The SMs the plan may use: blocks of every group at once (occupancy below is per SM).
    const int sms = max_blocks > 0 ? static_cast<int>(std::min<int64_t>(max_blocks, p.multiProcessorCount))
                                   : p.multiProcessorCount;
    // A local and a cluster launch are never mixed (Choices: only the measured mixed pair).
    Choices local, clusters;
    cluster_plan(cell, weights, H, B, 1, sms, p, device, local);
    for (int nc : {2, 4, 8, 16}) cluster_plan(cell, weights, H, B, nc, sms, p, device, clusters);
    Pair pair = clusters.best();
    if (local.joint.ok && (!pair.ok || local.joint.clocks <= pair.clocks)) pair = local.joint;
    if (pair.ok) {
      plan.ok = true, plan.forward = pair.forward, plan.backward = pair.backward;
    } else {
      grid_plan(cell, weights, H, B, sms, p, device, plan);
    }
    if (!plan.ok) {
      const int64_t bytes = num_gates(cell) * hidden * hidden * (weights == Weights::kBF16 ? 2 : 4);
      plan.why_not = "W_hh (" + std::to_string(bytes >> 20) + " MiB) does not fit in the shared memory of " +
                     std::to_string(sms) + " blocks";
    }
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  cache.emplace(key, plan);
  return plan;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_run(
    const LayerPlan& layer, const Sizes& z, const at::Tensor& xproj, const at::Tensor& w_hh,
    const std::optional<at::Tensor>& b_hh, const at::Tensor& h0, const std::optional<at::Tensor>& c0,
    const at::Tensor& lengths, bool reverse) {
  if (layer.bf16_as_tf32) {
    const auto [tf32, zt, w] = as_tf32(layer, z, w_hh);
    return forward_run(tf32, zt, xproj, w, b_hh, h0, c0, lengths, reverse);
  }
  c10::cuda::CUDAGuard guard(xproj.device());
  const LaunchPlan& plan = layer.forward;
  const bool lstm = z.cell == Cell::kLSTM;
  const auto opts = xproj.options();
  at::Tensor y = at::zeros({z.B, z.T, z.H}, opts);  // padded steps stay zero
  at::Tensor h_n = at::empty({z.B, z.H}, opts);
  at::Tensor c_n = lstm ? at::empty({z.B, z.H}, opts) : at::empty({0}, opts);
  at::Tensor saved = at::empty({z.B, z.T, 4 * z.H}, opts);  // defined within each sample's length
  at::Tensor cs = lstm ? at::empty({z.B, z.T, z.H}, opts) : at::empty({0}, opts);
  const bool grid = plan.sync == static_cast<int>(Sync::kGrid), local = plan.sync == static_cast<int>(Sync::kLocal);
  at::Tensor xchg, arrivals;
  if (grid) {
    // Rows of round_up(H, 4) floats (16-bit forward: round_up(H, 8) halves) for 16-byte copies; the padding
    // stays zero (nobody writes it). Tagged lines start zero too: no tag a step waits for.
    const int64_t n = plan.half ? grid_half_exchange(geometry(plan, z, reverse), plan.groups,
                                                     half_forward_tagged(plan.nc, plan.hs, plan.bs))
                                : 2 * plan.groups * plan.bs * round_up(static_cast<int>(z.H), 4);
    xchg = at::zeros({n}, opts);
    arrivals = at::zeros({plan.groups}, opts.dtype(at::kInt));
  }
  const at::Tensor order = samples_by_length(lengths, !grid && plan.fused);
  ForwardArgs a{geometry(plan, z, reverse),
                xproj.const_data_ptr<float>(),
                w_hh.const_data_ptr<float>(),
                ptr_or_null(b_hh),
                h0.const_data_ptr<float>(),
                lstm ? c0->const_data_ptr<float>() : nullptr,
                lengths.const_data_ptr<int64_t>(),
                order.defined() ? order.const_data_ptr<int64_t>() : nullptr,
                y.data_ptr<float>(),
                h_n.data_ptr<float>(),
                lstm ? c_n.data_ptr<float>() : nullptr,
                saved.data_ptr<float>(),
                lstm ? cs.data_ptr<float>() : nullptr,
                xchg.defined() ? xchg.data_ptr<float>() : nullptr,
                arrivals.defined() ? reinterpret_cast<unsigned*>(arrivals.data_ptr<int>()) : nullptr};
  const Weights stored = stored_weights(z.weights);
  launch(plan.half               ? half_forward_kernel(plan, z)
         : plan.tf32             ? tf32_forward_kernel(plan, z)
         : grid && plan.fused    ? grid_forward_regs_kernel(z.cell, plan.regs_rows, plan.regs_chunks)
         : grid                  ? grid_forward_kernel(z.cell, stored, plan.bt)
                                 : forward_kernel(z.cell, stored, plan.bt, plan.fused, local, plan.wide),
         a, plan, c10::cuda::getCurrentCUDAStream(xproj.get_device()).stream());
  return {y, h_n, c_n, saved, cs};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_run(
    const LayerPlan& layer, const Sizes& z, const at::Tensor& w_hh, const at::Tensor& y, const at::Tensor& saved,
    const at::Tensor& cs, const at::Tensor& h0, const std::optional<at::Tensor>& c0, const at::Tensor& lengths,
    const std::optional<at::Tensor>& dy, const std::optional<at::Tensor>& dh_n, const std::optional<at::Tensor>& dc_n,
    bool reverse) {
  if (layer.bf16_as_tf32) {
    const auto [tf32, zt, w] = as_tf32(layer, z, w_hh);
    return backward_run(tf32, zt, w, y, saved, cs, h0, c0, lengths, dy, dh_n, dc_n, reverse);
  }
  c10::cuda::CUDAGuard guard(y.device());
  const LaunchPlan& plan = layer.backward;
  const bool lstm = z.cell == Cell::kLSTM;
  const int64_t G = num_gates(z.cell);
  const auto opts = y.options();
  at::Tensor dgates = at::zeros({z.B, z.T, G * z.H}, opts);  // padded steps stay zero
  at::Tensor dgates_hn = lstm ? at::empty({0}, opts) : at::zeros({z.B, z.T, z.H}, opts);
  at::Tensor dh0 = at::empty({z.B, z.H}, opts);
  at::Tensor dc0 = lstm ? at::empty({z.B, z.H}, opts) : at::empty({0}, opts);
  const bool grid = plan.sync == static_cast<int>(Sync::kGrid), local = plan.sync == static_cast<int>(Sync::kLocal);
  at::Tensor xchg, arrivals;
  if (grid) {
    // 16 bits: the groups' gate gradients and their scales (zeroed: every row read was written, but a
    // stray NaN would poison a sum), or the reduce-scatter's tagged lines (zeroed: no tag a step waits for);
    // the register backward: owner-major partials of nc * ng sources.
    const Geometry g = geometry(plan, z, reverse);
    if (plan.half) {
      xchg = at::zeros({half_backward_scatter(plan.nc, plan.bs) ? grid_half_scatter_exchange(g, plan.groups)
                                                                 : grid_half_backward_exchange(g, static_cast<int>(G), plan.groups)},
                       opts);
      arrivals = at::zeros({plan.groups}, opts.dtype(at::kInt));
    } else {
      xchg = at::empty({plan.fused ? grid_owned_exchange(g, plan.groups, plan.nc * regs_shape(plan, z).ng)
                                            : 2 * static_cast<int64_t>(plan.groups) * plan.nc * plan.bs * plan.nc * plan.hs},
                       opts);
      arrivals = at::zeros({plan.groups}, opts.dtype(at::kInt));
    }
  }
  const at::Tensor order = samples_by_length(lengths, !grid && (plan.fused || plan.scatter));
  BackwardArgs a{geometry(plan, z, reverse),
                 w_hh.const_data_ptr<float>(),
                 y.const_data_ptr<float>(),
                 saved.const_data_ptr<float>(),
                 lstm ? cs.const_data_ptr<float>() : nullptr,
                 h0.const_data_ptr<float>(),
                 lstm ? c0->const_data_ptr<float>() : nullptr,
                 lengths.const_data_ptr<int64_t>(),
                 order.defined() ? order.const_data_ptr<int64_t>() : nullptr,
                 ptr_or_null(dy),
                 ptr_or_null(dh_n),
                 ptr_or_null(dc_n),
                 dgates.data_ptr<float>(),
                 lstm ? nullptr : dgates_hn.data_ptr<float>(),
                 dh0.data_ptr<float>(),
                 lstm ? dc0.data_ptr<float>() : nullptr,
                 xchg.defined() ? xchg.data_ptr<float>() : nullptr,
                 arrivals.defined() ? reinterpret_cast<unsigned*>(arrivals.data_ptr<int>()) : nullptr};
  const Weights stored = stored_weights(z.weights);
  launch(plan.half               ? half_backward_kernel(plan, z)
         : grid && plan.fused    ? grid_backward_regs_kernel(z.cell, regs_shape(plan, z).nr)
         : grid                  ? grid_backward_kernel(z.cell, stored, plan.bt)
         : plan.scatter          ? backward_scatter_kernel(z.cell, plan.bt)
                                 : backward_kernel(z.cell, stored, plan.bt, plan.fused, local, plan.wide),
         a, plan, c10::cuda::getCurrentCUDAStream(y.get_device()).stream());
  return {dgates, dgates_hn, dh0, dc0};
}

}  // namespace vlseq::rnn
