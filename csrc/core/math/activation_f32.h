// The in-place activations' forward in fp32 arithmetic only, for the CUDA kernels of 16/32-bit
// data. The CPU kernels evaluate the forward in double (activation_math.h: within 0.5 ulp); on
// GPUs with 1/32 to 1/64 fp64 rate (RTX, L4, L40S, A10) a double-precision elementwise kernel
// is compute-bound, so the CUDA forward uses these instead: no cancellation anywhere
// (sigma(s) as 1 / (1 + e^-s) or e^s / (1 + e^s), Phi(-|x|) as e^{-x^2/2} Q(t)), the exponent's
// argument in float-float where its rounding would be amplified (x^2 / 2 and GELU-tanh's
// 2 a(x) reach 100), and e^z carried as m 2^k until one final exact scaling, so that outputs
// in the subnormal range are rounded once. Error, measured against the fp64 functions over a
// sweep of fp32 inputs (tests/cpp/core/test_activation.cpp, docs/accuracy.md): kF32ForwardUlps.
// The same code runs on the host for those tests, and the device rounds alike: the fused
// operations are the explicit fmaf calls, and activation.cu is compiled with --fmad=false
// (CMakeLists.txt). With contraction on (nvcc's default) an H200 was 2 ulp off in the fp32
// tanh-GELU (x = -1.465, 2026-12-04): a two_prod's product fused into the later sum of its hi
// and lo parts counts the product's rounding twice.
#pragma once

#include <cmath>

#include "activation_math.h"

namespace tempo::math {

// The largest error of these forwards in ulps of the fp32 result (normal results; subnormal
// results are within one smallest-subnormal step), measured over every finite fp32 input
// against the C library's double functions.
template <Activation A>
inline constexpr float kF32ForwardUlps = 0;
template <>
inline constexpr float kF32ForwardUlps<Activation::kGeluErf> = 2.33f;
template <>
inline constexpr float kF32ForwardUlps<Activation::kGeluTanh> = 1.28f;
template <>
inline constexpr float kF32ForwardUlps<Activation::kSilu> = 1.27f;

// phi_fast's Q(u), u = (2 t - 1 - t_lo) / (1 - t_lo), re-expanded in w = t - t_lo' (t_lo'
// = t_lo rounded to fp32, so that w is one exact subtraction; the scale 2 / (1 - t_lo) folded
// into the coefficients) and rounded to fp32. In u, Q's terms cancel as u nears -1 (|x| near
// 14; condition number 18 there); in w every term is positive up to rounding (condition
// number at most 1.05 over the whole range).
constexpr float kPhiTLoF32 = static_cast<float>(kPhiTLo);
struct PhiQF32 {
  float c[kPhiQDegree + 1];  // highest degree first, for Horner
};
constexpr PhiQF32 phi_q_in_w() {
  constexpr double desc[kPhiQDegree + 1] = TEMPO_PHI_Q_COEF;
  constexpr int n = kPhiQDegree + 1;
  double binom[n][n] = {};
  for (int i = 0; i < n; ++i) {
    binom[i][0] = 1.0;
    for (int j = 1; j <= i; ++j) binom[i][j] = binom[i - 1][j - 1] + (j < i ? binom[i - 1][j] : 0.0);
  }
  // u = s (w + delta) - 1, s = 2 / (1 - t_lo), delta = t_lo' - t_lo; Q = sum_i a_i u^i.
  // First in z = s (w + delta) = u + 1: u^i = sum_j C(i, j) z^j (-1)^(i - j).
  double z[n] = {};
  for (int i = 0; i < n; ++i)
    for (int j = 0; j <= i; ++j) z[j] += desc[n - 1 - i] * binom[i][j] * ((i - j) % 2 ? -1.0 : 1.0);
  // Then z^j = s^j (w + delta)^j = s^j sum_k C(j, k) w^k delta^(j - k).
  const double sc = 2.0 / (1.0 - kPhiTLo), delta = static_cast<double>(kPhiTLoF32) - kPhiTLo;
  double e[n] = {};
  double sj = 1.0;
  for (int j = 0; j < n; ++j, sj *= sc) {
    double dk = 1.0;  // delta^(j - k), k from j down
    for (int k = j; k >= 0; --k, dk *= delta) e[k] += z[j] * sj * binom[j][k] * dk;
  }
  PhiQF32 r{};
  for (int k = 0; k < n; ++k) r.c[k] = static_cast<float>(e[n - 1 - k]);
  return r;
}
#if defined(__CUDACC__)
__device__ __constant__ const PhiQF32 kPhiQDeviceF32 = phi_q_in_w();
#endif
constexpr PhiQF32 kPhiQHostF32 = phi_q_in_w();

struct F2 {  // hi + lo, |lo| <= ulp(hi) / 2
  float hi, lo;
};

TEMPO_HD F2 two_prod(float a, float b) {
  const float p = a * b;
  return {p, fmaf(a, b, -p)};
}

TEMPO_HD F2 two_sum(float a, float b) {
  const float s = a + b;
  const float bb = s - a;
  return {s, (a - (s - bb)) + (b - bb)};
}

TEMPO_HD F2 fast_two_sum(float a, float b) {  // |a| >= |b|
  const float s = a + b;
  return {s, b - (s - a)};
}

// c * v for a float-float constant c and float-float v.
TEMPO_HD F2 mul_ff(F2 c, F2 v) {
  F2 p = two_prod(c.hi, v.hi);
  p.lo = fmaf(c.hi, v.lo, fmaf(c.lo, v.hi, p.lo));
  return fast_two_sum(p.hi, p.lo);
}

// m 2^k for k <= 0 (the exponents of e^z, z <= 0, here), rounded once: 2^k is an exact
// normal power of two down to 2^-126; below, m 2^(k + 64) is exact and normal for the m that
// occur here (|m| >= 2^-60), and the product with 2^-64 rounds once. Results below 2^-150 are 0.
TEMPO_HD float pow2(int k) { return bits_float(static_cast<uint32_t>(k + 127) << 23); }  // -126 <= k <= 127
TEMPO_HD float scale2(float m, int k) {
  if (k >= -126) return m * pow2(k);
  k = k < -190 ? -190 : k;
  return (m * pow2(k + 64)) * pow2(-64);
}

// e^(h + l), |l| small against h's ulp scale, as m 2^k with m = e^r, |r| <= ln2 / 2 (+ a hair).
// |h| is clamped to 200, where e^h is 0 or +inf in fp32 whatever follows; h must not be NaN.
struct ExpParts {
  float m, ml;  // e^r = m + ml
  int k;
};

TEMPO_HD ExpParts exp_parts(float h, float l) {
  h = h < -200.0f ? -200.0f : (h > 200.0f ? 200.0f : h);
  const float n = rintf(h * 1.44269504f);
  // ln 2 = kLn2Hi + kLn2Lo; h - n kLn2Hi is exact (fmaf, and |r| < 1/2 with its bits at or
  // above 2^-25), the rest goes into the small correction rl.
  constexpr float kLn2Hi = 0.693147182464599609375f, kLn2Lo = -1.9046542121259336e-09f;
  const float r = fmaf(-n, kLn2Hi, h);
  const float rl = fmaf(-n, kLn2Lo, l);
  // e^r = 1 + p, p = r + r^2 q(r) (kept apart from the 1 for accuracy); times 1 + rl.
  const float p = fmaf(r * r, exp_taylor_tail(r), r);
  const F2 m = fast_two_sum(1.0f, fmaf(rl, 1.0f + p, p));
  return {m.hi, m.lo, static_cast<int>(n)};
}

// (nh + nl) / (dh + dl) to about 1 ulp, for a positive denominator.
// One division (the reciprocal), then a correction from the exact residual.
TEMPO_HD float div_ff(float nh, float nl, float dh, float dl) {
  const float inv = 1.0f / dh;
  const float q0 = nh * inv;
  const float r = fmaf(-q0, dl, fmaf(-q0, dh, nh) + nl);  // n - q0 d, the first product exact
  return fmaf(r, inv, q0);
}

// x sigma(s) for s = sh + sl: x / (1 + e^-s) for x >= 0, x e^s / (1 + e^s) below (no overflow
// of e^-s, and a tiny result scaled once).
// The denominators 1 + e^(+-s) and the numerator x e^s are carried in float-float, so that the
// result is rounded about once.
TEMPO_HD float x_sigmoid(float x, float sh, float sl) {
  if (x >= 0.0f) {
    const ExpParts e = exp_parts(-sh, -sl);
    const F2 den = fast_two_sum(1.0f, scale2(e.m, e.k));
    return div_ff(x, 0.0f, den.hi, den.lo + scale2(e.ml, e.k));
  }
  const ExpParts e = exp_parts(sh, sl);
  const F2 den = fast_two_sum(1.0f, scale2(e.m, e.k));
  const F2 num = two_prod(x, e.m);
  return scale2(div_ff(num.hi, fmaf(x, e.ml, num.lo), den.hi, den.lo + scale2(e.ml, e.k)), e.k);
}

template <Activation A>
TEMPO_HD float act_forward_f32(float x);

template <>
TEMPO_HD float act_forward_f32<Activation::kSilu>(float x) {
  if (!(x == x)) return x;
  if (x > 100.0f) return x;          // x e^-x is far below half an ulp of x; also +inf
  if (x < -120.0f) return x * 0.0f;  // |x e^x| < 1e-50: -0; also -inf gives NaN as torch does
  return x_sigmoid(x, x, 0.0f);
}

template <>
TEMPO_HD float act_forward_f32<Activation::kGeluTanh>(float x) {
  if (!(x == x)) return x;
  if (x > 20.0f) return x;          // e^{-2a} < e^{-600}
  if (x < -20.0f) return x * 0.0f;  // |y| < 20 e^{-600}
  // s = 2 a(x) = c x (1 + k x^2) in float-float; c = 2 sqrt(2/pi), k = 0.044715.
  const F2 c{1.5957691669464111f, -4.534068054340423e-08f};
  const F2 k{0.044714998453855515f, 1.5461444347053543e-09f};
  const F2 xx = two_prod(x, x);
  const F2 kx = mul_ff(k, xx);
  F2 w = two_sum(1.0f, kx.hi);
  w = fast_two_sum(w.hi, w.lo + kx.lo);
  F2 v = two_prod(x, w.hi);
  v.lo = fmaf(x, w.lo, v.lo);
  const F2 s = mul_ff(c, v);
  return x_sigmoid(x, s.hi, s.lo);
}

template <>
TEMPO_HD float act_forward_f32<Activation::kGeluErf>(float x) {
  if (!(x == x)) return x;
  if (x > 10.0f) return x;          // 1 - Phi(10) = 7.6e-24
  if (x < -15.0f) return x * 0.0f;  // 15 Phi(-15) < 1e-49
  const float a = fabsf(x);
  // Phi(-a) = e^{-a^2/2} Q(w), w = t - t_lo', t = 1 / (1 + a / 4) in float-float (t's own
  // rounding would cost Q about 2 ulp: w Q'(w) / Q reaches 2), Q(w_hi + w_lo) = Q(w_hi) + Q'(w_hi) w_lo.
  const F2 den = fast_two_sum(1.0f, a * (1.0f / static_cast<float>(kPhiQScale)));  // a / 4 exact
  const float t0 = 1.0f / den.hi;
  const float t1 = t0 * fmaf(-t0, den.lo, fmaf(-t0, den.hi, 1.0f));  // t0 (1 - t0 den): the rest of 1 / den
  F2 w = two_sum(t0, -kPhiTLoF32);
  w = fast_two_sum(w.hi, w.lo + t1);
#if defined(__CUDA_ARCH__)
  const float* kQ = kPhiQDeviceF32.c;
#else
  const float* kQ = kPhiQHostF32.c;
#endif
  float q = kQ[0], dq = 0.0f;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 1; i < kPhiQDegree; ++i) {
    dq = fmaf(dq, w.hi, q);
    q = fmaf(q, w.hi, kQ[i]);
  }
  dq = fmaf(dq, w.hi, q);
  // The last Horner step, c0 + q w, in float-float (its rounding would be Q's largest error).
  const F2 qw = two_prod(q, w.hi);
  F2 qf = two_sum(kQ[kPhiQDegree], qw.hi);
  qf.lo += fmaf(dq, w.lo, qw.lo);
  qf = fast_two_sum(qf.hi, qf.lo);
  const F2 sq = two_prod(a, a);
  const ExpParts e = exp_parts(-0.5f * sq.hi, -0.5f * sq.lo);
  // Phi(-a) = (m + ml) q 2^k in float-float; Phi(x) = 1 - Phi(-x) for x >= 0 (Phi(-x) <= 1/2).
  F2 lower = two_prod(e.m, qf.hi);
  lower.lo = fmaf(e.ml, qf.hi, fmaf(e.m, qf.lo, lower.lo));
  if (x >= 0.0f) {
    F2 phi = two_sum(1.0f, -scale2(lower.hi, e.k));
    phi.lo -= scale2(lower.lo, e.k);
    return fmaf(x, phi.hi, x * phi.lo);
  }
  return scale2(fmaf(x, lower.hi, x * lower.lo), e.k);
}

// ---- the forward of 16-bit data: plain fp32 -----------------------------------------------
// bf16 and fp16 keep 8 and 11 bits, so an fp32 evaluation a few fp32 ulps off (2^-21 relative)
// moves the 16-bit result only where the exact value lies within ~2^-13 of its ulp of a
// rounding tie. The float-float forward above costs 110-140 instructions per element, about
// 4x what an H200 can issue per element at a copy's bandwidth; this one costs 15-35: the C
// library's expf / erfcf (CUDA's: within 2 and 4 ulp), one fast division (2 ulp), and the same
// cancellation-free forms (x sigma(s) as x / (1 + e^-s) or x e^s / (1 + e^s); erf GELU as
// x erfc(-x / sqrt 2) / 2). Error bound, in ulps of the 16-bit result: kF16PathForwardUlps,
// measured over every bf16 and fp16 input on the host (tests/cpp/core/test_activation.cpp)
// and on the GPU (tests/python/ops/test_activation.py, CUDA).
inline constexpr float kF16PathForwardUlps = 0.5f + 1.0f / 128.0f;

// a / d for d in [1, 2]: on the device the fast division (within 2 ulp there, no slow path:
// the IEEE division's range checks and subroutine call were a third of the forward's SASS).
TEMPO_HD float div_1_2(float a, float d) {
#if defined(__CUDA_ARCH__)
  return __fdividef(a, d);
#else
  return a / d;
#endif
}

TEMPO_HD float sigmoid_times(float x, float s) {      // x sigma(s), no overflow, no cancellation
  if (s >= 0.0f) return div_1_2(x, 1.0f + expf(-s));  // e^-s in (0, 1]
  const float e = expf(s);                            // in [0, 1)
  return div_1_2(x * e, 1.0f + e);
}

template <Activation A>
TEMPO_HD float act_forward_plain(float x);

template <>
TEMPO_HD float act_forward_plain<Activation::kSilu>(float x) {
  return sigmoid_times(x, x);
}

template <>
TEMPO_HD float act_forward_plain<Activation::kGeluTanh>(float x) {
  if (fabsf(x) > 20.0f) return x > 0.0f ? x : x * 0.0f;                    // as the fp32 form; NaN passes below
  const float s = 1.5957691216057308f * x * fmaf(0.044715f * x, x, 1.0f);  // 2 a(x)
  return sigmoid_times(x, s);
}

template <>
TEMPO_HD float act_forward_plain<Activation::kGeluErf>(float x) {
  return 0.5f * x * erfcf(-0.70710678118654752f * x);
}

}  // namespace tempo::math
