// Scalar helpers shared by CPU and CUDA kernels: bit casts, 16-bit float conversions
// (round to nearest even, subnormals, inf and NaN handled), and the load/store of any
// supported element type through fp32 (or fp64 for double).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "tempo/common.h"

namespace tempo::math {

TEMPO_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

TEMPO_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// Storage types for the 16-bit formats: raw bits, so this header needs no framework.
struct bf16_t {
  uint16_t bits;
};
struct fp16_t {
  uint16_t bits;
};

TEMPO_HD float to_float(float v) { return v; }
TEMPO_HD double to_float(double v) { return v; }
TEMPO_HD float to_float(bf16_t v) { return bits_float(static_cast<uint32_t>(v.bits) << 16); }
TEMPO_HD float to_float(fp16_t v) {
  const uint32_t h = v.bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in fp32
    const float mag = static_cast<float>(m) * 5.9604644775390625e-8f;
    return bits_float(float_bits(mag) | sign);
  }
  if (e == 31) return bits_float(sign | 0x7f800000u | (m << 13));
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

template <typename T>
TEMPO_HD T from_float(float v);
template <>
TEMPO_HD float from_float<float>(float v) {
  return v;
}
template <>
TEMPO_HD bf16_t from_float<bf16_t>(float v) {
  const uint32_t u = float_bits(v);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;  // quiet NaN
  // A select rather than an early return, so that loops over it vectorise.
  return bf16_t{static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded)};
}
template <>
TEMPO_HD fp16_t from_float<fp16_t>(float v) {
  const uint32_t u = float_bits(v);
  const uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  uint32_t h;
  if (a >= 0x7f800000u) {
    h = a > 0x7f800000u ? 0x7e00u : 0x7c00u;  // NaN stays NaN, inf stays inf
  } else if (a >= 0x477ff000u) {
    h = 0x7c00u;  // rounds to a magnitude of 65520 or more: inf
  } else if (a < 0x38800000u) {
    // Below the smallest normal half (2^-14): adding 0.5 leaves the value's multiple of
    // 2^-24 in the low mantissa bits, rounded to nearest even by the FPU.
    const float shifted = bits_float(a) + 0.5f;
    h = float_bits(shifted) - 0x3f000000u;
  } else {
    const uint32_t odd = (a >> 13) & 1u;
    a += 0xc8000fffu + odd;  // rebias the exponent by -112 and round to nearest even
    h = a >> 13;
  }
  return fp16_t{static_cast<uint16_t>(sign | h)};
}

}  // namespace tempo::math

namespace tempo::math {

// Store an fp32 (or fp64) result into the element type.
TEMPO_HD void store(float* p, float v) { *p = v; }
TEMPO_HD void store(double* p, double v) { *p = v; }
TEMPO_HD void store(bf16_t* p, float v) { *p = from_float<bf16_t>(v); }
TEMPO_HD void store(fp16_t* p, float v) { *p = from_float<fp16_t>(v); }

// The type the math runs in for an element type.
template <typename T>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};
template <typename T>
using acc_t = typename AccType<T>::type;

// v rounded to T's precision (as storing it in T would), kept in the math type.
template <typename T>
TEMPO_HD acc_t<T> round_to_acc(acc_t<T> v) {
  T out;
  store(&out, v);
  return to_float(out);
}

// f(T{}) with T the storage type of dtype: float, double, bf16_t or fp16_t. The one dtype
// switch of the core (CPU and CUDA launches alike).
template <typename F>
void by_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      f(float{});
      break;
    case DType::kFloat64:
      f(double{});
      break;
    case DType::kBFloat16:
      f(bf16_t{});
      break;
    case DType::kFloat16:
      f(fp16_t{});
      break;
  }
}

// (e^r - 1 - r) / r^2 for |r| <= ln(2)/2, in fp32: the Taylor polynomial to r^7 (e^r's
// truncation 5e-9 relative), by Horner. The fp32 exponentials (softmax.h, activation_f32.h)
// finish it their own way.
TEMPO_HD float exp_taylor_tail(float r) {
  float q = 1.0f / 5040.0f;
  q = fmaf(q, r, 1.0f / 720.0f);
  q = fmaf(q, r, 1.0f / 120.0f);
  q = fmaf(q, r, 1.0f / 24.0f);
  q = fmaf(q, r, 1.0f / 6.0f);
  return fmaf(q, r, 0.5f);
}

}  // namespace tempo::math
