// Packed Philox keep bits on the CPU, shared by the kernels that drop out: dropout, the
// fused bias-dropout-residual-LayerNorm and attention.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "tempo/dropout.h"
#include "../math/philox.h"

namespace tempo::cpu {

// Keep bits of elements start .. start+len-1 into out[0 .. ceil(len/8)); start is a multiple of 8.
inline void keep_bits(const PhiloxState& rng, uint64_t threshold, int64_t start, int len, uint8_t* out) {
  const int64_t b0 = start / 8;
  const int nbytes = bit_mask_bytes(len);
  // Element-parallel form the vectoriser turns into 32-bit lanes: one Philox group per lane.
  constexpr int kChunk = 64;  // groups per pass
  uint32_t draws[4 * kChunk];
  const int64_t groups = static_cast<int64_t>(nbytes) * 2;
  for (int64_t g0 = 0; g0 < groups; g0 += kChunk) {
    const int n = static_cast<int>(groups - g0 < kChunk ? groups - g0 : kChunk);
#pragma omp simd
    for (int j = 0; j < n; ++j) {
      const math::Philox4 r = math::philox_group(rng.seed, rng.offset, static_cast<uint64_t>(2 * b0 + g0 + j));
      draws[4 * j] = r.v[0];
      draws[4 * j + 1] = r.v[1];
      draws[4 * j + 2] = r.v[2];
      draws[4 * j + 3] = r.v[3];
    }
    for (int j = 0; j < n; j += 2) {
      uint32_t bits = 0;
      for (int q = 0; q < 8; ++q) bits |= (static_cast<uint64_t>(draws[4 * j + q]) < threshold ? 1u : 0u) << q;
      out[(g0 + j) / 2] = static_cast<uint8_t>(bits);
    }
  }
  // Bits past the end of the tensor are zero.
  if (len % 8) out[nbytes - 1] &= static_cast<uint8_t>((1u << (len % 8)) - 1u);
}

// Keep flags (0/1) of n elements from packed bits, starting at bit `base`; all 1 when bits is
// null (no dropout).
inline void expand_keep(const uint8_t* bits, int64_t base, int64_t n, uint8_t* out) {
  if (!bits) {
    std::fill(out, out + n, uint8_t{1});
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    const int64_t e = base + j;
    out[j] = (bits[e >> 3] >> (e & 7)) & 1;
  }
}

// The keep bits of elements e0 .. e1-1 (e0 a multiple of 8), drawn into `store` + e0/8 when
// given (bits mode), else into `local`; returns where they are.
inline const uint8_t* draw_chunk_bits(const PhiloxState& rng, double p, uint8_t* store, int64_t e0, int64_t e1,
                                      std::vector<uint8_t>& local) {
  uint8_t* dst = store ? store + e0 / 8 : nullptr;
  if (!dst) {
    local.resize(static_cast<size_t>(bit_mask_bytes(e1 - e0)));
    dst = local.data();
  }
  keep_bits(rng, math::keep_threshold(p), e0, static_cast<int>(e1 - e0), dst);
  return dst;
}

// Keep flags (0/1) of elements start .. start+n-1 for any start (one Philox group per four).
inline void keep_flags(const PhiloxState& rng, uint64_t threshold, int64_t start, int64_t n, uint8_t* out) {
  int64_t e = start;
  const int64_t end = start + n;
  while (e < end) {
    const math::Philox4 r = math::philox_group(rng.seed, rng.offset, static_cast<uint64_t>(e >> 2));
    for (int64_t q = e & 3; q < 4 && e < end; ++q, ++e) out[e - start] = static_cast<uint64_t>(r.v[q]) < threshold;
  }
}

// Rows per work item when each row has `cols` elements and items write packed bits: a
// multiple of 8 elements per item (so no two threads write one mask byte), about 16k
// elements, at most `rows` (then a single item).
inline int64_t mask_chunk_rows(int64_t rows, int64_t cols) {
  int64_t unit = 8;  // rows per whole number of mask bytes
  for (int64_t d = 8; d > 1; d /= 2)
    if (cols % d == 0) {
      unit = 8 / d;
      break;
    }
  int64_t target = std::max<int64_t>(1, (16384 + cols - 1) / std::max<int64_t>(cols, 1));
  target = (target + unit - 1) / unit * unit;
  return std::min(target, std::max<int64_t>(rows, 1));
}

}  // namespace tempo::cpu
