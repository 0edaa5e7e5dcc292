// CPU kernels of the in-place activations: blocks of kBlock elements (whole mask bytes)
// spread over OpenMP threads; inner loops written for the auto-vectoriser.
#include "tempo/activation.h"

#include <algorithm>

#include "../math/activation_math.h"

namespace tempo {
namespace {

using math::acc_t;
using math::bf16_t;
using math::fp16_t;

constexpr int64_t kBlock = 2048;  // elements per work item; a multiple of 8
constexpr int64_t kParallelMin = 1 << 15;

template <Activation A, typename T>
void forward_block(const ActivationForwardParams& p, int64_t start, int64_t end) {
  using Acc = acc_t<T>;
  const T* x = static_cast<const T*>(p.x);
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  const int64_t len = end - start;
  Acc z[kBlock];
  if (bias) {
    for (int64_t i = start; i < end;) {
      const int64_t col = i % p.bias_size;
      const int64_t run = std::min(end - i, p.bias_size - col);
      const T* xi = x + i;
      const T* bi = bias + col;
      Acc* zi = z + (i - start);
#pragma omp simd
      for (int64_t k = 0; k < run; ++k) zi[k] = math::to_float(xi[k]) + math::to_float(bi[k]);
      i += run;
    }
  } else {
#pragma omp simd
    for (int64_t k = 0; k < len; ++k) z[k] = math::to_float(x[start + k]);
  }
#pragma omp simd
  for (int64_t k = 0; k < len; ++k) math::store(y + start + k, math::act_forward<A>(z[k]));
  uint8_t* mask = p.mask + start / 8;
  const int64_t full = len / 8;
  for (int64_t j = 0; j < full; ++j) {
    unsigned byte = 0;
    for (int q = 0; q < 8; ++q) byte |= static_cast<unsigned>(math::act_branch<A>(z[8 * j + q])) << q;
    mask[j] = static_cast<uint8_t>(byte);
  }
  if (full * 8 < len) {
    unsigned byte = 0;
    for (int64_t k = full * 8; k < len; ++k) byte |= static_cast<unsigned>(math::act_branch<A>(z[k])) << (k - full * 8);
    mask[full] = static_cast<uint8_t>(byte);
  }
}

template <Activation A, typename T>
void backward_block(const ActivationBackwardParams& p, int64_t start, int64_t end) {
  using Acc = acc_t<T>;
  const T* y = static_cast<const T*>(p.y) + start;
  const T* dy = static_cast<const T*>(p.grad_y) + start;
  T* dx = static_cast<T*>(p.grad_x) + start;
  const uint8_t* mask = p.mask + start / 8;
  const int len = static_cast<int>(end - start);
  // Unpack the branch bits and widen y into contiguous buffers first, so that the main
  // loop below reads only unit-stride data.
  alignas(64) int32_t right[kBlock];
  alignas(64) Acc yf[kBlock];
  for (int j = 0; j < (len + 7) / 8; ++j) {
    const int32_t byte = mask[j];
#pragma omp simd
    for (int q = 0; q < 8; ++q) right[8 * j + q] = (byte >> q) & 1;
  }
#pragma omp simd
  for (int k = 0; k < len; ++k) yf[k] = math::to_float(y[k]);
#pragma omp simd
  for (int k = 0; k < len; ++k) {
    const Acc g = math::act_grad_from_output<A>(yf[k], right[k] != 0);
    math::store(dx + k, math::to_float(dy[k]) * g);
  }
}

template <typename Block, typename P>
void run_blocks(const P& p, Block block) {
  const int64_t blocks = (p.numel + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (p.numel >= kParallelMin)
  for (int64_t b = 0; b < blocks; ++b) block(p, b * kBlock, std::min(p.numel, (b + 1) * kBlock));
}

template <template <Activation, typename> class Launch, typename P>
Status dispatch(const P& p) {
  auto by_type = [&](auto act_tag) -> Status {
    constexpr Activation A = decltype(act_tag)::value;
    switch (p.dtype) {
      case DType::kFloat32: Launch<A, float>::run(p); break;
      case DType::kFloat64: Launch<A, double>::run(p); break;
      case DType::kBFloat16: Launch<A, bf16_t>::run(p); break;
      case DType::kFloat16: Launch<A, fp16_t>::run(p); break;
    }
    return Status::Ok();
  };
  switch (p.act) {
    case Activation::kGeluErf: return by_type(std::integral_constant<Activation, Activation::kGeluErf>{});
    case Activation::kGeluTanh: return by_type(std::integral_constant<Activation, Activation::kGeluTanh>{});
    case Activation::kSilu: return by_type(std::integral_constant<Activation, Activation::kSilu>{});
  }
  return Status::Error("activation: unknown activation");
}

template <Activation A, typename T>
struct Forward {
  static void run(const ActivationForwardParams& p) { run_blocks(p, forward_block<A, T>); }
};
template <Activation A, typename T>
struct Backward {
  static void run(const ActivationBackwardParams& p) { run_blocks(p, backward_block<A, T>); }
};

}  // namespace

Status activation_forward_cpu(const ActivationForwardParams& p) {
  Status s = detail::validate(p);
  if (!s.ok() || p.numel == 0) return s;
  return dispatch<Forward>(p);
}

Status activation_backward_cpu(const ActivationBackwardParams& p) {
  Status s = detail::validate(p);
  if (!s.ok() || p.numel == 0) return s;
  return dispatch<Backward>(p);
}

}  // namespace tempo
