// CUDA kernels of the q/k/v split: the forward a grid-stride loop over elements, or over packs of
// 8 with 16-byte accesses where head_dim and the alignment allow; the backward one thread per
// column of dz over a group of tokens, the bias gradient from the groups' partial sums.
#include <algorithm>

#include "tempo/qkv_split.h"
#include "common.cuh"

namespace tempo {
namespace {

// Element (t, c) of z [tokens, 3 A D]: c = (w A + a) D + j goes to out[w] at ((b A + a) S + s) D + j.
template <typename T>
__global__ void qkv_split_forward_kernel(QkvSplitForwardParams p) {
  const int64_t S = p.seq, A = p.heads, D = p.head_dim, M = p.cols(), n = p.numel();
  const T* z = static_cast<const T*>(p.z);
  const T* bias = static_cast<const T*>(p.bias);
  // (three pointers chosen by value, not an array indexed at run time: that lived on the stack)
  T* const q = static_cast<T*>(p.q);
  T* const k = static_cast<T*>(p.k);
  T* const vv = static_cast<T*>(p.v);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t t = i / M, c = i % M, w = c / (A * D), a = (c / D) % A, j = c % D;
    const int64_t b = t / S, s = t % S;
    T v = z[i];
    if (bias) math::store(&v, math::to_float(v) + math::to_float(bias[c]));
    (w == 0 ? q : w == 1 ? k : vv)[((b * A + a) * S + s) * D + j] = v;
  }
}

// The same with 8 elements a thread (head_dim a multiple of 8, every tensor 16-byte aligned):
// the 8 lie in one head's row in z and in the output alike, so one set of index divisions and
// one 16-byte load and store serve them (the general kernel divides five times an element), in
// 32-bit arithmetic (I) where the tensor has fewer than 2^31 elements.
template <typename T, typename I>
__global__ void qkv_split_forward_packs_kernel(QkvSplitForwardParams p) {
  const I S = static_cast<I>(p.seq), A = static_cast<I>(p.heads), D = static_cast<I>(p.head_dim),
          M = static_cast<I>(p.cols()), packs = static_cast<I>(p.numel() / 8);
  const T* z = static_cast<const T*>(p.z);
  const T* bias = static_cast<const T*>(p.bias);
  T* const q = static_cast<T*>(p.q);
  T* const k = static_cast<T*>(p.k);
  T* const vv = static_cast<T*>(p.v);
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  for (I pk = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; pk < packs; pk += stride) {
    const I i = pk * 8, t = i / M, c = i % M, w = c / (A * D), a = (c / D) % A, j = c % D;
    const I b = t / S, s = t % S;
    cuda::Pack8<T> v;
    cuda::load8v(z, i, v);
    if (bias) {
      cuda::Pack8<T> bv;
      cuda::load8v(bias, c, bv);
#pragma unroll
      for (int e = 0; e < 8; ++e) math::store(&v.v[e], math::to_float(v.v[e]) + math::to_float(bv.v[e]));
    }
    cuda::store8v(w == 0 ? q : w == 1 ? k : vv, ((b * A + a) * S + s) * D + j, v);
  }
}

// Block (column tile, token group): each thread owns one column of dz, walks the group's
// tokens gathering dz and, with a bias, adding it up into its partial sum.
template <typename T>
__global__ void qkv_split_backward_kernel(QkvSplitBackwardParams p, int64_t tokens_per_group) {
  using Acc = math::acc_t<T>;
  const int64_t S = p.seq, A = p.heads, D = p.head_dim, M = p.cols(), tokens = p.batch * S;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= M) return;
  const int64_t w = c / (A * D), a = (c / D) % A, j = c % D;
  const T* in = static_cast<const T*>(w == 0 ? p.grad_q : w == 1 ? p.grad_k : p.grad_v);
  T* dz = static_cast<T*>(p.grad_z);
  const int64_t t0 = blockIdx.y * tokens_per_group, t1 = min(tokens, t0 + tokens_per_group);
  Acc sum = 0;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t b = t / S, s = t % S;
    const T v = in[((b * A + a) * S + s) * D + j];
    dz[t * M + c] = v;
    sum += math::to_float(v);
  }
  if (p.grad_bias) static_cast<Acc*>(p.workspace)[blockIdx.y * M + c] = sum;
}

}  // namespace

Status qkv_split_forward_cuda(const QkvSplitForwardParams& p, void* stream) {
  Status s = detail::validate(p);
  if (!s.ok() || p.numel() == 0) return s;
  auto st = static_cast<cudaStream_t>(stream);
  const bool packs = p.head_dim % 8 == 0 && cuda::aligned16(p.z) && cuda::aligned16(p.bias) && cuda::aligned16(p.q) &&
                     cuda::aligned16(p.k) && cuda::aligned16(p.v);
  math::by_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    if constexpr (sizeof(T) <= 4) {
      if (packs) {
        if (p.numel() < (int64_t{1} << 31))
          qkv_split_forward_packs_kernel<T, uint32_t><<<cuda::grid_for(p.numel() / 8), cuda::kThreads, 0, st>>>(p);
        else
          qkv_split_forward_packs_kernel<T, int64_t><<<cuda::grid_for(p.numel() / 8), cuda::kThreads, 0, st>>>(p);
        return;
      }
    }
    qkv_split_forward_kernel<T><<<cuda::grid_for(p.numel()), cuda::kThreads, 0, st>>>(p);
  });
  return cuda::launch_status("qkv split forward");
}

Status qkv_split_backward_cuda(const QkvSplitBackwardParams& p, void* stream) {
  Status s = detail::validate(p);
  if (!s.ok()) return s;
  auto st = static_cast<cudaStream_t>(stream);
  const int64_t M = p.cols(), tokens = p.batch * p.seq;
  if (M == 0) return s;
  TEMPO_CORE_CHECK(!p.grad_bias || p.workspace, "qkv split backward: the CUDA bias gradient needs its workspace");
  const int64_t groups = qkv_split_workspace_elems(tokens, M) / M;
  const int64_t per_group = std::max<int64_t>(1, (tokens + groups - 1) / groups);
  const unsigned tiles = static_cast<unsigned>((M + cuda::kThreads - 1) / cuda::kThreads);
  math::by_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    if (tokens > 0)
      qkv_split_backward_kernel<T><<<dim3(tiles, static_cast<unsigned>(groups)), cuda::kThreads, 0, st>>>(p, per_group);
    else if (p.grad_bias)
      cudaMemsetAsync(p.workspace, 0, sizeof(math::acc_t<T>) * M, st);
    if (p.grad_bias) {
      const auto* parts = static_cast<const math::acc_t<T>*>(p.workspace);
      cuda::column_group_sums_kernel<T>
          <<<tiles, cuda::kThreads, 0, st>>>(parts, tokens > 0 ? groups : 1, M, static_cast<T*>(p.grad_bias));
    }
  });
  return cuda::launch_status("qkv split backward");
}

}  // namespace tempo
