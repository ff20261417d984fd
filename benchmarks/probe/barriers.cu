// Per-step floor of the persistent kernels on this GPU: what one step's synchronisation costs
// alone (cluster barrier with and without distributed-shared-memory stores, the grid barrier on a
// global counter, __syncthreads), timed with CUDA events over many steps.
#include <cooperative_groups.h>
#include <cstdio>
namespace cg = cooperative_groups;

__global__ void sync_only(int steps) {
  for (int s = 0; s < steps; ++s) __syncthreads();
}

__global__ void cluster_only(int steps, int stores) {
  extern __shared__ float buf[];
  cg::cluster_group cl = cg::this_cluster();
  cl.sync();
  for (int s = 0; s < steps; ++s) {
    if (stores) {
      for (int e = threadIdx.x; e < stores; e += blockDim.x) {
        float* to = cl.map_shared_rank(buf, e % cl.num_blocks());
        to[(s & 1) * 1024 + (e / cl.num_blocks()) % 1024] = s;
      }
    }
    cl.sync();
  }
}

__device__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__global__ void grid_only(int steps, unsigned* counter, float* sink) {
  for (int s = 0; s < steps; ++s) {
    if (sink) sink[blockIdx.x * blockDim.x + threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(counter, 1u);
      while (load_acquire(counter) < (s + 1) * gridDim.x) {}
      __threadfence();
    }
    __syncthreads();
  }
}

__global__ void global_store_then_cluster(int steps, float* sink) {
  cg::cluster_group cl = cg::this_cluster();
  for (int s = 0; s < steps; ++s) {
    sink[blockIdx.x * blockDim.x + threadIdx.x] = s;
    cl.sync();
  }
}

template <typename F>
float time_ms(F launch) {
  cudaEvent_t a, b;
  cudaEventCreate(&a); cudaEventCreate(&b);
  launch();
  cudaEventRecord(a);
  for (int i = 0; i < 5; ++i) launch();
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms; cudaEventElapsedTime(&ms, a, b);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) printf("error %s\n", cudaGetErrorString(e));
  return ms / 5;
}

int main() {
  setvbuf(stdout, nullptr, _IONBF, 0);
  const int steps = 10000;
  unsigned* counter; float* sink;
  cudaMalloc(&counter, 4); cudaMalloc(&sink, 1 << 24);
  printf("__syncthreads, 256 threads: %.3f us/step\n", time_ms([&] { sync_only<<<1, 256>>>(steps); }) * 1e3 / steps);
  for (int nc : {2, 4, 8, 16}) {
    cudaFuncSetAttribute(cluster_only, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    cudaFuncSetAttribute(global_store_then_cluster, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    for (int stores : {0, 256, 4096}) {
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(nc); cfg.blockDim = dim3(256); cfg.dynamicSmemBytes = 8192;
      cudaLaunchAttribute at; at.id = cudaLaunchAttributeClusterDimension; at.val.clusterDim = {unsigned(nc), 1, 1};
      cfg.attrs = &at; cfg.numAttrs = 1;
      float ms = time_ms([&] { cudaLaunchKernelEx(&cfg, cluster_only, steps, stores); });
      printf("cluster %2d, %4d DSMEM stores per step: %.3f us/step\n", nc, stores, ms * 1e3 / steps);
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(nc); cfg.blockDim = dim3(256);
    cudaLaunchAttribute at; at.id = cudaLaunchAttributeClusterDimension; at.val.clusterDim = {unsigned(nc), 1, 1};
    cfg.attrs = &at; cfg.numAttrs = 1;
    float ms = time_ms([&] { cudaLaunchKernelEx(&cfg, global_store_then_cluster, steps, sink); });
    printf("cluster %2d, a global store per thread then the barrier: %.3f us/step\n", nc, ms * 1e3 / steps);
  }
  for (int blocks : {16, 64, 128, 132}) {
    for (int st : {0, 1}) {
      float ms = time_ms([&] {
        cudaMemset(counter, 0, 4);
        void* args[] = {(void*)&steps, (void*)&counter, (void*)(st ? &sink : nullptr)};
        float* none = nullptr;
        if (!st) args[2] = &none;
        cudaLaunchCooperativeKernel((void*)grid_only, blocks, 256, args, 0, 0);
      });
      printf("grid barrier, %3d blocks%s: %.3f us/step\n", blocks, st ? " (+ a global store per thread)" : "",
             ms * 1e3 / steps);
    }
  }
  return 0;
}
