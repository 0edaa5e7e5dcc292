// CUDA kernels of linear_cross_entropy's row passes: one block a row (grid-stride over rows),
// each thread walking the row's packs of 8 logits (16-byte loads where the rows are aligned,
// else one element at a time) with a running maximum and sum (the sum rescaled when the maximum
// grows, once a pack), the threads' (maximum, sum, sum of logits) then combined by the block.
// The backward writes each element's gradient over its logit, 8 at a time where aligned.
// Sums in the math type (float for 16/32-bit data): each thread's partial over V / 512 logits,
// then a tree over the block (an error of about (V/512 + 9) float roundings, relative).
#include <cfloat>

#include "tempo/linear_cross_entropy.h"
#include "../math/softmax.h"
#include "common.cuh"

namespace tempo {
namespace {

// A running log-sum-exp: the maximum m seen and sum s of e^(z - m) over what was seen (s = 0
// while nothing finite was), and the plain sum of the logits (the smoothing's mean).
template <typename Acc>
struct RowSums {
  Acc m, s, zs;
  __device__ void add_max_shifted(Acc pm, const Acc* v, int n) {  // pm: the max of v[0 .. n)
    if (pm > m) {
      s = m > -static_cast<Acc>(INFINITY) ? s * math::exp_shifted<Acc>(m - pm) : Acc(0);
      m = pm;
    }
    if (m > -static_cast<Acc>(INFINITY))
      for (int q = 0; q < n; ++q) s += math::exp_shifted<Acc>(v[q] - m);
    for (int q = 0; q < n; ++q) zs += v[q];
  }
  __device__ void merge(Acc m2, Acc s2, Acc zs2) {
    const Acc neg_inf = -static_cast<Acc>(INFINITY);
    const Acc mm = m2 > m ? m2 : m;
    if (mm > neg_inf)
      s = (m > neg_inf ? s * math::exp_shifted<Acc>(m - mm) : Acc(0)) +
          (m2 > neg_inf ? s2 * math::exp_shifted<Acc>(m2 - mm) : Acc(0));
    m = mm;
    zs += zs2;
  }
};

template <typename T>
__global__ void linear_cross_entropy_forward_kernel(LinearCrossEntropyForwardParams p, bool vec) {
  using Acc = math::acc_t<T>;
  __shared__ Acc sm[32], ss[32], sz[32];
  const int64_t V = p.vocab;
  const Acc neg_inf = -static_cast<Acc>(INFINITY);
  const T* z = static_cast<const T*>(p.logits);
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const T* zr = z + r * V;
    RowSums<Acc> acc{neg_inf, Acc(0), Acc(0)};
    if (vec) {
      for (int64_t pk = threadIdx.x; pk < V / 8; pk += blockDim.x) {
        cuda::Pack8<T> in;
        cuda::load8v(zr, pk * 8, in);
        Acc v[8], pm = neg_inf;
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          v[q] = math::to_float(in.v[q]);
          pm = v[q] > pm ? v[q] : pm;
        }
        acc.add_max_shifted(pm, v, 8);
      }
    } else {
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
        const Acc v = math::to_float(zr[j]);
        acc.add_max_shifted(v, &v, 1);
      }
    }
    // the block's combination: within each warp by shuffles, then warp 0 over the warps
    for (int o = 16; o > 0; o >>= 1)
      acc.merge(__shfl_xor_sync(0xffffffffu, acc.m, o), __shfl_xor_sync(0xffffffffu, acc.s, o),
                __shfl_xor_sync(0xffffffffu, acc.zs, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
      sm[warp] = acc.m;
      ss[warp] = acc.s;
      sz[warp] = acc.zs;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      RowSums<Acc> all{sm[0], ss[0], sz[0]};
      for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) all.merge(sm[w], ss[w], sz[w]);
      // NaN anywhere (then the logits' sum is NaN), or every logit -inf, gives NaN, as torch's
      // log_softmax does
      const Acc l = all.zs != all.zs || !(all.m > neg_inf) ? static_cast<Acc>(NAN) : all.m + log(all.s);
      static_cast<Acc*>(p.lse)[r] = l;
      const int64_t y = p.labels[r];
      Acc loss = 0;
      if (y != p.ignore_index) {
        const int64_t yc = linear_cross_entropy_label_column(y, V);
        const Acc eps = static_cast<Acc>(p.smoothing);
        loss = -(Acc(1) - eps) * (math::to_float(zr[yc]) - l);
        // without smoothing no mean term: a row with a -inf logit (a masked token) has a finite loss
        if (eps != Acc(0)) loss -= eps * (all.zs / static_cast<Acc>(V) - l);
      }
      static_cast<Acc*>(p.loss)[r] = loss;
    }
    __syncthreads();  // sm, ss, sz are reused by the next row
  }
}

template <typename T>
__global__ void linear_cross_entropy_backward_kernel(LinearCrossEntropyBackwardParams p, bool vec) {
  using Acc = math::acc_t<T>;
  const int64_t V = p.vocab;
  const Acc eps = static_cast<Acc>(p.smoothing);
  const Acc spread = eps / static_cast<Acc>(V), hit = Acc(1) - eps;
  T* z = static_cast<T*>(p.logits);
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    T* zr = z + r * V;
    const Acc l = static_cast<const Acc*>(p.lse)[r], s = static_cast<const Acc*>(p.scale)[r];
    const int64_t y = linear_cross_entropy_label_column(p.labels[r], V);  // ignored rows: s = 0
    auto grad = [&](Acc v, int64_t j) {
      return s * (math::exp_shifted<Acc>(v - l) - spread - (j == y ? hit : Acc(0)));
    };
    if (vec) {
      for (int64_t pk = threadIdx.x; pk < V / 8; pk += blockDim.x) {
        cuda::Pack8<T> in, out;
        cuda::load8v(zr, pk * 8, in);
#pragma unroll
        for (int q = 0; q < 8; ++q) math::store(&out.v[q], grad(math::to_float(in.v[q]), pk * 8 + q));
        cuda::store8v(zr, pk * 8, out);
      }
    } else {
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) math::store(zr + j, grad(math::to_float(zr[j]), j));
    }
  }
}

// Rows start on 16-byte boundaries, and hold whole packs of 8 (fp64 moves scalars).
template <typename T>
bool vectorised(const void* base, int64_t vocab) {
  return sizeof(T) <= 4 && cuda::aligned16(base) && vocab % 8 == 0;
}

}  // namespace

Status linear_cross_entropy_forward_cuda(const LinearCrossEntropyForwardParams& p, void* stream) {
  Status s = detail::validate(p);
  if (!s.ok() || p.rows == 0) return s;
  auto st = static_cast<cudaStream_t>(stream);
  math::by_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    linear_cross_entropy_forward_kernel<T>
        <<<cuda::row_grid(p.rows), 2 * cuda::kThreads, 0, st>>>(p, vectorised<T>(p.logits, p.vocab));
  });
  return cuda::launch_status("linear cross entropy forward");
}

Status linear_cross_entropy_backward_cuda(const LinearCrossEntropyBackwardParams& p, void* stream) {
  Status s = detail::validate(p);
  if (!s.ok() || p.rows == 0) return s;
  auto st = static_cast<cudaStream_t>(stream);
  math::by_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    linear_cross_entropy_backward_kernel<T>
        <<<cuda::row_grid(p.rows), 2 * cuda::kThreads, 0, st>>>(p, vectorised<T>(p.logits, p.vocab));
  });
  return cuda::launch_status("linear cross entropy backward");
}

}  // namespace tempo
