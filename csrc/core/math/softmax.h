// Scalar math of the attention softmax shared by the CPU and CUDA kernels.
#pragma once

#include <cmath>
#include <cstdint>

#include "numeric.h"

namespace tempo::math {

// e^x for the softmax's x - max(x) <= 0, in fp32 with plain arithmetic (so loops over it
// vectorise): relative error under 2 ulp; 0 for x < -87.3 (and for -inf); NaN propagates.
TEMPO_HD float exp_nonpositive(float x) {
  const float xc = x < -87.3f ? -87.3f : x;
  // n = round(x / ln 2) by the 1.5 * 2^23 trick; r = x - n ln 2 with ln 2 in two parts.
  const float n = (xc * 1.44269504f + 12582912.0f) - 12582912.0f;
  float r = fmaf(n, -0.693145752f, xc);
  r = fmaf(n, -1.42860677e-6f, r);
  // e^r on |r| <= ln(2)/2: 1 + r + r^2 exp_taylor_tail(r), Horner all the way.
  float q = exp_taylor_tail(r);
  q = fmaf(q, r, 1.0f);
  q = fmaf(q, r, 1.0f);
  const float two_n = bits_float(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  return x < -87.3f ? 0.0f : q * two_n;
}

// e^x for a softmax's x = z - (the row's maximum, or its log-sum-exp) <= 0 (but for rounding), in
// the math type: exp_nonpositive for float, the library's exp for double. One definition for the
// attention softmax's and linear_cross_entropy's kernels, CPU and CUDA alike.
template <typename Acc>
TEMPO_HD Acc exp_shifted(Acc x) {
  if constexpr (sizeof(Acc) == 8) {
    return ::exp(x);
  } else {
    return exp_nonpositive(x);
  }
}

}  // namespace tempo::math
