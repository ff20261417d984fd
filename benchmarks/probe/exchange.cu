// The per-step all-gather of the cluster kernels (each of nc blocks sends its H/nc floats of h to
// every block of the cluster), three ways, with the data of each step depending on the last:
//   scalar   the kernel's pattern in run 9: a warp per destination, one float per lane, st.shared::cluster,
//            then barrier.cluster.arrive.release / wait.acquire;
//   vector   the same stores as float4 (a quarter of the store instructions), same barrier;
//   async    st.async float4 stores that count their bytes on the receiver's mbarrier; each block
//            waits only for its own bytes (no cluster barrier in the loop).
// Prints us per step and whether every block received what every other block sent.
#include <cooperative_groups.h>
#include <cstdint>
#include <cstdio>
namespace cg = cooperative_groups;

enum Mode { kScalar = 0, kVector = 1, kAsync = 2 };

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ uint32_t peer_addr(uint32_t local, int rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(local), "r"(rank));
  return r;
}

__device__ __forceinline__ bool try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}

// buf: [2][H] received h; own: this block's hs values. errors: count of wrong values seen.
__global__ void exchange(int mode, int steps, int H, int check, unsigned* errors) {
  __shared__ __align__(16) float buf[2][1024];
  __shared__ __align__(16) float own[1024];
  __shared__ __align__(8) uint64_t bars[2];
  cg::cluster_group cl = cg::this_cluster();
  const int nc = cl.num_blocks(), rank = cl.block_rank(), hs = H / nc, tid = threadIdx.x;
  for (int j = tid; j < hs; j += blockDim.x) own[j] = rank * hs + j;
  if (tid == 0) {
    for (int p = 0; p < 2; ++p) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(&bars[p])));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  cl.sync();
  unsigned bad = 0;
  for (int s = 0; s < steps; ++s) {
    const int p = s & 1;
    if (mode == kAsync) {
      if (tid == 0) {
        uint64_t state;  // the arrival token, unused: this block waits by phase parity
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;\n"
                     : "=l"(state) : "r"(smem_addr(&bars[p])), "r"(H * 4) : "memory");
        (void)state;
      }
      const int per_dst = hs / 4;
      if (tid < nc * per_dst) {
        const int dst = tid / per_dst, c = tid - dst * per_dst;
        const float4 v = *reinterpret_cast<const float4*>(own + 4 * c);
        const uint32_t to = peer_addr(smem_addr(&buf[p][rank * hs + 4 * c]), dst);
        const uint32_t bar = peer_addr(smem_addr(&bars[p]), dst);
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n"
                     ::"r"(to), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar) : "memory");
      }
      while (!try_wait(smem_addr(&bars[p]), (s >> 1) & 1)) {
      }
    } else {
      if (mode == kScalar) {
        for (int dst = tid / 32; dst < nc; dst += blockDim.x / 32) {
          float* to = cl.map_shared_rank(&buf[p][0], dst);
          for (int j = tid % 32; j < hs; j += 32) to[rank * hs + j] = own[j];
        }
      } else {
        const int per_dst = hs / 4;
        if (tid < nc * per_dst) {
          const int dst = tid / per_dst, c = tid - dst * per_dst;
          float4* to = reinterpret_cast<float4*>(cl.map_shared_rank(&buf[p][rank * hs], dst));
          to[c] = *reinterpret_cast<const float4*>(own + 4 * c);
        }
      }
      asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
      asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    }
    // The next values depend on what arrived: h_t = f(h_{t-1} of every block).
    if (check)
      for (int k = tid; k < H; k += blockDim.x) bad += buf[p][k] != static_cast<float>(k + s);
    __syncthreads();
    for (int j = tid; j < hs; j += blockDim.x) own[j] = buf[p][rank * hs + j] + 1.0f;
    __syncthreads();
  }
  cl.sync();  // no block leaves while a peer may still store into it
  if (bad) atomicAdd(errors, bad);
}

int main() {
  setvbuf(stdout, nullptr, _IONBF, 0);
  const char* names[] = {"scalar stores + cluster barrier", "float4 stores + cluster barrier",
                         "st.async float4 + mbarrier      "};
  unsigned* errors;
  cudaMalloc(&errors, 4);
  cudaFuncSetAttribute(exchange, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  for (int H : {256, 512}) {
    for (int nc : {4, 8, 16}) {
      for (int mode : {kScalar, kVector, kAsync}) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(nc);
        cfg.blockDim = dim3(256);
        cudaLaunchAttribute at;
        at.id = cudaLaunchAttributeClusterDimension;
        at.val.clusterDim = {unsigned(nc), 1, 1};
        cfg.attrs = &at;
        cfg.numAttrs = 1;
        cudaMemset(errors, 0, 4);
        cudaLaunchKernelEx(&cfg, exchange, mode, 2000, H, 1, errors);
        unsigned bad = 0;
        cudaMemcpy(&bad, errors, 4, cudaMemcpyDeviceToHost);
        const int steps = 20000;
        cudaEvent_t a, b;
        cudaEventCreate(&a);
        cudaEventCreate(&b);
        cudaLaunchKernelEx(&cfg, exchange, mode, steps, H, 0, errors);
        cudaEventRecord(a);
        for (int i = 0; i < 5; ++i) cudaLaunchKernelEx(&cfg, exchange, mode, steps, H, 0, errors);
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        float ms;
        cudaEventElapsedTime(&ms, a, b);
        const cudaError_t e = cudaGetLastError();
        printf("H %4d, cluster %2d, %s: %.3f us/step, %s%s\n", H, nc, names[mode], ms / 5 * 1e3 / steps,
               bad ? "WRONG VALUES" : "values ok", e == cudaSuccess ? "" : cudaGetErrorString(e));
      }
    }
  }
  return 0;
}
