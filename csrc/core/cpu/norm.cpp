// CPU kernels of LayerNorm / RMSNorm (and the fused bias-dropout-residual prologue): rows in
// chunks over OpenMP threads. Row statistics and column sums accumulate in double.
#include "tempo/norm.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <type_traits>
#include <vector>

#include "../math/numeric.h"
#include "../math/philox.h"
#include "dispatch.h"
#include "dropout_bits.h"

namespace tempo {
namespace {

using math::bf16_t;
using math::fp16_t;

// Keep bits of the elements of rows [r0, r1): from the stored mask, or drawn (and stored in
// bits mode). Returns null when there is no dropout.
const uint8_t* chunk_bits(bool enabled, const NormPrologue& pr, uint8_t* mask_out, const uint8_t* mask_in, int64_t e0,
                          int64_t e1, std::vector<uint8_t>& local) {
  if (!enabled || pr.p <= 0.0) return nullptr;
  if (mask_in) return mask_in + e0 / 8;
  return cpu::draw_chunk_bits(pr.rng, pr.p, mask_out, e0, e1, local);
}

// Per-column parameters in the math type, converted once per call: gamma (1 when absent),
// beta (0 when absent), 1 / gamma for the columns recovered from y (0 for kept ones, whose
// xhat is read instead), and the kept columns in slot order. P: the parameters' type, T: the
// data's (the prologue's bias).
template <typename Acc>
struct Columns {
  std::vector<Acc> w, b, inv_w, pre_bias;  // pre_bias: the prologue's bias (0 when absent)
  std::vector<int64_t> kept;               // kept[i]: the column in slot i, -1 for an unused slot
  template <typename P, typename T>
  Columns(const P* weight, const P* bias, const T* pre, int64_t M, const int32_t* slot, int64_t n_kept)
      : w(M, Acc(1)), b(M, Acc(0)), inv_w(M, Acc(1)), pre_bias(M, Acc(0)), kept(static_cast<size_t>(n_kept), -1) {
    for (int64_t j = 0; j < M; ++j) {
      if (pre) pre_bias[j] = math::to_float(pre[j]);
      if (weight) w[j] = math::to_float(weight[j]);
      if (bias) b[j] = math::to_float(bias[j]);
      if (n_kept > 0 && slot[j] >= 0) {
        kept[static_cast<size_t>(slot[j])] = j;
        inv_w[j] = Acc(0);
      } else {
        inv_w[j] = Acc(1) / w[j];
      }
    }
  }
};

// The columns of a call on T data, its parameters of T or (float_params) float.
template <typename T, typename Params>
Columns<math::acc_t<T>> columns_of(const Params& p, const void* pre_bias) {
  const T* pre = static_cast<const T*>(pre_bias);
  if (p.float_params)
    return {static_cast<const float*>(p.weight), static_cast<const float*>(p.beta), pre, p.cols, p.kept_slot, p.kept};
  return {static_cast<const T*>(p.weight), static_cast<const T*>(p.beta), pre, p.cols, p.kept_slot, p.kept};
}

// Row sums: blocks of kSumBlock terms summed in the math type across vector lanes, the
// block sums added in double (accurate to ~kSumBlock / lanes ulps of the terms' magnitude).
constexpr int64_t kSumBlock = 512;

template <typename Acc, typename F>
double row_sum(int64_t M, F term) {
  double total = 0.0;
  for (int64_t j0 = 0; j0 < M; j0 += kSumBlock) {
    const int64_t j1 = std::min(M, j0 + kSumBlock);
    Acc s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t j = j0; j < j1; ++j) s += term(j);
    total += static_cast<double>(s);
  }
  return total;
}

// Two row sums in one pass, as row_sum.
template <typename Acc, typename F, typename G>
std::pair<double, double> row_sum2(int64_t M, F term1, G term2) {
  double t1 = 0.0, t2 = 0.0;
  for (int64_t j0 = 0; j0 < M; j0 += kSumBlock) {
    const int64_t j1 = std::min(M, j0 + kSumBlock);
    Acc s1 = 0, s2 = 0;
#pragma omp simd reduction(+ : s1, s2)
    for (int64_t j = j0; j < j1; ++j) {
      s1 += term1(j);
      s2 += term2(j);
    }
    t1 += static_cast<double>(s1);
    t2 += static_cast<double>(s2);
  }
  return {t1, t2};
}

// The row x (or h) as math-type values: x itself for float/double data without the
// prologue, else converted (and for the prologue, formed) into h.
template <typename T>
const math::acc_t<T>* load_row(const NormForwardParams& p, const Columns<math::acc_t<T>>& col, int64_t r, int64_t r0,
                               const uint8_t* bits, const DropoutScale& scale, std::vector<math::acc_t<T>>& h,
                               std::vector<uint8_t>& keep) {
  using Acc = math::acc_t<T>;
  const int64_t M = p.cols;
  const T* xr = static_cast<const T*>(p.x) + r * M;
  const T* res = static_cast<const T*>(p.prologue.residual);
  if (!res) {
    if constexpr (std::is_same_v<T, Acc>) {
      return xr;
    } else {
#pragma omp simd
      for (int64_t j = 0; j < M; ++j) h[j] = math::to_float(xr[j]);
      return h.data();
    }
  }
  // h = residual + dropout(x + bias), each step rounded to T as the unfused ops store it.
  const T* rr = res + r * M;
  const Acc* pb = col.pre_bias.data();
  uint8_t* kb = keep.data();
  cpu::expand_keep(bits, (r - r0) * M, M, kb);
  Acc* hd = h.data();
#pragma omp simd
  for (int64_t j = 0; j < M; ++j) {
    const Acc v = math::round_to_acc<T>(math::to_float(xr[j]) + pb[j]);
    const Acc d = math::round_to_acc<T>(scale.apply(v, kb[j] != 0));
    hd[j] = math::round_to_acc<T>(math::to_float(rr[j]) + d);
  }
  return hd;
}

template <typename T>
void forward_chunk(const NormForwardParams& p, const Columns<math::acc_t<T>>& col, int64_t r0, int64_t r1,
                   std::vector<math::acc_t<T>>& h, std::vector<uint8_t>& keep, std::vector<uint8_t>& local) {
  using Acc = math::acc_t<T>;
  const int64_t M = p.cols;
  T* y = static_cast<T*>(p.y);
  Acc* rstd_out = static_cast<Acc*>(p.rstd);
  const uint8_t* bits = chunk_bits(p.prologue.residual != nullptr, p.prologue, p.mask, nullptr, r0 * M, r1 * M, local);
  const DropoutScale scale(p.prologue.p);
  h.resize(static_cast<size_t>(M));
  keep.resize(static_cast<size_t>(M));
  const Acc* w = col.w.data();
  const Acc* b = col.b.data();
  for (int64_t r = r0; r < r1; ++r) {
    const Acc* hr = load_row<T>(p, col, r, r0, bits, scale, h, keep);
    // Row statistics: two passes, the second corrected (Bjorck): the mean of the first pass errs
    // by the rounding of its fp32 block sums, of the row's magnitude, which a row with a large
    // offset against its spread would pass on to every xhat. The second pass sums the
    // deviations from that mean, d = x - mu (exact where x is within a factor 2 of mu), and
    // their squares; the mean corrected by mean(d), held as mu + mu_lo in the math type, then
    // gives deviations (x - mu) - mu_lo that err by a rounding of the deviation itself.
    double ss = 0.0;
    Acc mu = 0, mu_lo = 0;
    if (p.kind == NormKind::kLayerNorm) {
      const Acc mu0 = static_cast<Acc>(row_sum<Acc>(M, [&](int64_t j) { return hr[j]; }) / static_cast<double>(M));
      const auto [s1, s2] = row_sum2<Acc>(
          M, [&](int64_t j) { return hr[j] - mu0; },
          [&](int64_t j) {
            const Acc d = hr[j] - mu0;
            return d * d;
          });
      const double shift = s1 / static_cast<double>(M);
      const double mean = static_cast<double>(mu0) + shift;
      ss = std::max(0.0, s2 - s1 * shift);
      mu = static_cast<Acc>(mean);
      mu_lo = static_cast<Acc>(mean - static_cast<double>(mu));
    } else {
      ss = row_sum<Acc>(M, [&](int64_t j) { return hr[j] * hr[j]; });
    }
    const Acc rstd = static_cast<Acc>(1.0 / std::sqrt(ss / static_cast<double>(M) + p.eps));
    rstd_out[r] = rstd;
    T* yr = y + r * M;
#pragma omp simd
    for (int64_t j = 0; j < M; ++j) math::store(yr + j, ((hr[j] - mu) - mu_lo) * rstd * w[j] + b[j]);
    Acc* xk = static_cast<Acc*>(p.kept_xhat) + r * p.kept;
    for (int64_t i = 0; i < p.kept; ++i) xk[i] = col.kept[i] >= 0 ? ((hr[col.kept[i]] - mu) - mu_lo) * rstd : Acc(0);
  }
}

// Kept: whether any column is kept (without, the row loops skip the kept values and c1 needs
// no division: gy * xhat = dy * (y - beta)).
template <typename T, bool Kept>
void backward_chunk(const NormBackwardParams& p, const Columns<math::acc_t<T>>& col, int64_t r0, int64_t r1,
                    double* part, std::vector<math::acc_t<T>>& acc, std::vector<uint8_t>& keep,
                    std::vector<uint8_t>& local) {
  using Acc = math::acc_t<T>;
  const int64_t M = p.cols;
  const T* dy = static_cast<const T*>(p.grad_y);
  const T* y = static_cast<const T*>(p.y);
  const Acc* rstd = static_cast<const Acc*>(p.rstd);
  T* dx = static_cast<T*>(p.grad_x);
  T* dres = static_cast<T*>(p.grad_residual);
  const bool prologue = p.grad_residual != nullptr;
  const uint8_t* bits = chunk_bits(prologue, p.prologue, nullptr, p.mask, r0 * M, r1 * M, local);
  const DropoutScale scale(p.prologue.p);
  const Acc* w = col.w.data();
  const Acc* b = col.b.data();
  const Acc* inv_w = col.inv_w.data();
  // Column sums of this chunk in the math type (a few rows), added into the double partials;
  // then the kept columns' xhat of one row, scattered (zero in the recovered columns).
  acc.assign(static_cast<size_t>(4 * M), Acc(0));
  keep.resize(static_cast<size_t>(M));
  Acc* aw = acc.data();
  Acc* ab = aw + M;
  Acc* apb = aw + 2 * M;
  Acc* kx = aw + 3 * M;
  const bool layer = p.kind == NormKind::kLayerNorm;
  for (int64_t r = r0; r < r1; ++r) {
    const T* dyr = dy + r * M;
    const T* yr = y + r * M;
    if constexpr (Kept) {
      const Acc* xk = static_cast<const Acc*>(p.kept_xhat) + r * p.kept;
      for (int64_t i = 0; i < p.kept; ++i)
        if (col.kept[i] >= 0) kx[col.kept[i]] = xk[i];
    }
    // xhat: recovered from y (inv_w = 0 in the kept columns), plus the kept value (0 elsewhere).
    auto xhat = [&](int64_t j) {
      const Acc rec = (math::to_float(yr[j]) - b[j]) * inv_w[j];
      if constexpr (Kept)
        return rec + kx[j];
      else
        return rec;
    };
    // c1 = mean(gy * xhat), c2 = mean(gy), gy = dy * gamma.
    const auto [c1, c2] = row_sum2<Acc>(
        M,
        [&](int64_t j) {
          if constexpr (Kept)
            return math::to_float(dyr[j]) * w[j] * xhat(j);
          else
            return math::to_float(dyr[j]) * (math::to_float(yr[j]) - b[j]);
        },
        [&](int64_t j) { return math::to_float(dyr[j]) * w[j]; });
    const Acc m1 = static_cast<Acc>(c1 / static_cast<double>(M));
    const Acc m2 = layer ? static_cast<Acc>(c2 / static_cast<double>(M)) : Acc(0);
    const Acc rs = rstd[r];
    T* dxr = dx + r * M;
    if (!prologue) {
#pragma omp simd
      for (int64_t j = 0; j < M; ++j) {
        const Acc g = math::to_float(dyr[j]);
        const Acc xh = xhat(j);
        math::store(dxr + j, rs * (g * w[j] - xh * m1 - m2));
        aw[j] += g * xh;
        ab[j] += g;
      }
      continue;
    }
    uint8_t* kb = keep.data();
    cpu::expand_keep(bits, (r - r0) * M, M, kb);
    T* dresr = dres + r * M;
#pragma omp simd
    for (int64_t j = 0; j < M; ++j) {
      const Acc g = math::to_float(dyr[j]);
      const Acc xh = xhat(j);
      const Acc dh = rs * (g * w[j] - xh * m1 - m2);
      aw[j] += g * xh;
      ab[j] += g;
      math::store(dresr + j, dh);
      const Acc d = math::round_to_acc<T>(scale.apply(math::round_to_acc<T>(dh), kb[j] != 0));
      math::store(dxr + j, d);
      apb[j] += d;
    }
  }
  for (int64_t j = 0; j < 3 * M; ++j) part[j] += static_cast<double>(aw[j]);
}

template <typename T>
void forward(const NormForwardParams& p) {
  const int64_t chunk = cpu::mask_chunk_rows(p.rows, p.cols);
  const int64_t chunks = (p.rows + chunk - 1) / chunk;
  const Columns<math::acc_t<T>> col = columns_of<T>(p, p.prologue.bias);
#pragma omp parallel if (p.rows * p.cols >= cpu::kParallelMinElems && chunks > 1)
  {
    std::vector<math::acc_t<T>> h;
    std::vector<uint8_t> keep, local;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c)
      forward_chunk<T>(p, col, c * chunk, std::min(p.rows, (c + 1) * chunk), h, keep, local);
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
  const int64_t chunk = cpu::mask_chunk_rows(p.rows, M);
  const int64_t chunks = (p.rows + chunk - 1) / chunk;
  const bool parallel = p.rows * M >= cpu::kParallelMinElems && chunks > 1;
  // Column partial sums of dgamma, dbeta and the pre-bias gradient, one per fixed group of
  // chunks (cpu::run_groups), added in group order: the same sums for any thread count.
  const int64_t groups = cpu::reduction_groups(chunks);
  std::vector<double> parts(static_cast<size_t>(groups) * 3 * M, 0.0);
  const Columns<math::acc_t<T>> col = columns_of<T>(p, nullptr);
  cpu::run_groups(chunks, parallel, [&](int64_t g, int64_t c0, int64_t c1) {
    std::vector<uint8_t> keep, local;
    std::vector<math::acc_t<T>> acc;
    double* part = parts.data() + static_cast<size_t>(g) * 3 * M;
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t r1 = std::min(p.rows, (c + 1) * chunk);
      if (p.kept > 0)
        backward_chunk<T, true>(p, col, c * chunk, r1, part, acc, keep, local);
      else
        backward_chunk<T, false>(p, col, c * chunk, r1, part, acc, keep, local);
    }
  });
  cpu::add_group_partials(parts, groups, 3 * M);
  const auto store_param_sums = p.float_params ? store_sums<float> : store_sums<T>;
  store_param_sums(parts.data(), p.weight ? p.grad_weight : nullptr, M);
  store_param_sums(parts.data() + M, p.beta ? p.grad_beta : nullptr, M);
  store_sums<T>(parts.data() + 2 * M, p.grad_bias, M);
}

}  // namespace

Status norm_forward_cpu(const NormForwardParams& p) {
  Status s = detail::validate(p);
  if (!s.ok() || p.rows * p.cols == 0) return s;
  math::by_dtype(p.dtype, [&](auto t) { forward<decltype(t)>(p); });
  return Status::Ok();
}

Status norm_backward_cpu(const NormBackwardParams& p) {
  Status s = detail::validate(p);
  if (!s.ok()) return s;
  if (p.rows * p.cols == 0) {
    // No rows: the parameter gradients are zero.
    auto zero = [&](void* out, DType dtype) {
      if (!out) return;
      const int64_t bytes = p.cols * (dtype == DType::kFloat64 ? 8 : dtype == DType::kFloat32 ? 4 : 2);
      std::fill(static_cast<uint8_t*>(out), static_cast<uint8_t*>(out) + bytes, uint8_t{0});
    };
    const DType param_dtype = p.float_params ? DType::kFloat32 : p.dtype;
    if (p.weight) zero(p.grad_weight, param_dtype);
    if (p.beta) zero(p.grad_beta, param_dtype);
    zero(p.grad_bias, p.dtype);
    return s;
  }
  s = detail::check_kept_columns(p);
  if (!s.ok()) return s;
  math::by_dtype(p.dtype, [&](auto t) { backward<decltype(t)>(p); });
  return Status::Ok();
}

}  // namespace tempo
