// broadcast_ / broadcast_tensors_ over direct peer stores (NVLink), with a copy-engine fallback.
//
// Protocol (the events and their primitives: all_reduce.cu's file comment, peer.h): gather (no
// destination is still in use by its device's earlier work), one kernel on the source device
// stores into every destination, release (destinations are complete; the source may change).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "entry.h"
#include "job_tables.cuh"
#include "peer.h"

namespace vlseq {

void broadcast_run(const char* op, at::TensorList srcs, at::TensorList dsts) {
  const int64_t P = static_cast<int64_t>(srcs.size());
  const int64_t lists = static_cast<int64_t>(dsts.size()) / P;
  const int root = srcs[0].get_device();
  std::vector<int> devs{root};
  for (int64_t d = 0; d < lists; ++d) {
    const int dev = dsts[d * P].get_device();
    if (std::find(devs.begin(), devs.end(), dev) == devs.end()) devs.push_back(dev);
  }
  std::lock_guard<std::mutex> lock(peer::op_mutex());
  c10::cuda::OptionalCUDAGuard guard;
  std::string why;
  bool direct = true;
  for (int d : devs) direct = direct && peer::can_access(root, d, &why);
  peer::gather(root, devs, guard);
  if (direct) {
    // Up to kMaxRanks destinations per launch, all written by one kernel on the root.
    for (int64_t first = 0; first < lists; first += kMaxRanks) {
      const int64_t count = std::min<int64_t>(kMaxRanks, lists - first);
      std::vector<Job> jobs;
      for (int64_t p = 0; p < P; ++p) {
        if (srcs[p].numel() == 0) continue;
        HostSeg s;
        s.numel = srcs[p].numel();
        s.src[0] = addr(srcs[p]);
        for (int64_t j = 0; j < count; ++j) s.dst[j] = addr(dsts[(first + j) * P + p]);
        add_segment(jobs, srcs[p].scalar_type(), s, 1, static_cast<int>(count), static_cast<int>(count));
      }
      for (const Job& job : jobs) run_on(job, root, 1.0, false, guard);
    }
  } else {
    TORCH_WARN_ONCE("vlseq_ext: ", op, ": peer access unavailable (", why, "); using copy-engine transfers");
    guard.set_index(static_cast<c10::DeviceIndex>(root));
    for (int64_t i = 0; i < static_cast<int64_t>(dsts.size()); ++i) {
      const at::Tensor& src = srcs[i % P];
      if (src.numel() == 0 || dsts[i].data_ptr() == src.data_ptr()) continue;
      C10_CUDA_CHECK(cudaMemcpyPeerAsync(dsts[i].data_ptr(), dsts[i].get_device(), src.data_ptr(), root,
                                         src.numel() * src.element_size(), c10::cuda::getCurrentCUDAStream(root)));
    }
  }
  peer::release(root, devs, guard);
}

}  // namespace vlseq
