// CUDA kernel of the rotary embedding: a grid-stride loop over (row, pairs) items and (row,
// passed-through columns) items, 8 an item with 16-byte accesses where the sizes, strides and
// alignment allow, else 1 (index arithmetic in 32 bits below 2^31 elements).
#include <algorithm>

#include "tempo/rope.h"
#include "../math/rope_math.h"
#include "common.cuh"

namespace tempo {
namespace {

// The x row, the output row and the table row of row r = (b, a, s).
template <typename I>
__device__ __forceinline__ void rope_row(const RopeParams& p, I r, I& x_off, I& o_off, I& t_off) {
  const I H = static_cast<I>(p.heads), S = static_cast<I>(p.seq);
  const I b = r / (H * S), a = (r / S) % H, s = r % S;
  x_off =
      b * static_cast<I>(p.x_stride_batch) + a * static_cast<I>(p.x_stride_head) + s * static_cast<I>(p.x_stride_seq);
  o_off = b * static_cast<I>(p.out_stride_batch) + a * static_cast<I>(p.out_stride_head) +
          s * static_cast<I>(p.out_stride_seq);
  t_off = ((p.table_batch == 1 ? I{0} : b) * S + s) * static_cast<I>(p.rotary_dim);
}

// V elements of base at off into v.v[0 .. V): one 16-byte access for V = 8 (aligned), else one.
template <int V, typename T, typename I>
__device__ __forceinline__ void load_v(const T* base, I off, cuda::Pack8<T>& v) {
  if constexpr (V == 8)
    cuda::load8v(base, off, v);
  else
    v.v[0] = base[off];
}
template <int V, typename T, typename I>
__device__ __forceinline__ void store_v(T* base, I off, const cuda::Pack8<T>& v) {
  if constexpr (V == 8)
    cuda::store8v(base, off, v);
  else
    base[off] = v.v[0];
}

// Item e of row r, V pairs or columns an item (8 where the sizes, strides and alignment allow:
// 16-byte accesses; else 1): e < h / V rotates pairs V e .. V e + V - 1 with their partners
// h further, the rest copy V columns past rotary_dim.
template <typename T, typename C, typename I, int V>
__global__ void rope_kernel(RopeParams p, bool backward) {
  using A = math::acc_t<T>;
  const I D = static_cast<I>(p.head_dim), R = static_cast<I>(p.rotary_dim), h = R / 2;
  const I rot = h / V, per_row = rot + (D - R) / V, n = static_cast<I>(p.rows()) * per_row;
  const T* x = static_cast<const T*>(p.x);
  const C* cos = static_cast<const C*>(p.cos);
  const C* sin = static_cast<const C*>(p.sin);
  T* out = static_cast<T*>(p.out);
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  for (I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const I r = i / per_row, e = i % per_row;
    I xo, oo, to;
    rope_row(p, r, xo, oo, to);
    if (e < rot) {
      const I j = e * V;
      cuda::Pack8<T> a, b, o0, o1;
      cuda::Pack8<C> c0, s0, c1, s1;
      load_v<V>(x, xo + j, a);
      load_v<V>(x, xo + j + h, b);
      load_v<V>(cos, to + j, c0);
      load_v<V>(sin, to + j, s0);
      load_v<V>(cos, to + j + h, c1);
      load_v<V>(sin, to + j + h, s1);
#pragma unroll
      for (int q = 0; q < V; ++q) {
        A v0, v1;
        math::rope_pair<A>(math::to_float(a.v[q]), math::to_float(b.v[q]), math::to_float(c0.v[q]),
                           math::to_float(s0.v[q]), math::to_float(c1.v[q]), math::to_float(s1.v[q]), backward, v0, v1);
        math::store(&o0.v[q], v0);
        math::store(&o1.v[q], v1);
      }
      store_v<V>(out, oo + j, o0);
      store_v<V>(out, oo + j + h, o1);
    } else {
      const I c = R + (e - rot) * V;
      cuda::Pack8<T> v;
      load_v<V>(x, xo + c, v);
      store_v<V>(out, oo + c, v);
    }
  }
}

template <typename T, typename C>
void launch(const RopeParams& p, bool backward, cudaStream_t st) {
  const int64_t h = p.rotary_dim / 2, D = p.head_dim;
  const bool packs = h % 8 == 0 && (D - p.rotary_dim) % 8 == 0 && p.x_stride_batch % 8 == 0 &&
                     p.x_stride_head % 8 == 0 && p.x_stride_seq % 8 == 0 && p.out_stride_batch % 8 == 0 &&
                     p.out_stride_head % 8 == 0 && p.out_stride_seq % 8 == 0 && cuda::aligned16(p.x) &&
                     cuda::aligned16(p.out) && cuda::aligned16(p.cos) && cuda::aligned16(p.sin);
  // the largest element offset any index reaches: x's and out's through their strides, the tables'
  const int64_t reach = std::max(
      {p.numel(), p.table_batch * p.seq * p.rotary_dim,
       (p.batch - 1) * p.x_stride_batch + (p.heads - 1) * p.x_stride_head + (p.seq - 1) * p.x_stride_seq + D,
       (p.batch - 1) * p.out_stride_batch + (p.heads - 1) * p.out_stride_head + (p.seq - 1) * p.out_stride_seq + D});
  const bool narrow = reach < (int64_t{1} << 31);
  if constexpr (sizeof(T) <= 4) {
    if (packs) {
      const int64_t items = p.rows() * (h / 8 + (D - p.rotary_dim) / 8);
      if (narrow)
        rope_kernel<T, C, uint32_t, 8><<<cuda::grid_for(items), cuda::kThreads, 0, st>>>(p, backward);
      else
        rope_kernel<T, C, int64_t, 8><<<cuda::grid_for(items), cuda::kThreads, 0, st>>>(p, backward);
      return;
    }
  }
  const int64_t items = p.rows() * (h + D - p.rotary_dim);
  if (narrow)
    rope_kernel<T, C, uint32_t, 1><<<cuda::grid_for(items), cuda::kThreads, 0, st>>>(p, backward);
  else
    rope_kernel<T, C, int64_t, 1><<<cuda::grid_for(items), cuda::kThreads, 0, st>>>(p, backward);
}

Status run(const RopeParams& p, bool backward, void* stream, const char* what) {
  Status s = detail::validate(p);
  if (!s.ok() || p.numel() == 0) return s;
  auto st = static_cast<cudaStream_t>(stream);
  math::by_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    if (p.table_dtype == p.dtype)
      launch<T, T>(p, backward, st);
    else if constexpr (sizeof(T) == 2)
      launch<T, float>(p, backward, st);
  });
  return cuda::launch_status(what);
}

}  // namespace

Status rope_forward_cuda(const RopeParams& p, void* stream) { return run(p, false, stream, "rope forward"); }
Status rope_backward_cuda(const RopeParams& p, void* stream) { return run(p, true, stream, "rope backward"); }

}  // namespace tempo
