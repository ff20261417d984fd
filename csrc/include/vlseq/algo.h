// Names shared by the CPU and CUDA reduce kernels.
#pragma once

#include <c10/util/Exception.h>

#include <string>

namespace vlseq {

enum class Algo { kAuto, kRoot, kOneShot, kTwoShot, kCopyEngine };

inline Algo parse_algo(const char* op, const std::string& name) {
  if (name == "auto") return Algo::kAuto;
  if (name == "root") return Algo::kRoot;
  if (name == "one_shot") return Algo::kOneShot;
  if (name == "two_shot") return Algo::kTwoShot;
  if (name == "copy_engine") return Algo::kCopyEngine;
  TORCH_CHECK(false, op, ": algo must be one of auto, root, one_shot, two_shot, copy_engine; got \"", name, "\"");
}

}  // namespace vlseq
