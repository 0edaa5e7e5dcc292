// CPU kernels of the rotary embedding: rows (batch, head, position) over OpenMP threads, each
// row's pairs rotated by math::rope_pair and its columns past rotary_dim copied.
#include "tempo/rope.h"

#include <algorithm>

#include "../math/rope_math.h"
#include "dispatch.h"

namespace tempo {
namespace {

template <typename T, typename C>
void rope_rows(const RopeParams& p, bool backward) {
  using A = math::acc_t<T>;
  const int64_t H = p.heads, S = p.seq, D = p.head_dim, R = p.rotary_dim, h = R / 2;
  const T* x = static_cast<const T*>(p.x);
  const C* cos = static_cast<const C*>(p.cos);
  const C* sin = static_cast<const C*>(p.sin);
  T* out = static_cast<T*>(p.out);
#pragma omp parallel for schedule(static) if (p.numel() >= cpu::kParallelMinElems)
  for (int64_t r = 0; r < p.rows(); ++r) {
    const int64_t b = r / (H * S), a = (r / S) % H, s = r % S;
    const T* xr = x + b * p.x_stride_batch + a * p.x_stride_head + s * p.x_stride_seq;
    const int64_t t = ((p.table_batch == 1 ? 0 : b) * S + s) * R;
    const C* cr = cos + t;
    const C* sr = sin + t;
    T* o = out + b * p.out_stride_batch + a * p.out_stride_head + s * p.out_stride_seq;
    for (int64_t j = 0; j < h; ++j) {
      A o0, o1;
      math::rope_pair<A>(math::to_float(xr[j]), math::to_float(xr[j + h]), math::to_float(cr[j]), math::to_float(sr[j]),
                         math::to_float(cr[j + h]), math::to_float(sr[j + h]), backward, o0, o1);
      math::store(o + j, o0);
      math::store(o + j + h, o1);
    }
    std::copy(xr + R, xr + D, o + R);
  }
}

Status run(const RopeParams& p, bool backward) {
  Status s = detail::validate(p);
  if (!s.ok() || p.numel() == 0) return s;
  math::by_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    if (p.table_dtype == p.dtype)
      rope_rows<T, T>(p, backward);
    else if constexpr (sizeof(T) == 2)
      rope_rows<T, float>(p, backward);
  });
  return Status::Ok();
}

}  // namespace

Status rope_forward_cpu(const RopeParams& p) { return run(p, false); }
Status rope_backward_cpu(const RopeParams& p) { return run(p, true); }

}  // namespace tempo
