// The rotation of one pair of the rotary embedding, shared by the CPU and CUDA kernels: each
// output one fused multiply-add in the math type, so both give the same bits.
#pragma once

#include "numeric.h"

namespace tempo::math {

TEMPO_HD float rope_fma(float a, float b, float c) { return fmaf(a, b, c); }
TEMPO_HD double rope_fma(double a, double b, double c) { return fma(a, b, c); }

// (a, b) = (x[j], x[j + h]) and the tables at j (c0, s0) and j + h (c1, s1): the forward's
// outputs, or with `backward` the transposed rotation's (see tempo/rope.h).
template <typename A>
TEMPO_HD void rope_pair(A a, A b, A c0, A s0, A c1, A s1, bool backward, A& o0, A& o1) {
  if (backward) {
    o0 = rope_fma(a, c0, b * s1);
    o1 = rope_fma(b, c1, -(a * s0));
  } else {
    o0 = rope_fma(a, c0, -(b * s0));
    o1 = rope_fma(b, c1, a * s1);
  }
}

}  // namespace tempo::math
