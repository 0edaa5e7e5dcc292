// CPU kernels of the q/k/v split: tokens over OpenMP threads, the bias gradient in double column
// sums per group of tokens (the same sums for any thread count).
#include "tempo/qkv_split.h"

#include <algorithm>
#include <vector>

#include "../math/numeric.h"
#include "dispatch.h"

namespace tempo {
namespace {

// One token (b, s) per work item: its 3 heads segments of head_dim contiguous elements go to
// q, k or v at (b, a, s).
template <typename T>
void qkv_split_forward(const QkvSplitForwardParams& p) {
  const int64_t S = p.seq, A = p.heads, D = p.head_dim, tokens = p.batch * S;
  const T* z = static_cast<const T*>(p.z);
  const T* bias = static_cast<const T*>(p.bias);
  T* out[3] = {static_cast<T*>(p.q), static_cast<T*>(p.k), static_cast<T*>(p.v)};
#pragma omp parallel for schedule(static) if (p.numel() >= cpu::kParallelMinElems)
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t b = t / S, s = t % S;
    for (int64_t w = 0; w < 3; ++w)
      for (int64_t a = 0; a < A; ++a) {
        const T* src = z + (t * 3 + w) * A * D + a * D;
        T* dst = out[w] + ((b * A + a) * S + s) * D;
        if (bias) {
          const T* bi = bias + (w * A + a) * D;
#pragma omp simd
          for (int64_t j = 0; j < D; ++j) math::store(dst + j, math::to_float(src[j]) + math::to_float(bi[j]));
        } else {
          std::copy(src, src + D, dst);
        }
      }
  }
}

// The reverse gather, and with a bias each group of tokens (cpu::run_groups) adds the dz it
// writes into its own double column sums, added in group order afterwards: the same sums for
// any thread count.
template <typename T>
void qkv_split_backward(const QkvSplitBackwardParams& p) {
  const int64_t S = p.seq, A = p.heads, D = p.head_dim, tokens = p.batch * S, M = p.cols();
  const T* in[3] = {static_cast<const T*>(p.grad_q), static_cast<const T*>(p.grad_k), static_cast<const T*>(p.grad_v)};
  T* dz = static_cast<T*>(p.grad_z);
  const bool parallel = p.numel() >= cpu::kParallelMinElems && tokens > 1;
  const int64_t groups = cpu::reduction_groups(tokens);
  std::vector<double> parts(p.grad_bias ? static_cast<size_t>(groups) * M : 0, 0.0);
  cpu::run_groups(tokens, parallel, [&](int64_t g, int64_t t0, int64_t t1) {
    double* part = p.grad_bias ? parts.data() + static_cast<size_t>(g) * M : nullptr;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / S, s = t % S;
      for (int64_t w = 0; w < 3; ++w)
        for (int64_t a = 0; a < A; ++a) {
          const T* src = in[w] + ((b * A + a) * S + s) * D;
          T* dst = dz + (t * 3 + w) * A * D + a * D;
          std::copy(src, src + D, dst);
          if (part) {
            double* pc = part + (w * A + a) * D;
#pragma omp simd
            for (int64_t j = 0; j < D; ++j) pc[j] += static_cast<double>(math::to_float(src[j]));
          }
        }
    }
  });
  if (!p.grad_bias) return;
  cpu::add_group_partials(parts, groups, M);
  T* gb = static_cast<T*>(p.grad_bias);
  for (int64_t j = 0; j < M; ++j) math::store(gb + j, static_cast<math::acc_t<T>>(parts[j]));
}

}  // namespace

Status qkv_split_forward_cpu(const QkvSplitForwardParams& p) {
  Status s = detail::validate(p);
  if (!s.ok() || p.numel() == 0) return s;
  math::by_dtype(p.dtype, [&](auto t) { qkv_split_forward<decltype(t)>(p); });
  return Status::Ok();
}

Status qkv_split_backward_cpu(const QkvSplitBackwardParams& p) {
  Status s = detail::validate(p);
  if (!s.ok()) return s;
  if (p.numel() == 0) {
    if (p.grad_bias) {
      const int64_t bytes = p.cols() * (p.dtype == DType::kFloat64 ? 8 : p.dtype == DType::kFloat32 ? 4 : 2);
      std::fill(static_cast<uint8_t*>(p.grad_bias), static_cast<uint8_t*>(p.grad_bias) + bytes, uint8_t{0});
    }
    return s;
  }
  math::by_dtype(p.dtype, [&](auto t) { qkv_split_backward<decltype(t)>(p); });
  return Status::Ok();
}

}  // namespace tempo
