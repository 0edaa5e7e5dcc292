// CUDA kernels of the in-place activations: one thread per mask byte (8 elements), 16-byte
// vector loads and stores when the pointers allow, grid-stride loop, 64-bit indexing.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "tempo/activation.h"
#include "../math/activation_f32.h"
#include "../math/activation_math.h"
#include "common.cuh"

namespace tempo {

bool cuda_compiled() { return true; }

namespace {

using math::acc_t;

using cuda::aligned16;
using cuda::grid_for;
using cuda::kThreads;
using cuda::launch_status;
using cuda::load8;
using cuda::Pack8;
using cuda::store8;

// The forward value (activation_f32.h): for fp32 data the float-float fp32 forward (within
// kF32ForwardUlps, which the fp32 backward's bound needs); for bf16/fp16 the plain fp32 one
// (within kF16PathForwardUlps of the 16-bit rounding, a quarter of the instructions); the C
// library's double for fp64.
template <Activation A, typename T>
__device__ __forceinline__ float forward_value(float z) {
  if constexpr (std::is_same_v<T, float>)
    return math::act_forward_f32<A>(z);
  else
    return math::act_forward_plain<A>(z);
}
template <Activation A, typename T>
__device__ __forceinline__ double forward_value(double z) {
  return math::act_forward<A>(z);
}

template <Activation A, typename T>
__global__ void activation_forward_kernel(ActivationForwardParams p, bool vec) {
  using Acc = acc_t<T>;
  const T* x = static_cast<const T*>(p.x);
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
  const int64_t bytes = bit_mask_bytes(p.numel);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < bytes; b += stride) {
    const int64_t i0 = b * 8;
    Pack8<T> in, out;
    load8(x, i0, p.numel, vec, in);
    unsigned bits = 0;
    // the bias column of element i0, then stepped (one 64-bit remainder per 8 elements)
    int64_t col = bias ? i0 % p.bias_size : 0;
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      Acc z = math::to_float(in.v[q]);
      if (bias) {
        z += math::to_float(bias[col]);
        col = col + 1 == p.bias_size ? 0 : col + 1;
      }
      math::store(&out.v[q], forward_value<A, T>(z));
      bits |= (i0 + q < p.numel && math::act_branch<A>(z)) ? (1u << q) : 0u;
    }
    store8(y, i0, p.numel, vec, out);
    p.mask[b] = static_cast<uint8_t>(bits);
  }
}

template <Activation A, typename T>
__global__ void activation_backward_kernel(ActivationBackwardParams p, bool vec) {
  const T* y = static_cast<const T*>(p.y);
  const T* dy = static_cast<const T*>(p.grad_y);
  T* dx = static_cast<T*>(p.grad_x);
  const int64_t bytes = bit_mask_bytes(p.numel);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < bytes; b += stride) {
    const int64_t i0 = b * 8;
    Pack8<T> yv, dyv, out;
    load8(y, i0, p.numel, vec, yv);
    load8(dy, i0, p.numel, vec, dyv);
    const unsigned bits = p.mask[b];
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const auto g = math::act_grad_from_output<A>(math::to_float(yv.v[q]), ((bits >> q) & 1u) != 0);
      math::store(&out.v[q], math::to_float(dyv.v[q]) * g);
    }
    store8(dx, i0, p.numel, vec, out);
  }
}

// The backward with the bias gradient (bdrb): block (column tile, row group); each thread owns
// one column (coalesced across the warp), walks its group's rows storing grad_x and adding it
// up, and writes its partial sum; column_group_sums_kernel then adds the groups in order.
template <Activation A, typename T>
__global__ void activation_backward_bias_kernel(ActivationBackwardParams p, int64_t rows_per_group) {
  using Acc = acc_t<T>;
  const T* y = static_cast<const T*>(p.y);
  const T* dy = static_cast<const T*>(p.grad_y);
  T* dx = static_cast<T*>(p.grad_x);
  const int64_t M = p.bias_size, rows = p.numel / M;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= M) return;
  const int64_t r0 = blockIdx.y * rows_per_group, r1 = min(rows, r0 + rows_per_group);
  Acc sum = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r * M + c;
    const auto g = math::act_grad_from_output<A>(math::to_float(y[i]), ((p.mask[i >> 3] >> (i & 7)) & 1u) != 0);
    T out;
    math::store(&out, math::to_float(dy[i]) * g);
    dx[i] = out;
    sum += math::to_float(out);
  }
  static_cast<Acc*>(p.workspace)[blockIdx.y * M + c] = sum;
}

template <typename F>
Status dispatch(Activation act, DType dtype, F&& f) {
  const bool known =
      math::by_activation(act, [&](auto act_tag) { math::by_dtype(dtype, [&](auto t) { f(act_tag, t); }); });
  return known ? Status::Ok() : Status::Error("activation: unknown activation");
}

}  // namespace

Status activation_forward_cuda(const ActivationForwardParams& p, void* stream) {
  Status s = detail::validate(p);
  if (!s.ok() || p.numel == 0) return s;
  const bool vec = aligned16(p.x) && aligned16(p.y);
  const int64_t bytes = bit_mask_bytes(p.numel);
  auto st = static_cast<cudaStream_t>(stream);
  const Status d = dispatch(p.act, p.dtype, [&](auto act_tag, auto t) {
    activation_forward_kernel<decltype(act_tag)::value, decltype(t)><<<grid_for(bytes), kThreads, 0, st>>>(p, vec);
  });
  return d.ok() ? launch_status("activation forward") : d;
}

Status activation_backward_cuda(const ActivationBackwardParams& p, void* stream) {
  Status s = detail::validate(p);
  if (!s.ok() || p.numel == 0) return s;
  auto st = static_cast<cudaStream_t>(stream);
  if (p.grad_bias) {
    TEMPO_CORE_CHECK(p.workspace, "activation backward: the CUDA bias gradient needs its workspace");
    const int64_t M = p.bias_size, rows = p.numel / M;
    const int64_t groups = activation_backward_workspace_elems(p.numel, M) / M;
    const int64_t per_group = (rows + groups - 1) / groups;
    const dim3 grid(static_cast<unsigned>((M + kThreads - 1) / kThreads), static_cast<unsigned>(groups));
    const Status d = dispatch(p.act, p.dtype, [&](auto act_tag, auto t) {
      using T = decltype(t);
      activation_backward_bias_kernel<decltype(act_tag)::value, T><<<grid, kThreads, 0, st>>>(p, per_group);
      const auto* parts = static_cast<const acc_t<T>*>(p.workspace);
      cuda::column_group_sums_kernel<T><<<grid.x, kThreads, 0, st>>>(parts, groups, M, static_cast<T*>(p.grad_bias));
    });
    return d.ok() ? launch_status("activation backward (bias gradient)") : d;
  }
  const bool vec = aligned16(p.y) && aligned16(p.grad_y) && aligned16(p.grad_x);
  const int64_t bytes = bit_mask_bytes(p.numel);
  const Status d = dispatch(p.act, p.dtype, [&](auto act_tag, auto t) {
    activation_backward_kernel<decltype(act_tag)::value, decltype(t)><<<grid_for(bytes), kThreads, 0, st>>>(p, vec);
  });
  return d.ok() ? launch_status("activation backward") : d;
}

}  // namespace tempo
