// act(g) and act'(g) together, from the gate itself, for the gated MLP (tempo/gated_mlp.h),
// shared by its CPU and CUDA kernels. Three evaluations of the same forms:
//   gate_fast(double): 16/32-bit data on the CPU; exp_fast / phi_fast (activation_math.h),
//     relative error under 1e-9 per term, vectorisable;
//   gate_exact(double): fp64 data; the C library's exp / erfc;
//   gate_f32(float): 16/32-bit data on CUDA; fp32 with expf / erfcf.
// The derivative is returned as the two terms it is the sum of (act' = d1 + d2), so that a
// caller states its error against |d1| + |d2|: the sum cancels near act's minimum, where act'
// is 0. Forms (sigma(z) and 1 - sigma(z) from e^-|z|, never 1 - s, no overflow):
//   SiLU        f = x s,   s = sigma(x);         f' = s + x s (1 - s)
//   GELU tanh   f = x s,   s = sigma(2 a),       f' = s + 2 x s (1 - s) a',
//               a = c x (1 + k x^2), a' = c (1 + 3 k x^2)
//   GELU erf    f = x P,   P = Phi(x);           f' = P + x phi(x)
#pragma once

#include <cmath>

#include "activation_math.h"
#include "tempo/gated_mlp.h"

namespace tempo::math {

template <typename F>
struct GateValue {
  F f;       // act(g)
  F d1, d2;  // act'(g) = d1 + d2
};

constexpr double kInvSqrt2Pi = 0.39894228040143267794;

// sigma(z) and 1 - sigma(z) from e = e^-|z| in (0, 1]: no overflow, no cancellation.
template <typename F>
TEMPO_HD void sigmoid_pair(F z, F e, F& s, F& oms) {
  const F r = F(1) / (F(1) + e);
  s = z >= F(0) ? r : e * r;
  oms = z >= F(0) ? e * r : r;
}

// The sigmoid forms (SiLU, tanh GELU) with `exp_neg_abs(z)` = e^-|z| and x's type F.
template <Activation A, typename F, typename Exp>
TEMPO_HD GateValue<F> gate_sigmoid_form(F x, Exp exp_neg_abs) {
  constexpr F c = F(ActMath<Activation::kGeluTanh>::kC), k = F(ActMath<Activation::kGeluTanh>::kK);
  const bool tanh_form = A == Activation::kGeluTanh;
  const F z = tanh_form ? F(2) * c * x * (F(1) + k * x * x) : x;
  F s, oms;
  sigmoid_pair(z, exp_neg_abs(z), s, oms);
  const F slope = tanh_form ? F(2) * c * (F(1) + F(3) * k * x * x) : F(1);
  return {x * s, s, x * s * oms * slope};
}

template <Activation A>
TEMPO_HD GateValue<double> gate_fast(double x) {
  if constexpr (A == Activation::kGeluErf) {
    const double p = phi_fast(x);
    return {x * p, p, x * exp_fast(-0.5 * x * x) * kInvSqrt2Pi};
  } else {
    return gate_sigmoid_form<A, double>(x, [](double z) { return exp_fast(-fabs(z)); });
  }
}

template <Activation A>
TEMPO_HD GateValue<double> gate_exact(double x) {
  if constexpr (A == Activation::kGeluErf) {
    const double p = 0.5 * erfc(-x * 0.70710678118654752440);
    return {x * p, p, x * exp(-0.5 * x * x) * kInvSqrt2Pi};
  } else {
    return gate_sigmoid_form<A, double>(x, [](double z) { return exp(-fabs(z)); });
  }
}

template <Activation A>
TEMPO_HD GateValue<float> gate_f32(float x) {
  if constexpr (A == Activation::kGeluErf) {
    const float p = 0.5f * erfcf(-0.70710678118654752f * x);
    return {x * p, p, x * expf(-0.5f * x * x) * 0.39894228040143267f};
  } else {
    return gate_sigmoid_form<A, float>(x, [](float z) { return expf(-fabsf(z)); });
  }
}

// gate_f32's relative error in ulps of fp32 at gate x, for each of f, d1 and d2 (and the products
// the kernels form from them): kGatedMlpCudaUlps, plus the amplification of the fp32 rounding of
// the argument of e^-|z| (z carries up to 4 roundings: 4 |z| ulps) or of erfc and the normal
// density (2 x^2 ulps), which grows in the tails, where the values themselves vanish (at
// x = -10 the erf GELU is -8e-23); and where e^-|z| is subnormal (|z| > 87), an absolute error of
// gate_f32_tiny() times |x| (times the derivative's slope for d2).
TEMPO_HD double gate_f32_ulps(Activation A, double x) {
  if (A == Activation::kGeluErf) return kGatedMlpCudaUlps + 2.0 * x * x;
  const double z = A == Activation::kGeluTanh ? 1.5957691216057308 * x * (1.0 + 0.044715 * x * x) : x;
  return kGatedMlpCudaUlps + 4.0 * (z < 0 ? -z : z);
}
constexpr double kGateF32Tiny = 0x1p-148;  // two subnormal steps of fp32

}  // namespace tempo::math
