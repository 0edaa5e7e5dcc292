// The math of the in-place activations, shared by the CPU and CUDA kernels so both compute
// the same numbers (except the CUDA forward of 16/32-bit data: activation_f32.h):
//   forward  y = f(x) in double, rounded once to the storage type,
//   backward g(y, m) = f'(f^-1(y, m)), m = [x >= x*]:
//     fp32: piecewise polynomials of activation_tables.h (fit error under 3e-8),
//     fp64: safeguarded Newton on f(x) = y to full double precision.
// The forwards avoid the cancellation in 1 + erf(x) / 1 + tanh(x) that costs plain
// implementations their relative accuracy for x << 0, because the backward reads y there.
// Names: forward_fast is the vectorisable double evaluation used for 16/32-bit data;
// forward/derivative use the C library and serve the fp64 path and its Newton solve.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "tempo/activation.h"
#include "activation_tables.h"
#include "numeric.h"

namespace tempo::math {

// ---- vectorisable double-precision building blocks for the 16/32-bit forward -------------
// The forward of fp32/bf16/fp16 data is evaluated in double with these (relative error
// under 1e-9) and rounded once, so the stored y is within ~0.5 ulp: the backward reads y
// and would otherwise inherit a forward error of several ulp near the minimum.

TEMPO_HD double bits_double(uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(u));
#else
  double d;
  std::memcpy(&d, &u, sizeof d);
  return d;
#endif
}

// e^x, relative error under 3e-10 (ample for a result rounded to fp32); +inf above 709.8,
// +0 below -745.2, NaN propagates.
TEMPO_HD double exp_fast(double x) {
  double xc = x > 709.8 ? 709.8 : x;
  xc = xc < -745.2 ? -745.2 : xc;
  // n = round(x / ln 2) by the 1.5 * 2^52 trick.
  double n = (xc * 1.4426950408889634 + 6755399441055744.0) - 6755399441055744.0;
  n = (n == n) ? n : 0.0;
  double r = fma(n, -0.6931471803691238, xc);  // ln 2 split in two parts
  r = fma(n, -1.9082149292705877e-10, r);
  // e^r on |r| <= ln(2)/2: Taylor polynomial of degree 8 (truncation 2e-10 relative).
  double p = 1.0 / 40320.0;
  p = fma(p, r, 1.0 / 5040.0);
  p = fma(p, r, 1.0 / 720.0);
  p = fma(p, r, 1.0 / 120.0);
  p = fma(p, r, 1.0 / 24.0);
  p = fma(p, r, 1.0 / 6.0);
  p = fma(p, r, 0.5);
  p = fma(p, r, 1.0);
  p = fma(p, r, 1.0);
  // 2^n in two factors so that n in [-1075, 1024] never leaves the normal exponent range.
  const int64_t ni = static_cast<int64_t>(n);
  const int64_t n1 = ni / 2;
  const int64_t n2 = ni - n1;
  const double s1 = bits_double(static_cast<uint64_t>(n1 + 1023) << 52);
  const double s2 = bits_double(static_cast<uint64_t>(n2 + 1023) << 52);
  return p * s1 * s2;
}

#if defined(__CUDACC__)
__device__ __constant__ const double kPhiQDevice[kPhiQDegree + 1] = TEMPO_PHI_Q_COEF;
#endif
constexpr double kPhiQHost[kPhiQDegree + 1] = TEMPO_PHI_Q_COEF;

// Standard normal CDF with small relative error also far in the left tail:
// Phi(-a) = exp(-a^2/2) Q(t), a = |x|, Q fitted in activation_tables.h (rel. error 4e-10).
TEMPO_HD double phi_fast(double x) {
#if defined(__CUDA_ARCH__)
  const double* kQ = kPhiQDevice;  // the same coefficients for every thread: constant memory
#else
  const double* kQ = kPhiQHost;
#endif
  const double a = x < 0.0 ? x : -x;  // -|x|, NaN stays NaN
  const double t = 1.0 / (1.0 - a * (1.0 / kPhiQScale));
  const double u = (2.0 * t - 1.0 - kPhiTLo) * (1.0 / (1.0 - kPhiTLo));
  double q = kQ[0];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int k = 1; k <= kPhiQDegree; ++k) q = fma(q, u, kQ[k]);
  const double lower = exp_fast(-0.5 * a * a) * q;  // Phi(-|x|)
  return x < 0.0 ? lower : 1.0 - lower;
}

// ---- per-activation traits ---------------------------------------------------------------

template <Activation A>
struct ActMath;

template <>
struct ActMath<Activation::kGeluErf> {
  using Table = GeluErfTable;
  TEMPO_HD static double forward_fast(double x) { return x * phi_fast(x); }
  TEMPO_HD static double forward(double x) { return 0.5 * x * erfc(-x * 0.70710678118654752440); }
  TEMPO_HD static double derivative(double x) {
    return 0.5 * erfc(-x * 0.70710678118654752440) + x * exp(-0.5 * x * x) * 0.39894228040143267794;
  }
  static constexpr double kLeftBracket = -40.0;  // f(-40) underflows to -0
};

template <>
struct ActMath<Activation::kGeluTanh> {
  using Table = GeluTanhTable;
  static constexpr double kC = 0.79788456080286535588;  // sqrt(2/pi)
  static constexpr double kK = 0.044715;
  // 0.5 (1 + tanh(a)) = 1 / (1 + e^{-2a}): no cancellation for a << 0.
  TEMPO_HD static double forward_fast(double x) {
    const double a = kC * x * fma(kK * x, x, 1.0);
    return x / (1.0 + exp_fast(-2.0 * a));
  }
  TEMPO_HD static double forward(double x) {
    const double a = kC * x * (1.0 + kK * x * x);
    return x / (1.0 + exp(-2.0 * a));
  }
  TEMPO_HD static double derivative(double x) {
    const double a = kC * x * (1.0 + kK * x * x);
    const double t = tanh(a);
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * kC * (1.0 + 3.0 * kK * x * x);
  }
  static constexpr double kLeftBracket = -40.0;
};

template <>
struct ActMath<Activation::kSilu> {
  using Table = SiluTable;
  TEMPO_HD static double forward_fast(double x) { return x / (1.0 + exp_fast(-x)); }
  TEMPO_HD static double forward(double x) { return x / (1.0 + exp(-x)); }
  TEMPO_HD static double derivative(double x) {
    const double s = 1.0 / (1.0 + exp(-x));
    return s * (1.0 + x * (1.0 - s));
  }
  static constexpr double kLeftBracket = -760.0;  // f(-760) underflows to -0
};

// Coefficient tables: one host copy and, in CUDA translation units, one device copy.
template <Activation A>
struct ActCoef;
#define TEMPO_DEFINE_COEF(ACT, MACRO)                                    \
  template <>                                                            \
  struct ActCoef<Activation::ACT> {                                      \
    static constexpr float kHost[kActPieces * (kActDegree + 1)] = MACRO; \
  };
TEMPO_DEFINE_COEF(kGeluErf, TEMPO_GELUERF_COEF)
TEMPO_DEFINE_COEF(kGeluTanh, TEMPO_GELUTANH_COEF)
TEMPO_DEFINE_COEF(kSilu, TEMPO_SILU_COEF)
#undef TEMPO_DEFINE_COEF

#if defined(__CUDACC__)
__device__ const float kGeluErfCoefDevice[kActPieces * (kActDegree + 1)] = TEMPO_GELUERF_COEF;
__device__ const float kGeluTanhCoefDevice[kActPieces * (kActDegree + 1)] = TEMPO_GELUTANH_COEF;
__device__ const float kSiluCoefDevice[kActPieces * (kActDegree + 1)] = TEMPO_SILU_COEF;
#endif

template <Activation>
inline constexpr bool kNoCoefTable = false;

template <Activation A>
TEMPO_HD const float* act_coef() {
#if defined(__CUDA_ARCH__)
  // Each activation names its table; one without a table fails to compile.
  if constexpr (A == Activation::kGeluErf)
    return kGeluErfCoefDevice;
  else if constexpr (A == Activation::kGeluTanh)
    return kGeluTanhCoefDevice;
  else if constexpr (A == Activation::kSilu)
    return kSiluCoefDevice;
  else
    static_assert(kNoCoefTable<A>, "act_coef: no CUDA coefficient table for this activation");
#else
  return ActCoef<A>::kHost;
#endif
}

// ---- forward -----------------------------------------------------------------------------

// fp32 in, fp32 out (16-bit storage goes through fp32): computed in double, rounded once.
template <Activation A>
TEMPO_HD float act_forward(float x) {
  return static_cast<float>(ActMath<A>::forward_fast(static_cast<double>(x)));
}
// fp64: the C library's erfc / exp / tanh.
template <Activation A>
TEMPO_HD double act_forward(double x) {
  return ActMath<A>::forward(x);
}
// The branch bit: x on the right of (or at) the minimum. NaN gives 0.
template <Activation A, typename F>
TEMPO_HD bool act_branch(F x) {
  return x >= static_cast<F>(ActMath<A>::Table::kXStar);
}

// ---- backward: g(y, m) = f'(f^-1(y, m)) --------------------------------------------------

// fp32: evaluate the piece that covers (y, m). Finite y only; non-finite y gives NaN (the
// gradient PyTorch gives at infinite or NaN inputs).
template <Activation A>
TEMPO_HD float act_grad_from_output(float y, bool right) {
  using T = typename ActMath<A>::Table;
  float d = (y - T::kYStarHi) - T::kYStarLo;  // y - y*, exact near y*
  d = d > 0.0f ? d : 0.0f;                    // NaN too
  const float s = sqrtf(d);
  // Near the minimum: uniform pieces in s (left pieces run from s = kSLo up to 0).
  float t = right ? s * T::kRightInvWidth : (T::kSLo + s) * -T::kLeftInvWidth;
  const float tmax = right ? static_cast<float>(kActNearRight) - 1.0f : static_cast<float>(kActNearLeft) - 1.0f;
  float ti = t < tmax ? t : tmax;
  ti = ti > 0.0f ? ti : 0.0f;
  const int near_idx = static_cast<int>(ti);
  float u = 2.0f * (t - static_cast<float>(near_idx)) - 1.0f;
  int idx = right ? near_idx + kActNearLeft : near_idx;  // left pieces come first, from s = kSLo up to 0
  // Tails: one piece per binade of |y|; u from the mantissa.
  const uint32_t bits = float_bits(y);
  const int expo = static_cast<int>((bits >> 23) & 0xffu) - 127;
  const float mant_u = 2.0f * bits_float((bits & 0x7fffffu) | 0x3f800000u) - 3.0f;
  const bool right_tail = right && y >= static_cast<float>(1 << kActRightLog2Lo);
  const bool left_tail = !right && y > -1.0f / static_cast<float>(1 << kActLeftLog2Hi);
  int tail_idx = right_tail ? kActNearLeft + kActNearRight + (expo - kActRightLog2Lo)
                            : kActNearLeft + kActNearRight + kActRightBinades + (-expo - kActLeftLog2Hi - 1);
  // Beyond the tables (and a non-negative y on the left branch, which no forward produces).
  const bool beyond = right_tail ? expo >= kActRightLog2Lo + kActRightBinades
                                 : ((-expo - kActLeftLog2Hi - 1) >= kActLeftBinades || y >= 0.0f);
  const bool tail = right_tail || left_tail;
  tail_idx = beyond ? 0 : tail_idx;
  idx = tail ? tail_idx : idx;
  u = tail ? mant_u : u;
  const float* c = act_coef<A>() + idx * (kActDegree + 1);
  float g = c[0];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int k = 1; k <= kActDegree; ++k) g = fmaf(g, u, c[k]);
  g = (tail && beyond) ? (right ? 1.0f : 0.0f) : g;
  const bool finite = fabsf(y) <= 3.402823466e38f;  // false for inf and NaN
  return finite ? g : (y - y) * 0.0f;               // NaN
}

// fp64: Newton on f(x) = y inside a bracket on the chosen branch, bisecting whenever a
// step would leave the bracket.
template <Activation A>
TEMPO_HD double act_grad_from_output(double y, bool right) {
  using M = ActMath<A>;
  using T = typename M::Table;
  if (!(fabs(y) <= 1.7976931348623157e308)) return (y - y) * 0.0;  // NaN for inf and NaN
  if (y <= T::kYStar) return 0.0;                                  // at the minimum
  double lo, hi;
  if (right) {
    lo = T::kXStar;
    hi = (y > 0.0 ? y : 0.0) + 1.0;
    while (M::forward(hi) < y) hi *= 2.0;
  } else {
    lo = M::kLeftBracket;
    hi = T::kXStar;
    if (y >= M::forward(lo)) return M::derivative(lo);  // underflowed tail: f' ~ 0
  }
  // Start from the quadratic model around the minimum (or y itself far right).
  const double dx0 = sqrt(2.0 * (y - T::kYStar) / T::kD2AtXStar);
  double x = right ? (y > 2.0 ? y : T::kXStar + dx0) : T::kXStar - dx0;
  if (!(x > lo && x < hi)) x = 0.5 * (lo + hi);
  for (int it = 0; it < 200; ++it) {
    const double r = M::forward(x) - y;
    // On the right branch f increases, on the left it decreases.
    if ((r > 0.0) == right)
      hi = x;
    else
      lo = x;
    const double d = M::derivative(x);
    double xn = x - r / d;
    if (!(xn > lo && xn < hi)) xn = 0.5 * (lo + hi);
    const double step = fabs(xn - x);
    x = xn;
    if (step <= 1e-16 * (1.0 + fabs(x)) || hi - lo <= 1e-16 * (1.0 + fabs(x))) break;
  }
  return M::derivative(x);
}

// f(std::integral_constant<Activation, A>{}) for act: the one activation switch of the CPU and
// CUDA launches (a new activation is added here, beside its math). False for an unknown act.
template <typename F>
bool by_activation(Activation act, F&& f) {
  switch (act) {
    case Activation::kGeluErf:
      f(std::integral_constant<Activation, Activation::kGeluErf>{});
      return true;
    case Activation::kGeluTanh:
      f(std::integral_constant<Activation, Activation::kGeluTanh>{});
      return true;
    case Activation::kSilu:
      f(std::integral_constant<Activation, Activation::kSilu>{});
      return true;
  }
  return false;
}

}  // namespace tempo::math
