// CPU kernels of linear_cross_entropy's row passes: rows over OpenMP threads, each row in its
// math type, its sums in double (a row of 128k logits summed in float could lose 1e-2 in the
// worst case; in double, under 1e-12 before the result's rounding), the exponential the
// softmax's own (math::exp_nonpositive, deterministic and vectorisable: ATen's float exp goes
// to MKL's VML on the CPU, whose last bits changed from call to call on one AVX-512 machine).
#include "tempo/linear_cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "../math/numeric.h"
#include "../math/softmax.h"
#include "dispatch.h"

namespace tempo {
namespace {

template <typename T>
void forward(const LinearCrossEntropyForwardParams& p) {
  using Acc = math::acc_t<T>;
  const T* z = static_cast<const T*>(p.logits);
  Acc* lse = static_cast<Acc*>(p.lse);
  Acc* loss = static_cast<Acc*>(p.loss);
  const int64_t V = p.vocab;
  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
#pragma omp parallel for schedule(static) if (p.rows * V >= cpu::kParallelMinElems && p.rows > 1)
  for (int64_t r = 0; r < p.rows; ++r) {
    const T* zr = z + r * V;
    Acc mx = neg_inf;
    for (int64_t j = 0; j < V; ++j) mx = std::max(mx, math::to_float(zr[j]));  // NaN is passed over
    double s = 0.0, zs = 0.0;
    if (mx > neg_inf) {
#pragma omp simd reduction(+ : s, zs)
      for (int64_t j = 0; j < V; ++j) {
        const Acc v = math::to_float(zr[j]);
        s += static_cast<double>(math::exp_shifted<Acc>(v - mx));
        zs += static_cast<double>(v);
      }
    } else {  // every logit -inf: torch's log_softmax gives NaN
      s = std::numeric_limits<double>::quiet_NaN();
    }
    const Acc l = mx + static_cast<Acc>(std::log(s));
    lse[r] = l;
    const int64_t y = p.labels[r];
    if (y == p.ignore_index) {
      loss[r] = Acc(0);
      continue;
    }
    const Acc zy = math::to_float(zr[linear_cross_entropy_label_column(y, V)]);
    const Acc eps = static_cast<Acc>(p.smoothing);
    const Acc mean = static_cast<Acc>(zs / static_cast<double>(V));
    Acc row_loss = -(Acc(1) - eps) * (zy - l);
    // without smoothing no mean term: a row with a -inf logit (a masked token) has a finite loss
    if (eps != Acc(0)) row_loss -= eps * (mean - l);
    loss[r] = row_loss;
  }
}

template <typename T>
void backward(const LinearCrossEntropyBackwardParams& p) {
  using Acc = math::acc_t<T>;
  T* z = static_cast<T*>(p.logits);
  const Acc* lse = static_cast<const Acc*>(p.lse);
  const Acc* scale = static_cast<const Acc*>(p.scale);
  const int64_t V = p.vocab;
  const Acc eps = static_cast<Acc>(p.smoothing);
  const Acc spread = eps / static_cast<Acc>(V), hit = Acc(1) - eps;
#pragma omp parallel for schedule(static) if (p.rows * V >= cpu::kParallelMinElems && p.rows > 1)
  for (int64_t r = 0; r < p.rows; ++r) {
    T* zr = z + r * V;
    const Acc l = lse[r], s = scale[r];
    const int64_t y = linear_cross_entropy_label_column(p.labels[r], V);  // ignored rows: s = 0
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) {
      const Acc g = math::exp_shifted<Acc>(math::to_float(zr[j]) - l) - spread - (j == y ? hit : Acc(0));
      math::store(zr + j, s * g);
    }
  }
}

}  // namespace

Status linear_cross_entropy_forward_cpu(const LinearCrossEntropyForwardParams& p) {
  Status s = detail::validate(p);
  if (!s.ok() || p.rows == 0) return s;
  math::by_dtype(p.dtype, [&](auto t) { forward<decltype(t)>(p); });
  return Status::Ok();
}

Status linear_cross_entropy_backward_cpu(const LinearCrossEntropyBackwardParams& p) {
  Status s = detail::validate(p);
  if (!s.ok() || p.rows == 0) return s;
  math::by_dtype(p.dtype, [&](auto t) { backward<decltype(t)>(p); });
  return Status::Ok();
}

}  // namespace tempo
