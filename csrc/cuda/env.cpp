#include "env.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace vlseq::env {

bool disable_p2p() {
  const char* v = std::getenv("VLSEQ_DISABLE_P2P");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

int64_t root_max_bytes() {
  static const int64_t value = [] {
    const char* v = std::getenv("VLSEQ_ROOT_MAX_BYTES");
    if (v == nullptr || *v == '\0') return int64_t{-1};
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(v, &end, 10);
    return *end == '\0' && errno == 0 && n >= 0 ? static_cast<int64_t>(n) : int64_t{-1};
  }();
  return value;
}

}  // namespace vlseq::env
