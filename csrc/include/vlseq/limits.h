// Device-count limits of the ops, in one place. Tables indexed by a device index check it with
// check_device_index instead of trusting that no machine has more devices.
#pragma once

#include <c10/util/Exception.h>

#include <string>

namespace vlseq {

// Lists (devices) one multi-device op combines: a segment row carries this many source and
// destination pointers (csrc/cuda/job_tables.cuh), so one kernel reads or writes at most this many.
constexpr int kMaxRanks = 8;

// CUDA device indices the per-device tables (multiprocessor counts, events, peer-access states)
// have room for.
constexpr int kMaxDevices = 64;

// `table` names the table in the message.
inline void check_device_index(int device, const char* table) {
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "vlseq_ext: cuda:", std::to_string(device),
              " is out of range for the ", table, ", which holds devices 0..", std::to_string(kMaxDevices - 1),
              " (kMaxDevices in csrc/include/vlseq/limits.h)");
}

}  // namespace vlseq
