// What the grid kernels' exchange through L2 costs on its own: one block per SM, every step
// ends with a grid barrier on a counter (as rnn_grid_kernels.cuh's), and between barriers each block moves
// `kib` KiB the way a kernel's step does (LSTM 1024 at 32 samples: 128 KiB):
//   none       the barrier alone
//   same       cp.async.cg 16-byte copies of the same region into shared memory (the forward's staging
//              of h: every block reads all of it)
//   rotate     as same, each block starting at its own offset (spreads the blocks over L2's slices)
//   distinct   as same, each block its own region
//   bulk       the same region by cp.async.bulk (8 KiB copies issued by one thread, an mbarrier)
//   multicast  bulk copies with .multicast::cluster: each block of a cluster of `cluster` blocks
//              issues 1/cluster of them, delivered to all its cluster's blocks
//   write      float4 __stcg stores of a block's own region (the backward's partials), then the barrier
//   gather     the backward's gather: 32-byte pieces (8 units of a sample) from every block's region
//   publish    the grid forward's whole exchange: each block stores its 1/blocks of the region (__stcg), the
//              barrier (its fence waits for those stores), then cp.async.cg of all of it (as same)
//   tagged     the same exchange with no barrier: each block stores its share as 8-byte words of 4 bytes of
//              data and a 4-byte tag (the step), two to a 16-byte store, and every block polls the whole
//              region's words until each carries this step's tag (an aligned 8-byte access is single-copy
//              atomic: data and tag arrive together); twice the bytes, one trip through L2 instead of three.
//              Two buffers by step parity: a block stores step s's share only after reading all of step
//              s - 1's, whose shares each block stored after reading all of step s - 2's (the buffer
//              overwritten), so no reader is still on it.
// Usage: l2_exchange mode [blocks=128] [kib=128] [steps=200] [cluster=1]
// Prints microseconds and clocks per step (median of the blocks' own clocks) and the data rate.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "probe_launch.h"

enum Mode { kNone, kSame, kRotate, kDistinct, kBulk, kMulticast, kWrite, kGather, kPublish, kTagged };
constexpr int kThreads = 256;

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
    unsigned v;
    do asm volatile("ld.acquire.gpu.u32 %0, [%1];\n" : "=r"(v) : "l"(counter) : "memory");
    while (v < target);
  }
  __syncthreads();
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wait_parity(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}

__global__ void __launch_bounds__(kThreads, 1)
    exchange(int mode, int bytes, int steps, int csize, const float* src, float* dst, unsigned* counter,
             long long* clocks, float* sink) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t bar;
  const int tid = threadIdx.x, nb = gridDim.x, rank = blockIdx.x % csize;
  const int n16 = bytes / 16;
  if (tid == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(&bar)));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (mode == kMulticast) cluster_sync();
  grid_barrier(counter, nb);
  const long long t0 = clock64();
  float keep = 0.0f;
  for (int s = 0; s < steps; ++s) {
    const char* from = reinterpret_cast<const char*>(src);
    if (mode == kPublish) {  // this block's 1/blocks of the region, the barrier, then staged as same
      float4* to = reinterpret_cast<float4*>(dst);
      const int per = n16 / nb;
      for (int e = tid; e < per; e += kThreads) __stcg(to + blockIdx.x * per + e, make_float4(s, e, 1.0f, 2.0f));
      grid_barrier(counter, static_cast<unsigned>(nb) * (s + 2));
      from = reinterpret_cast<const char*>(dst);
    }
    if (mode == kSame || mode == kRotate || mode == kDistinct || mode == kPublish) {
      if (mode == kDistinct) from += static_cast<int64_t>(blockIdx.x) * bytes;
      const int shift = mode == kRotate ? (blockIdx.x * (n16 / nb)) : 0;
      for (int e = tid; e < n16; e += kThreads) {
        const int k = (e + shift) % n16;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem + 16 * k)), "l"(from + 16 * k)
                     : "memory");
      }
      asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
    } else if (mode == kBulk || mode == kMulticast) {
      constexpr int kPiece = 8192;
      const int pieces = bytes / kPiece;
      if (tid == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(&bar)), "r"(bytes) : "memory");
        for (int p = (mode == kMulticast ? rank : 0); p < pieces; p += (mode == kMulticast ? csize : 1)) {
          if (mode == kBulk)
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                         ::"r"(smem_u32(smem + p * kPiece)), "l"(from + p * kPiece), "r"(kPiece), "r"(smem_u32(&bar))
                         : "memory");
          else
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;\n"
                ::"r"(smem_u32(smem + p * kPiece)), "l"(from + p * kPiece), "r"(kPiece), "r"(smem_u32(&bar)),
                "h"(static_cast<unsigned short>((1u << csize) - 1)) : "memory");
        }
      }
      wait_parity(smem_u32(&bar), s & 1);
      // No block's next copies may land in a peer's buffer before that peer has read this step's.
      if (mode == kMulticast) cluster_sync();
    } else if (mode == kWrite) {
      float4* to = reinterpret_cast<float4*>(dst + static_cast<int64_t>(blockIdx.x) * (bytes / 4));
      for (int e = tid; e < n16; e += kThreads) __stcg(to + e, make_float4(s, e, 1.0f, 2.0f));
    } else if (mode == kTagged) {
      // Block q's share: tagged lines [q * per, (q + 1) * per) of the step's buffer.
      const int lines = 2 * n16, per = lines / nb;
      const unsigned tag = s + 1;  // the buffers start zeroed: no word carries a tag before it is stored
      uint4* buf = reinterpret_cast<uint4*>(dst) + static_cast<int64_t>(s & 1) * lines;
      for (int e = tid; e < per; e += kThreads)
        asm volatile("st.relaxed.gpu.global.v4.u32 [%0], {%1, %2, %3, %2};\n" ::"l"(buf + blockIdx.x * per + e),
                     "r"(__float_as_uint(static_cast<float>(s))), "r"(tag), "r"(static_cast<unsigned>(e)) : "memory");
      for (int e = tid; e < lines; e += kThreads) {
        uint4 v;
        do asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(buf + e) : "memory");
        while (v.y != tag || v.w != tag);
        reinterpret_cast<uint2*>(smem)[e] = make_uint2(v.x, v.z);
      }
      __syncthreads();
    } else if (mode == kGather) {
      // Sample b's 8 units of this block from every block q: 32 bytes at region q, row b.
      const int samples = bytes / (32 * nb);
      const int row = 8 * nb;  // floats of a sample's row in a region (every block's 8 units)
      float4 acc = make_float4(0, 0, 0, 0);
      for (int e = tid; e < samples * nb * 2; e += kThreads) {
        const int half = e & 1, q = (e >> 1) % nb, b = (e >> 1) / nb;
        const float4 v = __ldcg(reinterpret_cast<const float4*>(
            src + static_cast<int64_t>(q) * samples * row + b * row + 8 * blockIdx.x + 4 * half));
        acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
      }
      keep += acc.x + acc.y + acc.z + acc.w;
    }
    if (mode != kNone && mode != kWrite && mode != kGather) keep += reinterpret_cast<const float*>(smem)[tid];
    if (mode != kPublish && mode != kTagged) grid_barrier(counter, static_cast<unsigned>(nb) * (s + 2));
  }
  if (tid == 0) clocks[blockIdx.x] = clock64() - t0;
  if (keep == 12345.0f) sink[blockIdx.x] = keep;
  if (mode == kMulticast) cluster_sync();
}

int main(int argc, char** argv) {
  const char* names[] = {"none", "same", "rotate", "distinct", "bulk", "multicast", "write", "gather", "publish", "tagged"};
  int mode = -1;
  for (int m = 0; m < 10; ++m)
    if (argc > 1 && !strcmp(argv[1], names[m])) mode = m;
  if (mode < 0) {
    fprintf(stderr, "usage: l2_exchange none|same|rotate|distinct|bulk|multicast|write|gather|publish|tagged [blocks] [kib] [steps] [cluster]\n");
    return 2;
  }
  const int blocks = argc > 2 ? atoi(argv[2]) : 128, bytes = (argc > 3 ? atoi(argv[3]) : 128) * 1024;
  const int steps = argc > 4 ? atoi(argv[4]) : 200, csize = mode == kMulticast && argc > 5 ? atoi(argv[5]) : 1;
  // (tagged: two buffers of twice the bytes, so at least 4 blocks)
  const size_t region = static_cast<size_t>(bytes) * std::max(blocks, 4);
  float *src, *dst, *sink;
  unsigned* counter;
  long long* clocks;
  cudaMalloc(&src, region);
  cudaMalloc(&dst, region);
  cudaMalloc(&sink, blocks * 4);
  cudaMalloc(&counter, 4);
  cudaMalloc(&clocks, blocks * 8);
  cudaMemset(src, 0, region);
  const int smem = mode == kNone || mode == kWrite || mode == kGather ? 1024 : bytes;
  ProbeLaunch l(reinterpret_cast<const void*>(exchange), blocks, kThreads, smem, true, csize);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  float best = 1e30f;
  std::vector<long long> cl(blocks);
  for (int rep = 0; rep < 5; ++rep) {
    cudaMemset(counter, 0, 4);
    if (mode == kTagged) cudaMemset(dst, 0, region);  // the last run's tags would match this one's steps
    cudaEventRecord(e0);
    const cudaError_t le = cudaLaunchKernelEx(&l.cfg, exchange, mode, bytes, steps, csize, static_cast<const float*>(src),
                                              dst, counter, clocks, sink);
    cudaEventRecord(e1);
    const cudaError_t se = cudaEventSynchronize(e1);
    if (le != cudaSuccess || se != cudaSuccess) {
      printf("%s: launch %s, run %s\n", names[mode], cudaGetErrorString(le), cudaGetErrorString(se));
      return 1;
    }
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    if (ms < best) {
      best = ms;
      cudaMemcpy(cl.data(), clocks, blocks * 8, cudaMemcpyDeviceToHost);
    }
  }
  std::sort(cl.begin(), cl.end());
  const double us = 1e3 * best / steps, moved = static_cast<double>(bytes) * blocks;
  printf("%-9s blocks %3d cluster %d %4d KiB a block: %7.2f us a step, %7.0f clocks (median block), %6.2f TB/s\n",
         names[mode], blocks, csize, bytes / 1024, us, static_cast<double>(cl[blocks / 2]) / steps,
         mode == kNone ? 0.0 : moved / (us * 1e-6) / 1e12);
  return 0;
}
