// CPU kernels of LayerNorm / RMSNorm (and the fused bias-dropout-residual prologue): rows in
// chunks over OpenMP threads. Row statistics and column sums accumulate in double.
#include "tempo/norm.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../math/numeric.h"
#include "../math/philox.h"
#include "dropout_bits.h"

namespace tempo {
namespace {

using math::bf16_t;
using math::fp16_t;

// Rows per chunk: whole mask bytes per chunk (rows * cols a multiple of 8), about 16k elements.
int64_t chunk_rows(int64_t rows, int64_t cols) {
  int64_t unit = 8;
  for (int64_t d = 8; d > 1; d /= 2)
    if (cols % d == 0) {
      unit = 8 / d;
      break;
    }
  int64_t target = std::max<int64_t>(1, (16384 + cols - 1) / cols);
  target = (target + unit - 1) / unit * unit;
  return std::min(target, std::max<int64_t>(rows, 1));
}

template <typename T>
T round_to(math::acc_t<T> v) {
  T out;
  math::store(&out, v);
  return out;
}

// v rounded to T's precision, kept in the math type.
template <typename T>
math::acc_t<T> round_to_acc(math::acc_t<T> v) {
  return math::to_float(round_to<T>(v));
}

// Keep bits of the elements of rows [r0, r1): from the stored mask, or drawn (and stored in
// bits mode). Returns null when there is no dropout.
const uint8_t* chunk_bits(bool enabled, const NormPrologue& pr, uint8_t* mask_out, const uint8_t* mask_in, int64_t e0,
                          int64_t e1, std::vector<uint8_t>& local) {
  if (!enabled || pr.p <= 0.0) return nullptr;
  if (mask_in) return mask_in + e0 / 8;
  uint8_t* dst = mask_out ? mask_out + e0 / 8 : nullptr;
  if (!dst) {
    local.resize(static_cast<size_t>((e1 - e0 + 7) / 8));
    dst = local.data();
  }
  cpu::keep_bits(pr.rng, math::keep_threshold(pr.p), e0, static_cast<int>(e1 - e0), dst);
  return dst;
}

template <typename T>
void forward_chunk(const NormForwardParams& p, int64_t r0, int64_t r1, std::vector<math::acc_t<T>>& h,
                   std::vector<uint8_t>& local) {
  using Acc = math::acc_t<T>;
  const int64_t M = p.cols;
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.weight);
  const T* b = static_cast<const T*>(p.bias);
  const T* res = static_cast<const T*>(p.prologue.residual);
  const T* pb = static_cast<const T*>(p.prologue.bias);
  T* y = static_cast<T*>(p.y);
  Acc* rstd_out = static_cast<Acc*>(p.rstd);
  const uint8_t* bits = chunk_bits(p.prologue.residual != nullptr, p.prologue, p.mask, nullptr, r0 * M, r1 * M, local);
  const DropoutScale scale(p.prologue.p);
  h.resize(static_cast<size_t>(M));
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * M;
    if (res) {
      // h = residual + dropout(x + pre_bias), rounded to T as the unfused sequence stores it.
      const T* rr = res + r * M;
      const int64_t base = (r - r0) * M;
      for (int64_t j = 0; j < M; ++j) {
        Acc v = round_to_acc<T>(math::to_float(xr[j]) + (pb ? math::to_float(pb[j]) : Acc(0)));
        if (bits) {
          const int64_t e = base + j;
          v = round_to_acc<T>(scale.apply(v, ((bits[e >> 3] >> (e & 7)) & 1) != 0));
        }
        h[j] = round_to_acc<T>(math::to_float(rr[j]) + v);
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < M; ++j) h[j] = math::to_float(xr[j]);
    }
    double mean = 0.0;
    if (p.kind == NormKind::kLayerNorm) {
      double s = 0.0;
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < M; ++j) s += static_cast<double>(h[j]);
      mean = s / static_cast<double>(M);
    }
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < M; ++j) {
      const double d = static_cast<double>(h[j]) - mean;
      ss += d * d;
    }
    const double rstd_d = 1.0 / std::sqrt(ss / static_cast<double>(M) + p.eps);
    const Acc rstd = static_cast<Acc>(rstd_d);
    const Acc mu = static_cast<Acc>(mean);
    rstd_out[r] = rstd;
    T* yr = y + r * M;
#pragma omp simd
    for (int64_t j = 0; j < M; ++j) {
      Acc v = (h[j] - mu) * rstd;
      if (w) v *= math::to_float(w[j]);
      if (b) v += math::to_float(b[j]);
      math::store(yr + j, v);
    }
  }
}

template <typename T>
void backward_chunk(const NormBackwardParams& p, int64_t r0, int64_t r1, double* part, std::vector<uint8_t>& local) {
  using Acc = math::acc_t<T>;
  const int64_t M = p.cols;
  const T* dy = static_cast<const T*>(p.grad_y);
  const T* y = static_cast<const T*>(p.y);
  const Acc* rstd = static_cast<const Acc*>(p.rstd);
  const T* w = static_cast<const T*>(p.weight);
  const T* b = static_cast<const T*>(p.bias);
  T* dx = static_cast<T*>(p.grad_x);
  T* dres = static_cast<T*>(p.grad_residual);
  const bool prologue = p.grad_residual != nullptr;
  const uint8_t* bits = chunk_bits(prologue, p.prologue, nullptr, p.mask, r0 * M, r1 * M, local);
  const DropoutScale scale(p.prologue.p);
  const Acc xhat_max = static_cast<Acc>(std::sqrt(static_cast<double>(M)));
  double* dw = part;
  double* db = part + M;
  double* dpb = part + 2 * M;
  const bool layer = p.kind == NormKind::kLayerNorm;
  for (int64_t r = r0; r < r1; ++r) {
    const T* dyr = dy + r * M;
    const T* yr = y + r * M;
    // c1 = mean(gy * xhat) = mean(dy * (y - beta)) needs no division; c2 = mean(gy).
    double c1 = 0.0, c2 = 0.0;
#pragma omp simd reduction(+ : c1, c2)
    for (int64_t j = 0; j < M; ++j) {
      const double g = math::to_float(dyr[j]);
      const double yb = static_cast<double>(math::to_float(yr[j])) - (b ? math::to_float(b[j]) : 0.0);
      c1 += g * yb;
      c2 += g * (w ? static_cast<double>(math::to_float(w[j])) : 1.0);
    }
    const Acc m1 = static_cast<Acc>(c1 / static_cast<double>(M));
    const Acc m2 = layer ? static_cast<Acc>(c2 / static_cast<double>(M)) : Acc(0);
    const Acc rs = rstd[r];
    T* dxr = dx + r * M;
    const int64_t base = (r - r0) * M;
    for (int64_t j = 0; j < M; ++j) {
      const Acc g = math::to_float(dyr[j]);
      const Acc gamma = w ? math::to_float(w[j]) : Acc(1);
      const Acc yb = math::to_float(yr[j]) - (b ? math::to_float(b[j]) : Acc(0));
      const Acc mag = std::max(std::fabs(gamma), static_cast<Acc>(kNormGammaMin));
      Acc xhat = yb / std::copysign(mag, gamma);
      xhat = std::min(std::max(xhat, -xhat_max), xhat_max);
      const Acc dh = rs * (g * gamma - xhat * m1 - m2);
      dw[j] += static_cast<double>(g) * xhat;
      db[j] += g;
      if (prologue) {
        math::store(dres + r * M + j, dh);
        Acc d = round_to_acc<T>(dh);
        if (bits) {
          const int64_t e = base + j;
          d = scale.apply(d, ((bits[e >> 3] >> (e & 7)) & 1) != 0);
        }
        math::store(dxr + j, d);
        dpb[j] += round_to_acc<T>(d);
      } else {
        math::store(dxr + j, dh);
      }
    }
  }
}

template <typename T>
void forward(const NormForwardParams& p) {
  const int64_t chunk = chunk_rows(p.rows, p.cols);
  const int64_t chunks = (p.rows + chunk - 1) / chunk;
#pragma omp parallel if (p.rows * p.cols >= (1 << 15) && chunks > 1)
  {
    std::vector<math::acc_t<T>> h;
    std::vector<uint8_t> local;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) forward_chunk<T>(p, c * chunk, std::min(p.rows, (c + 1) * chunk), h, local);
  }
}

template <typename T>
void store_sums(const double* sum, void* out, int64_t M) {
  if (!out) return;
  T* o = static_cast<T*>(out);
  for (int64_t j = 0; j < M; ++j) math::store(o + j, static_cast<math::acc_t<T>>(sum[j]));
}

template <typename T>
void backward(const NormBackwardParams& p) {
  const int64_t M = p.cols;
  const int64_t chunk = chunk_rows(p.rows, M);
  const int64_t chunks = (p.rows + chunk - 1) / chunk;
  const bool parallel = p.rows * M >= (1 << 15) && chunks > 1;
  const int threads = parallel ? omp_get_max_threads() : 1;
  // Per-thread column partial sums of dgamma, dbeta and the pre-bias gradient.
  std::vector<double> parts(static_cast<size_t>(threads) * 3 * M, 0.0);
#pragma omp parallel num_threads(threads) if (parallel)
  {
    std::vector<uint8_t> local;
    double* part = parts.data() + static_cast<size_t>(omp_get_thread_num()) * 3 * M;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c)
      backward_chunk<T>(p, c * chunk, std::min(p.rows, (c + 1) * chunk), part, local);
  }
  for (int t = 1; t < threads; ++t) {
    const double* src = parts.data() + static_cast<size_t>(t) * 3 * M;
    for (int64_t j = 0; j < 3 * M; ++j) parts[j] += src[j];
  }
  store_sums<T>(parts.data(), p.weight ? p.grad_weight : nullptr, M);
  store_sums<T>(parts.data() + M, p.bias ? p.grad_bias : nullptr, M);
  store_sums<T>(parts.data() + 2 * M, p.grad_pre_bias, M);
}

template <typename P>
void by_dtype(const P& p, void (*f32)(const P&), void (*f64)(const P&), void (*bf)(const P&), void (*hf)(const P&)) {
  switch (p.dtype) {
    case DType::kFloat32: f32(p); break;
    case DType::kFloat64: f64(p); break;
    case DType::kBFloat16: bf(p); break;
    case DType::kFloat16: hf(p); break;
  }
}

}  // namespace

Status norm_forward_cpu(const NormForwardParams& p) {
  Status s = detail::validate(p);
  if (!s.ok() || p.rows * p.cols == 0) return s;
  by_dtype(p, forward<float>, forward<double>, forward<bf16_t>, forward<fp16_t>);
  return Status::Ok();
}

Status norm_backward_cpu(const NormBackwardParams& p) {
  Status s = detail::validate(p);
  if (!s.ok()) return s;
  if (p.rows * p.cols == 0) {
    // No rows: the parameter gradients are zero.
    const NormBackwardParams& q = p;
    auto zero = [&](void* out) {
      if (!out) return;
      const int64_t bytes = q.cols * (q.dtype == DType::kFloat64 ? 8 : q.dtype == DType::kFloat32 ? 4 : 2);
      std::fill(static_cast<uint8_t*>(out), static_cast<uint8_t*>(out) + bytes, uint8_t{0});
    };
    if (p.weight) zero(p.grad_weight);
    if (p.bias) zero(p.grad_bias);
    zero(p.grad_pre_bias);
    return s;
  }
  by_dtype(p, backward<float>, backward<double>, backward<bf16_t>, backward<fp16_t>);
  return Status::Ok();
}

}  // namespace tempo
