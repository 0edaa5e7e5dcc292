// Mapping between ATen scalar types and the core's DType.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "tempo/common.h"

namespace tempo::torch_impl {

inline bool supported_dtype(c10::ScalarType t) {
  return t == c10::kFloat || t == c10::kDouble || t == c10::kBFloat16 || t == c10::kHalf;
}

inline DType to_core_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat:
      return DType::kFloat32;
    case c10::kDouble:
      return DType::kFloat64;
    case c10::kBFloat16:
      return DType::kBFloat16;
    case c10::kHalf:
      return DType::kFloat16;
    default:
      TORCH_CHECK(false, "tempo: unsupported dtype ", t);
  }
}

}  // namespace tempo::torch_impl
