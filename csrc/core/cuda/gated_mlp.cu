// CUDA kernels of the gated MLP's elementwise part: one thread per 8 columns of a row, 16-byte
// loads and stores where every row start is 16-byte aligned (the common case: cols and the row
// strides multiples of 8 elements), grid-stride loop. The row of an item is one division, in
// 32 bits where the item count allows. act(g) and act'(g): gated_mlp_math.h (fp32 for 16/32-bit
// data, the C library's double for fp64).
#include <cuda_runtime.h>

#include <initializer_list>
#include <type_traits>
#include <utility>

#include "tempo/gated_mlp.h"
#include "../math/gated_mlp_math.h"
#include "common.cuh"

namespace tempo {
namespace {

using cuda::grid_for;
using cuda::kThreads;
using cuda::launch_status;
using cuda::load8;
using cuda::Pack8;
using cuda::store8;

template <Activation A, typename T>
__device__ __forceinline__ math::GateValue<math::acc_t<T>> gate_value(math::acc_t<T> x) {
  if constexpr (std::is_same_v<T, double>)
    return math::gate_exact<A>(x);
  else
    return math::gate_f32<A>(x);
}

// Item i: row i / per_row, columns 8 (i % per_row) onwards.
template <typename Index>
__device__ __forceinline__ void item_place(int64_t i, int64_t per_row, int64_t& row, int64_t& col0) {
  const Index r = static_cast<Index>(i) / static_cast<Index>(per_row);
  row = static_cast<int64_t>(r);
  col0 = 8 * (i - row * per_row);
}

template <Activation A, typename T, typename Index>
__global__ void gated_mlp_forward_kernel(GatedMlpForwardParams p, bool vec) {
  const int64_t per_row = (p.cols + 7) / 8, items = p.rows * per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < items; i += stride) {
    int64_t r, c0;
    item_place<Index>(i, per_row, r, c0);
    Pack8<T> g, u, h;
    load8(static_cast<const T*>(p.gate) + r * p.gate_stride, c0, p.cols, vec, g);
    load8(static_cast<const T*>(p.up) + r * p.up_stride, c0, p.cols, vec, u);
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const auto v = gate_value<A, T>(math::to_float(g.v[q]));
      math::store(&h.v[q], v.f * math::to_float(u.v[q]));
    }
    store8(static_cast<T*>(p.h) + r * p.cols, c0, p.cols, vec, h);
  }
}

template <Activation A, typename T, typename Index, bool WithH>
__global__ void gated_mlp_backward_kernel(GatedMlpBackwardParams p, bool vec) {
  const int64_t per_row = (p.cols + 7) / 8, items = p.rows * per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < items; i += stride) {
    int64_t r, c0;
    item_place<Index>(i, per_row, r, c0);
    Pack8<T> g, u, dh, dg, du, h;
    load8(static_cast<const T*>(p.gate) + r * p.gate_stride, c0, p.cols, vec, g);
    load8(static_cast<const T*>(p.up) + r * p.up_stride, c0, p.cols, vec, u);
    load8(static_cast<const T*>(p.grad_h) + r * p.cols, c0, p.cols, vec, dh);
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const auto v = gate_value<A, T>(math::to_float(g.v[q]));
      const auto uq = math::to_float(u.v[q]), dhq = math::to_float(dh.v[q]);
      math::store(&dg.v[q], dhq * uq * (v.d1 + v.d2));
      math::store(&du.v[q], dhq * v.f);
      if constexpr (WithH) math::store(&h.v[q], v.f * uq);
    }
    store8(static_cast<T*>(p.grad_gate) + r * p.grad_gate_stride, c0, p.cols, vec, dg);
    store8(static_cast<T*>(p.grad_up) + r * p.grad_up_stride, c0, p.cols, vec, du);
    if constexpr (WithH) store8(static_cast<T*>(p.h) + r * p.cols, c0, p.cols, vec, h);
  }
}

// Every row start 16-byte aligned: the base pointers and each row stride in bytes.
template <typename T>
bool rows_aligned(std::initializer_list<std::pair<const void*, int64_t>> arrays) {
  for (const auto& [ptr, stride] : arrays)
    if (!cuda::aligned16(ptr) || (stride * static_cast<int64_t>(sizeof(T))) % 16 != 0) return false;
  return true;
}

template <typename F>
Status dispatch(Activation act, DType dtype, F&& f) {
  const bool known = math::by_activation(act, [&](auto a) { math::by_dtype(dtype, [&](auto t) { f(a, t); }); });
  return known ? Status::Ok() : Status::Error("gated_mlp: unknown activation");
}

bool small_index(int64_t rows, int64_t cols) { return rows * ((cols + 7) / 8) < (int64_t{1} << 31); }

}  // namespace

Status gated_mlp_forward_cuda(const GatedMlpForwardParams& p, void* stream) {
  Status s = detail::validate(p);
  if (!s.ok() || p.rows == 0 || p.cols == 0) return s;
  auto st = static_cast<cudaStream_t>(stream);
  const int64_t items = p.rows * ((p.cols + 7) / 8);
  const Status d = dispatch(p.act, p.dtype, [&](auto a, auto t) {
    using T = decltype(t);
    constexpr Activation A = decltype(a)::value;
    const bool vec = rows_aligned<T>({{p.gate, p.gate_stride}, {p.up, p.up_stride}, {p.h, p.cols}});
    auto launch = [&](auto index) {
      gated_mlp_forward_kernel<A, T, decltype(index)><<<grid_for(items), kThreads, 0, st>>>(p, vec);
    };
    if (small_index(p.rows, p.cols))
      launch(uint32_t{});
    else
      launch(uint64_t{});
  });
  return d.ok() ? launch_status("gated_mlp forward") : d;
}

Status gated_mlp_backward_cuda(const GatedMlpBackwardParams& p, void* stream) {
  Status s = detail::validate(p);
  if (!s.ok() || p.rows == 0 || p.cols == 0) return s;
  auto st = static_cast<cudaStream_t>(stream);
  const int64_t items = p.rows * ((p.cols + 7) / 8);
  const Status d = dispatch(p.act, p.dtype, [&](auto a, auto t) {
    using T = decltype(t);
    constexpr Activation A = decltype(a)::value;
    const bool vec = rows_aligned<T>({{p.gate, p.gate_stride},
                                      {p.up, p.up_stride},
                                      {p.grad_h, p.cols},
                                      {p.grad_gate, p.grad_gate_stride},
                                      {p.grad_up, p.grad_up_stride},
                                      {p.h ? p.h : p.grad_h, p.cols}});
    const int grid = grid_for(items);
    auto launch = [&](auto index) {
      using Index = decltype(index);
      if (p.h)
        gated_mlp_backward_kernel<A, T, Index, true><<<grid, kThreads, 0, st>>>(p, vec);
      else
        gated_mlp_backward_kernel<A, T, Index, false><<<grid, kThreads, 0, st>>>(p, vec);
    };
    if (small_index(p.rows, p.cols))
      launch(uint32_t{});
    else
      launch(uint64_t{});
  });
  return d.ok() ? launch_status("gated_mlp backward") : d;
}

}  // namespace tempo
