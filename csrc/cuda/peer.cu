#include "peer.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/cuda/PeerToPeerAccess.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <utility>

#include "env.h"
#include "vlseq/limits.h"

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

// 0 = not probed yet, 1 = usable, -1 = not usable (reason in failures()). Read without the lock
// on the hot path; written once per pair under it.
std::atomic<int8_t> pair_state[kMaxDevices][kMaxDevices];

std::map<std::pair<int, int>, std::string>& failures() {
  static std::map<std::pair<int, int>, std::string> f;
  return f;
}

PairState probe(int dev, int peer) {
  const std::string pair = "cuda:" + std::to_string(dev) + " -> cuda:" + std::to_string(peer);
  if (env::disable_p2p()) return {false, "VLSEQ_DISABLE_P2P=1"};
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
  static cudaEvent_t events[kMaxDevices] = {};
  check_device_index(dev, "table of per-device events");
  if (events[dev] == nullptr) {
    c10::cuda::CUDAGuard g(dev);
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&events[dev], cudaEventDisableTiming));
  }
  return events[dev];
}

// Each device once, in first-seen order: lists may share a device (reduce_tensors_), and one
// record and one wait per pair of distinct devices order them all.
std::vector<int> distinct(const std::vector<int>& devs) {
  std::vector<int> out;
  for (int d : devs)
    if (std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  return out;
}

}  // namespace

bool can_access(int dev, int peer, std::string* why) {
  if (dev == peer) return true;
  check_device_index(dev, "table of peer-access states");
  check_device_index(peer, "table of peer-access states");
  int8_t state = pair_state[dev][peer].load(std::memory_order_acquire);
  if (state == 0) {
    std::lock_guard<std::mutex> lock(cache_mutex());
    state = pair_state[dev][peer].load(std::memory_order_acquire);
    if (state == 0) {
      const PairState r = probe(dev, peer);
      if (!r.ok) failures()[{dev, peer}] = r.why;
      state = r.ok ? 1 : -1;
      pair_state[dev][peer].store(state, std::memory_order_release);
    }
  }
  if (state < 0 && why != nullptr) {
    std::lock_guard<std::mutex> lock(cache_mutex());
    *why = failures()[{dev, peer}];
  }
  return state > 0;
}

bool all_can_access(const std::vector<int>& devs, std::string* why) {
  const std::vector<int> ds = distinct(devs);
  for (int a : ds)
    for (int b : ds)
      if (!can_access(a, b, why)) return false;
  return true;
}

std::mutex& op_mutex() {
  static std::mutex m;
  return m;
}

// Records must be issued with the stream's device current (cudaErrorInvalidResourceHandle
// otherwise). Devices are visited 0..N-1 for the records and N-1..0 for the waits, so the switch
// between the two phases is free; `guard` restores the caller's device once, at the op's end.
void barrier(const std::vector<int>& all, c10::cuda::OptionalCUDAGuard& guard) {
  const std::vector<int> devs = distinct(all);
  for (int d : devs) {
    guard.set_index(static_cast<c10::DeviceIndex>(d));
    C10_CUDA_CHECK(cudaEventRecord(device_event(d), c10::cuda::getCurrentCUDAStream(d)));
  }
  for (auto it = devs.rbegin(); it != devs.rend(); ++it) {
    guard.set_index(static_cast<c10::DeviceIndex>(*it));
    const cudaStream_t s = c10::cuda::getCurrentCUDAStream(*it);
    for (int e : devs)
      if (e != *it) C10_CUDA_CHECK(cudaStreamWaitEvent(s, device_event(e), 0));
  }
}

void gather(int root, const std::vector<int>& all, c10::cuda::OptionalCUDAGuard& guard) {
  const std::vector<int> devs = distinct(all);
  bool any = false;
  for (int d : devs) {
    if (d == root) continue;
    guard.set_index(static_cast<c10::DeviceIndex>(d));
    C10_CUDA_CHECK(cudaEventRecord(device_event(d), c10::cuda::getCurrentCUDAStream(d)));
    any = true;
  }
  if (!any) return;
  guard.set_index(static_cast<c10::DeviceIndex>(root));
  const cudaStream_t s = c10::cuda::getCurrentCUDAStream(root);
  for (int d : devs)
    if (d != root) C10_CUDA_CHECK(cudaStreamWaitEvent(s, device_event(d), 0));
}

void release(int root, const std::vector<int>& all, c10::cuda::OptionalCUDAGuard& guard) {
  const std::vector<int> devs = distinct(all);
  bool any = false;
  for (int d : devs) any = any || d != root;
  if (!any) return;
  guard.set_index(static_cast<c10::DeviceIndex>(root));
  C10_CUDA_CHECK(cudaEventRecord(device_event(root), c10::cuda::getCurrentCUDAStream(root)));
  for (int d : devs) {
    if (d == root) continue;
    guard.set_index(static_cast<c10::DeviceIndex>(d));
    C10_CUDA_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(d), device_event(root), 0));
  }
}

}  // namespace vlseq::peer
