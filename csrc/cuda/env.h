// The VLSEQ_* environment variables the C++ code reads, one function each; nothing else in csrc
// calls getenv. docs/environment.md lists every variable the repository reads.
#pragma once

#include <cstdint>

namespace vlseq::env {

// VLSEQ_DISABLE_P2P=1: every device pair reports no peer access, so the multi-GPU ops take their
// copy-engine paths. Read when a pair is first probed (once per pair and process).
bool disable_p2p();

// VLSEQ_ROOT_MAX_BYTES=<n>: algo="auto" uses root up to n bytes per buffer and two_shot above.
// -1 when unset or not a non-negative integer (the built-in crossover applies). Read once.
int64_t root_max_bytes();

}  // namespace vlseq::env
