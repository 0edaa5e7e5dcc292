// Philox-4x32-10 (Salmon et al., SC'11), the counter-based generator behind the dropout
// masks: the keep bit of element i is a pure function of (seed, offset, i), so the CPU and
// CUDA kernels draw the same mask and a backward can regenerate it instead of storing it.
#pragma once

#include <cstdint>

#include "tempo/common.h"

namespace tempo::math {

struct Philox4 {
  uint32_t v[4];
};

TEMPO_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t prod = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(prod >> 32);
  lo = static_cast<uint32_t>(prod);
}

// Ten rounds on the counter (c0..c3) under the key (k0, k1).
TEMPO_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(kM0, c0, hi0, lo0);
    mulhilo32(kM1, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The four 32-bit draws for elements 4g .. 4g+3 of a stream: counter (g, offset), key seed.
TEMPO_HD Philox4 philox_group(uint64_t seed, uint64_t offset, uint64_t g) {
  return philox4x32_10(static_cast<uint32_t>(g), static_cast<uint32_t>(g >> 32), static_cast<uint32_t>(offset),
                       static_cast<uint32_t>(offset >> 32), static_cast<uint32_t>(seed),
                       static_cast<uint32_t>(seed >> 32));
}

// An element is kept when its draw r satisfies r < threshold, threshold = round((1 - p) 2^32)
// (0 drops everything, 2^32 keeps everything).
TEMPO_HD uint64_t keep_threshold(double p) {
  const double t = (1.0 - p) * 4294967296.0 + 0.5;
  return t <= 0.0 ? 0 : (t >= 4294967296.0 ? 4294967296ull : static_cast<uint64_t>(t));
}

// The packed keep bits of elements 8b .. 8b+7 (bit q for element 8b+q).
TEMPO_HD uint32_t keep_byte(uint64_t seed, uint64_t offset, int64_t b, uint64_t threshold) {
  const Philox4 r0 = philox_group(seed, offset, static_cast<uint64_t>(b) * 2);
  const Philox4 r1 = philox_group(seed, offset, static_cast<uint64_t>(b) * 2 + 1);
  uint32_t bits = 0;
  for (int q = 0; q < 4; ++q) {
    bits |= (static_cast<uint64_t>(r0.v[q]) < threshold ? 1u : 0u) << q;
    bits |= (static_cast<uint64_t>(r1.v[q]) < threshold ? 1u : 0u) << (q + 4);
  }
  return bits;
}

}  // namespace tempo::math
