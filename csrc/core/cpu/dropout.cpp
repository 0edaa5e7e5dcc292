// CPU kernels of dropout: blocks of kBlock elements (whole mask bytes) over OpenMP threads.
// Keep bits are drawn by Philox four at a time (math/philox.h), the same draws as on CUDA.
#include "tempo/dropout.h"

#include <algorithm>

#include "../math/numeric.h"
#include "../math/philox.h"
#include "dispatch.h"
#include "dropout_bits.h"

namespace tempo {
namespace {

using math::bf16_t;
using math::fp16_t;

constexpr int64_t kBlock = 2048;  // elements per work item; a multiple of 8

template <typename T>
void forward_block(const DropoutForwardParams& p, int64_t start, int64_t end) {
  const T* x = static_cast<const T*>(p.x) + start;
  T* y = static_cast<T*>(p.y) + start;
  const int len = static_cast<int>(end - start);
  uint8_t bytes[kBlock / 8];
  cpu::keep_bits(p.rng, math::keep_threshold(p.p), start, len, bytes);
  const DropoutScale scale(p.p);
#pragma omp simd
  for (int k = 0; k < len; ++k) {
    const bool keep = (bytes[k >> 3] >> (k & 7)) & 1;
    math::store(y + k, scale.apply(math::to_float(x[k]), keep));
  }
  if (p.mask) std::copy(bytes, bytes + bit_mask_bytes<int64_t>(len), p.mask + start / 8);
}

template <typename T>
void backward_block(const DropoutBackwardParams& p, int64_t start, int64_t end) {
  const T* dy = static_cast<const T*>(p.grad_y) + start;
  T* dx = static_cast<T*>(p.grad_x) + start;
  const int len = static_cast<int>(end - start);
  uint8_t regenerated[kBlock / 8];
  const uint8_t* bytes = p.mask ? p.mask + start / 8 : regenerated;
  if (!p.mask) cpu::keep_bits(p.rng, math::keep_threshold(p.p), start, len, regenerated);
  const DropoutScale scale(p.p);
#pragma omp simd
  for (int k = 0; k < len; ++k) {
    const bool keep = (bytes[k >> 3] >> (k & 7)) & 1;
    math::store(dx + k, scale.apply(math::to_float(dy[k]), keep));
  }
}

}  // namespace

Status dropout_forward_cpu(const DropoutForwardParams& p) {
  Status s = detail::validate(p);
  if (!s.ok() || p.numel == 0) return s;
  math::by_dtype(p.dtype, [&](auto t) {
    cpu::run_blocks(p.numel, kBlock, [&](int64_t b, int64_t e) { forward_block<decltype(t)>(p, b, e); });
  });
  return Status::Ok();
}

Status dropout_backward_cpu(const DropoutBackwardParams& p) {
  Status s = detail::validate(p);
  if (!s.ok() || p.numel == 0) return s;
  math::by_dtype(p.dtype, [&](auto t) {
    cpu::run_blocks(p.numel, kBlock, [&](int64_t b, int64_t e) { backward_block<decltype(t)>(p, b, e); });
  });
  return Status::Ok();
}

}  // namespace tempo
