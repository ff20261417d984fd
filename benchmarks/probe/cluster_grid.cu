// Can the grid layout's kernels run as clusters? They need every block resident at once (their own
// barrier spins on a counter), which a cooperative launch guarantees; clusters would let a cluster's
// blocks share one L2 read of h (multicast) and sum their partials over distributed shared memory
// before writing them. This asks, for one block per SM with the grid kernels' shared memory:
//  - how many clusters of 1, 2, 4 and 8 fit at once (cudaOccupancyMaxActiveClusters);
//  - whether cudaLaunchKernelEx takes the cooperative and the cluster attributes together;
//  - whether such a launch's blocks are all resident (a grid barrier that gives up after ~1 s, so that
//    a launch whose blocks are not all resident reports it instead of hanging), and whether each
//    block reads its cluster partner's shared memory.
// Usage: cluster_grid [blocks] [shared memory KiB]   (default 128 blocks, 200 KiB)
#include <cooperative_groups.h>
#include <cstdio>
#include <cstdlib>

namespace cg = cooperative_groups;

__global__ void grid_and_cluster(unsigned* arrivals, int* bad, int* timeouts) {
  extern __shared__ int smem[];
  cg::cluster_group cluster = cg::this_cluster();
  if (threadIdx.x == 0) smem[0] = static_cast<int>(blockIdx.x);
  cluster.sync();
  // The next block of the cluster wrote its own index into its shared memory.
  const unsigned partner = (cluster.block_rank() + 1) % cluster.num_blocks();
  const int* theirs = cluster.map_shared_rank(smem, partner);
  if (threadIdx.x == 0 && theirs[0] != static_cast<int>(blockIdx.x - cluster.block_rank() + partner)) atomicAdd(bad, 1);
  cluster.sync();  // no block leaves while its partner may still read its shared memory
  if (threadIdx.x == 0) {
    atomicAdd(arrivals, 1u);
    const long long start = clock64();
    while (atomicAdd(arrivals, 0u) < gridDim.x) {
      if (clock64() - start > 2000000000LL) {  // ~1 s at 1.98 GHz
        atomicAdd(timeouts, 1);
        break;
      }
    }
  }
}

int main(int argc, char** argv) {
  const int blocks = argc > 1 ? atoi(argv[1]) : 128, smem = (argc > 2 ? atoi(argv[2]) : 200) * 1024;
  cudaDeviceProp p;
  cudaGetDeviceProperties(&p, 0);
  printf("%s, %d SMs, %zu bytes of shared memory a block at most; %d blocks of 256 threads, %d bytes each\n", p.name,
         p.multiProcessorCount, p.sharedMemPerBlockOptin, blocks, smem);
  cudaFuncSetAttribute(grid_and_cluster, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(grid_and_cluster, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  unsigned* arrivals;
  int *bad, *timeouts;
  cudaMalloc(&arrivals, 4);
  cudaMalloc(&bad, 4);
  cudaMalloc(&timeouts, 4);
  for (int cs : {1, 2, 4, 8}) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(256);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute at[2] = {};
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = cs, at[0].val.clusterDim.y = 1, at[0].val.clusterDim.z = 1;
    at[1].id = cudaLaunchAttributeCooperative;
    at[1].val.cooperative = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    int fit = -1;
    const cudaError_t oe = cudaOccupancyMaxActiveClusters(&fit, grid_and_cluster, &cfg);
    for (int coop = 0; coop < 2; ++coop) {
      cfg.numAttrs = 1 + coop;
      cudaMemset(arrivals, 0, 4);
      cudaMemset(bad, 0, 4);
      cudaMemset(timeouts, 0, 4);
      const cudaError_t le = cudaLaunchKernelEx(&cfg, grid_and_cluster, arrivals, bad, timeouts);
      const cudaError_t se = cudaDeviceSynchronize();
      int nbad = -1, nto = -1;
      cudaMemcpy(&nbad, bad, 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(&nto, timeouts, 4, cudaMemcpyDeviceToHost);
      printf("cluster %d: %d clusters fit (%s); %s launch: %s, then %s; partner reads wrong %d, barrier timeouts %d\n",
             cs, fit, cudaGetErrorString(oe), coop ? "cooperative" : "plain", cudaGetErrorString(le),
             cudaGetErrorString(se), nbad, nto);
      cudaGetLastError();
    }
  }
  return 0;
}
