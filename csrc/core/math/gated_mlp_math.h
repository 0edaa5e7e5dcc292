// act(g) and act'(g) together, from the gate itself, for the gated MLP (tempo/gated_mlp.h),
// shared by its CPU and CUDA kernels. Three evaluations of the same forms:
//   gate_fast(double): 16/32-bit data on the CPU; exp_fast / phi_fast (activation_math.h),
//     relative error under 1e-9 per term, vectorisable;
//   gate_exact(double): fp64 data; the C library's exp / erfc;
//   gate_f32(float): 16/32-bit data on CUDA; fp32 with expf / erfcf.
// The derivative is returned as the two terms it is the sum of (act' = d1 + d2), so that a
// caller states its error against |d1| + |d2|: the sum cancels near act's minimum, where act'
// is 0. Forms (sigma(z) = 1 / (1 + e^-z), 1 - sigma(z) = e^-z sigma(z), never 1 - s):
//   SiLU        f = x s,   s = sigma(x);         f' = s + x s (1 - s)
//   GELU tanh   f = x s,   s = sigma(2 a),       f' = s + 2 x s (1 - s) a',
//               a = c x (1 + k x^2), a' = c (1 + 3 k x^2)
//   GELU erf    f = x P,   P = Phi(x);           f' = P + x phi(x)
#pragma once

#include <cmath>

#include "activation_math.h"

namespace tempo::math {

template <typename F>
struct GateValue {
  F f;       // act(g)
  F d1, d2;  // act'(g) = d1 + d2
};

constexpr double kInvSqrt2Pi = 0.39894228040143267794;

template <Activation A>
TEMPO_HD GateValue<double> gate_fast(double x) {
  if constexpr (A == Activation::kGeluErf) {
    const double p = phi_fast(x);
    return {x * p, p, x * exp_fast(-0.5 * x * x) * kInvSqrt2Pi};
  } else {
    constexpr double c = ActMath<Activation::kGeluTanh>::kC, k = ActMath<Activation::kGeluTanh>::kK;
    const bool tanh_form = A == Activation::kGeluTanh;
    const double z = tanh_form ? 2.0 * c * x * fma(k * x, x, 1.0) : x;
    const double e = exp_fast(-z);  // clamped at e^709.8: 1 + e stays finite, e s stays <= 1
    const double s = 1.0 / (1.0 + e), oms = e * s;
    const double slope = tanh_form ? 2.0 * c * fma(3.0 * k * x, x, 1.0) : 1.0;
    return {x * s, s, x * s * oms * slope};
  }
}

template <Activation A>
TEMPO_HD GateValue<double> gate_exact(double x) {
  if constexpr (A == Activation::kGeluErf) {
    const double p = 0.5 * erfc(-x * 0.70710678118654752440);
    return {x * p, p, x * exp(-0.5 * x * x) * kInvSqrt2Pi};
  } else {
    constexpr double c = ActMath<Activation::kGeluTanh>::kC, k = ActMath<Activation::kGeluTanh>::kK;
    const bool tanh_form = A == Activation::kGeluTanh;
    const double z = tanh_form ? 2.0 * c * x * (1.0 + k * x * x) : x;
    const double s = 1.0 / (1.0 + exp(-z)), oms = 1.0 / (1.0 + exp(z));  // no inf * 0 at |z| > 709
    const double slope = tanh_form ? 2.0 * c * (1.0 + 3.0 * k * x * x) : 1.0;
    return {x * s, s, x * s * oms * slope};
  }
}

template <Activation A>
TEMPO_HD GateValue<float> gate_f32(float x) {
  if constexpr (A == Activation::kGeluErf) {
    const float p = 0.5f * erfcf(-0.70710678118654752f * x);
    return {x * p, p, x * expf(-0.5f * x * x) * 0.39894228040143267f};
  } else {
    const bool tanh_form = A == Activation::kGeluTanh;
    const float z = tanh_form ? 1.5957691216057308f * x * fmaf(0.044715f * x, x, 1.0f) : x;
    // e^-|z| in (0, 1]: sigma and 1 - sigma without overflow or cancellation
    const float e = expf(-fabsf(z));
    const float r = 1.0f / (1.0f + e);
    const float s = z >= 0.0f ? r : e * r, oms = z >= 0.0f ? e * r : r;
    const float slope = tanh_form ? 1.5957691216057308f * fmaf(3.0f * 0.044715f * x, x, 1.0f) : 1.0f;
    return {x * s, s, x * s * oms * slope};
  }
}

}  // namespace tempo::math
