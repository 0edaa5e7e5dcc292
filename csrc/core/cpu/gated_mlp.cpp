// CPU kernels of the gated MLP's elementwise part: blocks of rows over OpenMP threads, each
// row's columns in a loop written for the auto-vectoriser. act(g) and act'(g) in double
// (gated_mlp_math.h), each output rounded once to the storage type.
#include "tempo/gated_mlp.h"

#include <algorithm>
#include <type_traits>

#include "../math/gated_mlp_math.h"
#include "dispatch.h"

namespace tempo {
namespace {

using math::bf16_t;
using math::fp16_t;

// The double evaluation for 16/32-bit data, the C library's for fp64.
template <Activation A, typename T>
inline math::GateValue<double> gate_value(double x) {
  if constexpr (std::is_same_v<T, double>)
    return math::gate_exact<A>(x);
  else
    return math::gate_fast<A>(x);
}

// Rows per work item: about 16K elements, at least one row.
int64_t rows_per_block(int64_t cols) { return std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(cols, 1)); }

template <Activation A, typename T>
void forward_rows(const GatedMlpForwardParams& p, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = static_cast<const T*>(p.gate) + r * p.gate_stride;
    const T* u = static_cast<const T*>(p.up) + r * p.up_stride;
    T* h = static_cast<T*>(p.h) + r * p.cols;
#pragma omp simd
    for (int64_t c = 0; c < p.cols; ++c) {
      const double f = gate_value<A, T>(math::to_float(g[c])).f;
      math::store(h + c, static_cast<math::acc_t<T>>(f * math::to_float(u[c])));
    }
  }
}

// WithH: h recomputed beside the gradients (a template parameter, so that each loop stays branch-free).
template <Activation A, typename T, bool WithH>
void backward_rows(const GatedMlpBackwardParams& p, int64_t r0, int64_t r1) {
  using Acc = math::acc_t<T>;
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = static_cast<const T*>(p.gate) + r * p.gate_stride;
    const T* u = static_cast<const T*>(p.up) + r * p.up_stride;
    const T* dh = static_cast<const T*>(p.grad_h) + r * p.cols;
    T* dg = static_cast<T*>(p.grad_gate) + r * p.grad_gate_stride;
    T* du = static_cast<T*>(p.grad_up) + r * p.grad_up_stride;
    T* h = WithH ? static_cast<T*>(p.h) + r * p.cols : nullptr;
#pragma omp simd
    for (int64_t c = 0; c < p.cols; ++c) {
      const auto v = gate_value<A, T>(math::to_float(g[c]));
      const double uc = math::to_float(u[c]), dhc = math::to_float(dh[c]);
      math::store(dg + c, static_cast<Acc>(dhc * uc * (v.d1 + v.d2)));
      math::store(du + c, static_cast<Acc>(dhc * v.f));
      if constexpr (WithH) math::store(h + c, static_cast<Acc>(v.f * uc));
    }
  }
}

template <typename Params, typename Rows>
void run_rows(const Params& p, Rows&& rows) {
  const int64_t per = rows_per_block(p.cols);
  const int64_t blocks = (p.rows + per - 1) / per;
  const bool parallel = p.rows * p.cols >= cpu::kParallelMinElems;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t b = 0; b < blocks; ++b) rows(b * per, std::min(p.rows, (b + 1) * per));
}

template <typename F>
Status dispatch(Activation act, DType dtype, F&& f) {
  const bool known = math::by_activation(act, [&](auto a) { math::by_dtype(dtype, [&](auto t) { f(a, t); }); });
  return known ? Status::Ok() : Status::Error("gated_mlp: unknown activation");
}

}  // namespace

Status gated_mlp_forward_cpu(const GatedMlpForwardParams& p) {
  Status s = detail::validate(p);
  if (!s.ok() || p.rows == 0 || p.cols == 0) return s;
  return dispatch(p.act, p.dtype, [&](auto a, auto t) {
    run_rows(p, [&](int64_t r0, int64_t r1) { forward_rows<decltype(a)::value, decltype(t)>(p, r0, r1); });
  });
}

Status gated_mlp_backward_cpu(const GatedMlpBackwardParams& p) {
  Status s = detail::validate(p);
  if (!s.ok() || p.rows == 0 || p.cols == 0) return s;
  return dispatch(p.act, p.dtype, [&](auto a, auto t) {
    constexpr Activation A = decltype(a)::value;
    using T = decltype(t);
    run_rows(p, [&](int64_t r0, int64_t r1) {
      if (p.h)
        backward_rows<A, T, true>(p, r0, r1);
      else
        backward_rows<A, T, false>(p, r0, r1);
    });
  });
}

}  // namespace tempo
