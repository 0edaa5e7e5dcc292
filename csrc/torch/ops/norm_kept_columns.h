// Internal to the norm ops (norm.cpp, norm_kept_columns.cpp): the columns a norm keeps xhat of,
// where recovering it from y would lose precision (gamma zero, subnormal or tiny against beta).
#pragma once

#include <ATen/core/Tensor.h>

namespace tempo::torch_impl {

inline bool low_precision(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }
// The norms' math type: float64 for float64 data, else float32.
inline at::ScalarType acc_type(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// The slot map the core reads (int32, cols: the index among the kept columns, or -1), from
// kept_cols (norm_kept_columns or norm_kept_slots); checks it. Undefined when no column is kept.
at::Tensor kept_slot(const at::Tensor* kept_cols, int64_t cols, const at::Tensor& like, const char* op);

// The kept columns' xhat a backward reads: rows x kept, math type; checks it.
void check_kept_xhat(const at::Tensor* kept_cols, const at::Tensor* kept_xhat, const c10::SymInt& rows,
                     const at::Tensor& y, const char* op);

}  // namespace tempo::torch_impl
