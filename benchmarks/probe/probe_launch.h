// The launch set-up the probes share: `blocks` blocks of `threads`, `smem` bytes of dynamic shared
// memory (the kernel allowed that much and clusters past 8), launched cooperatively and/or in clusters of
// `cluster` blocks. Use it in place: cfg points at its own attributes.
#pragma once
#include <cuda_runtime.h>

struct ProbeLaunch {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute at[2] = {};
  ProbeLaunch(const void* kernel, int blocks, int threads, int smem, bool cooperative, int cluster) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    unsigned n = 0;
    if (cooperative) {
      at[n].id = cudaLaunchAttributeCooperative;
      at[n++].val.cooperative = 1;
    }
    if (cluster > 1) {
      at[n].id = cudaLaunchAttributeClusterDimension;
      at[n++].val.clusterDim = {static_cast<unsigned>(cluster), 1, 1};
    }
    cfg.attrs = at;
    cfg.numAttrs = n;
  }
  ProbeLaunch(const ProbeLaunch&) = delete;
  ProbeLaunch& operator=(const ProbeLaunch&) = delete;
};
