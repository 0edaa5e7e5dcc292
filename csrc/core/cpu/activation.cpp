// CPU kernels of the in-place activations: blocks of kBlock elements (whole mask bytes)
// spread over OpenMP threads. The forward's inner loops are written for the
// auto-vectoriser; the fp32 backward has AVX-512 and AVX2 versions (activation_simd.h),
// chosen at run time, beside the scalar definition in activation_math.h.
#include "tempo/activation.h"

#include <algorithm>
#include <vector>

#include "../math/activation_math.h"
#include "activation_simd.h"
#include "dispatch.h"

namespace tempo {
namespace {

using math::acc_t;
using math::bf16_t;
using math::fp16_t;

constexpr int64_t kBlock = 2048;  // elements per work item; a multiple of 8

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

int g_simd_cap = 2;  // 0: scalar only, 1: up to AVX2, 2: up to AVX-512 (detail::set_cpu_simd)

// g(y, m) for a block of fp32 outputs; len is a multiple of 16 except in the last block.
template <Activation A>
void grad_block(const float* y, const uint8_t* mask, float* g, int len) {
  int done = 0;
#ifdef TEMPO_HAVE_SIMD_KERNELS
  const cpu_simd::Isa isa = cpu_simd::best_isa();
  if (isa == cpu_simd::Isa::kAvx512 && g_simd_cap >= 2) {
    cpu_simd::grad_from_output_avx512<A>(y, mask, g, len / 16);
    done = len / 16 * 16;
  } else if (isa != cpu_simd::Isa::kScalar && g_simd_cap >= 1) {
    cpu_simd::grad_from_output_avx2<A>(y, mask, g, len / 8);
    done = len / 8 * 8;
  }
#endif
  for (int k = done; k < len; ++k) g[k] = math::act_grad_from_output<A>(y[k], ((mask[k >> 3] >> (k & 7)) & 1) != 0);
}

// GCC 12 cannot see that grad_block reads only the len elements written into g.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <Activation A, typename T>
void backward_block(const ActivationBackwardParams& p, int64_t start, int64_t end) {
  const T* y = static_cast<const T*>(p.y) + start;
  const T* dy = static_cast<const T*>(p.grad_y) + start;
  T* dx = static_cast<T*>(p.grad_x) + start;
  const uint8_t* mask = p.mask + start / 8;
  const int len = static_cast<int>(end - start);
  if constexpr (std::is_same_v<T, double>) {
    for (int k = 0; k < len; ++k)
      dx[k] = dy[k] * math::act_grad_from_output<A>(y[k], ((mask[k >> 3] >> (k & 7)) & 1) != 0);
  } else {
    alignas(64) float g[kBlock];
    const float* yf;
    if constexpr (std::is_same_v<T, float>) {
      yf = y;
    } else {
      // 16-bit outputs: widen into g first; grad_block may write g over its input.
#pragma omp simd
      for (int k = 0; k < len; ++k) g[k] = math::to_float(y[k]);
      yf = g;
    }
    grad_block<A>(yf, mask, g, len);
#pragma omp simd
    for (int k = 0; k < len; ++k) math::store(dx + k, math::to_float(dy[k]) * g[k]);
  }
}

#pragma GCC diagnostic pop

// Runs kernel<A, T>(p, begin, end) over p's elements for p.act and p.dtype.
template <template <Activation, typename> class Kernel, typename P>
Status dispatch(const P& p) {
  const bool known = math::by_activation(p.act, [&](auto act_tag) {
    constexpr Activation A = decltype(act_tag)::value;
    math::by_dtype(p.dtype, [&](auto t) {
      cpu::run_blocks(p.numel, kBlock, [&](int64_t b, int64_t e) { Kernel<A, decltype(t)>::run(p, b, e); });
    });
  });
  return known ? Status::Ok() : Status::Error("activation: unknown activation");
}

// The backward with the bias gradient fused in: the grad_x each group of blocks stores is added
// into the group's double column sums (cpu::run_groups), then the groups in order: the same
// sums for any thread count.
template <Activation A, typename T>
void backward_with_bias(const ActivationBackwardParams& p) {
  const int64_t M = p.bias_size;
  const int64_t blocks = (p.numel + kBlock - 1) / kBlock;
  const bool parallel = p.numel >= cpu::kParallelMinElems && blocks > 1;
  const int64_t groups = cpu::reduction_groups(blocks);
  std::vector<double> parts(static_cast<size_t>(groups) * M, 0.0);
  cpu::run_groups(blocks, parallel, [&](int64_t g, int64_t b0, int64_t b1) {
    double* part = parts.data() + static_cast<size_t>(g) * M;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * kBlock, end = std::min(p.numel, start + kBlock);
      backward_block<A, T>(p, start, end);
      const T* dx = static_cast<const T*>(p.grad_x);
      for (int64_t i = start; i < end;) {
        const int64_t col = i % M;
        const int64_t run = std::min(end - i, M - col);
        double* pc = part + col;
        const T* di = dx + i;
#pragma omp simd
        for (int64_t k = 0; k < run; ++k) pc[k] += static_cast<double>(math::to_float(di[k]));
        i += run;
      }
    }
  });
  cpu::add_group_partials(parts, groups, M);
  T* gb = static_cast<T*>(p.grad_bias);
  for (int64_t j = 0; j < M; ++j) math::store(gb + j, static_cast<math::acc_t<T>>(parts[j]));
}

template <Activation A, typename T>
struct Forward {
  static void run(const ActivationForwardParams& p, int64_t b, int64_t e) { forward_block<A, T>(p, b, e); }
};
template <Activation A, typename T>
struct Backward {
  static void run(const ActivationBackwardParams& p, int64_t b, int64_t e) { backward_block<A, T>(p, b, e); }
};

}  // namespace

namespace detail {
int set_cpu_simd(int max_level) {
  const int previous = g_simd_cap;
  g_simd_cap = max_level;
  return previous;
}
}  // namespace detail

Status activation_forward_cpu(const ActivationForwardParams& p) {
  Status s = detail::validate(p);
  if (!s.ok() || p.numel == 0) return s;
  return dispatch<Forward>(p);
}

Status activation_backward_cpu(const ActivationBackwardParams& p) {
  Status s = detail::validate(p);
  if (!s.ok() || p.numel == 0) return s;
  if (!p.grad_bias) return dispatch<Backward>(p);
  const bool known = math::by_activation(p.act, [&](auto act_tag) {
    math::by_dtype(p.dtype, [&](auto t) { backward_with_bias<decltype(act_tag)::value, decltype(t)>(p); });
  });
  return known ? Status::Ok() : Status::Error("activation: unknown activation");
}

}  // namespace tempo
