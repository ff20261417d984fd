// Peer access and cross-device ordering for the single-process multi-GPU ops.
#pragma once

#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <mutex>
#include <string>
#include <vector>

namespace vlseq::peer {

// True when device `dev` can load and store `peer`'s memory directly. The first query for a pair
// enables access through at::cuda::get_p2p_access (which also maps PyTorch's expandable segments)
// and then proves it with a real read of a known value, because the driver's capability answer
// has been wrong on some systems. VLSEQ_DISABLE_P2P=1 makes every pair answer false.
bool can_access(int dev, int peer, std::string* why);

// True when every ordered pair of `devs` can; otherwise `why` names the first failing pair.
bool all_can_access(const std::vector<int>& devs, std::string* why);

// Serialises the host-side orchestration of the multi-device ops (it reuses one event per device).
std::mutex& op_mutex();

// `devs` may name a device more than once (lists that share a device); the functions below visit
// each distinct device once.

// Every device's current stream waits until every other device's current stream has reached this
// point. Host-side only: records one event per device, then queues the waits; never blocks the CPU.
// Switches devices through `guard` (the op's one guard, which restores the caller's device).
void barrier(const std::vector<int>& devs, c10::cuda::OptionalCUDAGuard& guard);

// `root`'s current stream waits for the work queued so far on every other device's stream.
void gather(int root, const std::vector<int>& devs, c10::cuda::OptionalCUDAGuard& guard);

// Every other device's current stream waits for the work queued so far on `root`'s stream.
void release(int root, const std::vector<int>& devs, c10::cuda::OptionalCUDAGuard& guard);

}  // namespace vlseq::peer
