#include "peer.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/cuda/PeerToPeerAccess.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdlib>
#include <map>
#include <utility>

namespace vlseq::peer {
namespace {

__global__ void probe_kernel(const int* remote, int* local) { *local = *remote + 1; }

struct PairState {
  bool ok;
  std::string why;
};

std::mutex& cache_mutex() {
  static std::mutex m;
  return m;
}

std::map<std::pair<int, int>, PairState>& cache() {
  static std::map<std::pair<int, int>, PairState> c;
  return c;
}

PairState probe(int dev, int peer) {
  const std::string pair = "cuda:" + std::to_string(dev) + " -> cuda:" + std::to_string(peer);
  const char* env = std::getenv("VLSEQ_DISABLE_P2P");
  if (env != nullptr && std::string(env) == "1") return {false, "VLSEQ_DISABLE_P2P=1"};
  if (!at::cuda::get_p2p_access(static_cast<c10::DeviceIndex>(dev), static_cast<c10::DeviceIndex>(peer))) {
    return {false, "the driver reports no peer access for " + pair};
  }
  // One real load over the link: a known value on `peer`, read by a kernel on `dev`. A one-time
  // host sync is fine here; the ops themselves never sync.
  const int magic = 0x5a17 + 977 * peer;
  at::Tensor remote;
  {
    c10::cuda::CUDAGuard g(peer);
    remote = at::full({1}, magic, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, peer));
    C10_CUDA_CHECK(cudaDeviceSynchronize());
  }
  c10::cuda::CUDAGuard g(dev);
  at::Tensor local = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, dev));
  probe_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream(dev)>>>(remote.data_ptr<int>(), local.data_ptr<int>());
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return {false, "probe kernel failed for " + pair + ": " + cudaGetErrorString(err)};
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  const int got = local.cpu().item<int>();
  if (got != magic + 1) return {false, "a test read over " + pair + " returned a wrong value"};
  return {true, ""};
}

cudaEvent_t device_event(int dev) {
  // One event per device, created once. Reuse is safe because every use (record, then the waits
  // that consume it) happens under op_mutex(), and a wait captures the latest record at call time.
  static std::vector<cudaEvent_t> events;
  if (events.empty()) {
    int n = 0;
    C10_CUDA_CHECK(cudaGetDeviceCount(&n));
    events.assign(n, nullptr);
  }
  if (events[dev] == nullptr) {
    c10::cuda::CUDAGuard g(dev);
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&events[dev], cudaEventDisableTiming));
  }
  return events[dev];
}

}  // namespace

bool can_access(int dev, int peer, std::string* why) {
  if (dev == peer) return true;
  std::lock_guard<std::mutex> lock(cache_mutex());
  auto it = cache().find({dev, peer});
  if (it == cache().end()) it = cache().emplace(std::make_pair(dev, peer), probe(dev, peer)).first;
  if (!it->second.ok && why != nullptr) *why = it->second.why;
  return it->second.ok;
}

bool all_can_access(const std::vector<int>& devs, std::string* why) {
  for (int a : devs)
    for (int b : devs)
      if (!can_access(a, b, why)) return false;
  return true;
}

std::mutex& op_mutex() {
  static std::mutex m;
  return m;
}

void barrier(const std::vector<int>& devs) {
  for (int d : devs) {
    c10::cuda::CUDAGuard g(d);
    C10_CUDA_CHECK(cudaEventRecord(device_event(d), c10::cuda::getCurrentCUDAStream(d)));
  }
  for (int d : devs) {
    c10::cuda::CUDAGuard g(d);
    const cudaStream_t s = c10::cuda::getCurrentCUDAStream(d);
    for (int e : devs)
      if (e != d) C10_CUDA_CHECK(cudaStreamWaitEvent(s, device_event(e), 0));
  }
}

void wait_for(int waiter, int producer) {
  if (waiter == producer) return;
  {
    c10::cuda::CUDAGuard g(producer);
    C10_CUDA_CHECK(cudaEventRecord(device_event(producer), c10::cuda::getCurrentCUDAStream(producer)));
  }
  c10::cuda::CUDAGuard g(waiter);
  C10_CUDA_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(waiter), device_event(producer), 0));
}

}  // namespace vlseq::peer
