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

inline bool is_supported(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
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
