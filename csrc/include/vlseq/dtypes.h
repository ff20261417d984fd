// Element types the ops accept, and the one conversion rule every kernel (CPU and CUDA) uses,
// so both produce the same bits: out = To(OpMath(x) * scale), where OpMath is double when either
// side is double and float otherwise (half types are always widened to float).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>

namespace vlseq {

// Per-tensor type tag carried in kernel tables (mixed dtypes in one launch).
enum DTypeCode : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2, kF64 = 3 };

inline bool is_supported(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

inline DTypeCode dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    default: return kF64;
  }
}

template <typename A, typename B>
using opmath_t = std::conditional_t<std::is_same_v<A, double> || std::is_same_v<B, double>, double, float>;

template <typename To, typename From>
C10_HOST_DEVICE inline To cvt(From x) {
  if constexpr (std::is_same_v<To, From>) {
    return x;
  } else if constexpr (std::is_same_v<From, c10::Half> || std::is_same_v<From, c10::BFloat16>) {
    return static_cast<To>(static_cast<float>(x));
  } else {
    return static_cast<To>(x);
  }
}

}  // namespace vlseq
