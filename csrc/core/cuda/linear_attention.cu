// CUDA kernels of causal linear attention: one block per row (batch x head), grid-stride over
// rows; the running sums in double, S (and its gradient G) in the workspace (m x d per row),
// z, its gradient and the position's q and k in shared memory. Threads split the d columns
// of S for the updates and the m features for the reductions over columns.
#include "tempo/linear_attention.h"
#include "../math/numeric.h"
#include "common.cuh"

namespace tempo {
namespace {

constexpr int kLaThreads = 128;
constexpr int64_t kMaxSharedBytes = 48 * 1024;

template <typename T>
using state_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
__device__ double ld(const T* p, int64_t i) {
  return static_cast<double>(math::to_float(p[i]));
}

// dst[0 .. n) = src[offset ..] (a state, or its gradient, in the state type St), or zeros when
// src is null; the block's threads split the elements.
template <typename St>
__device__ void load_or_zero(const void* src, int64_t offset, int64_t n, double* dst) {
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) dst[e] = src ? static_cast<const St*>(src)[offset + e] : 0.0;
}

template <typename T>
__global__ void linear_attention_forward_kernel(LinearAttentionForwardParams p) {
  using St = state_t<T>;
  extern __shared__ double sh[];
  const int64_t m = p.m, d = p.d;
  double* z = sh;
  double* qs = z + m;
  double* ks = qs + m;
  double* red = ks + m;
  const int tid = threadIdx.x, bd = blockDim.x;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    double* S = static_cast<double*>(p.workspace) + r * m * d;
    const T* q = static_cast<const T*>(p.q) + r * p.len * m;
    const T* k = static_cast<const T*>(p.k) + r * p.len * m;
    const T* v = static_cast<const T*>(p.v) + r * p.len * d;
    T* y = static_cast<T*>(p.y) + r * p.len * d;
    load_or_zero<St>(p.num_in, r * m * d, m * d, S);
    load_or_zero<St>(p.den_in, r * m, m, z);
    __syncthreads();
    for (int64_t l = 0; l < p.len; ++l) {
      double part = 0.0;
      for (int64_t i = tid; i < m; i += bd) {
        qs[i] = ld(q, l * m + i);
        ks[i] = ld(k, l * m + i);
        z[i] += ks[i];
        part += z[i] * qs[i];
      }
      const double den = cuda::block_reduce(part, red) + p.eps;  // syncs: qs, ks visible
      for (int64_t j = tid; j < d; j += bd) {
        const double vj = ld(v, l * d + j);
        double n = 0.0;
        for (int64_t i = 0; i < m; ++i) {
          const double s = S[i * d + j] + ks[i] * vj;
          S[i * d + j] = s;
          n += s * qs[i];
        }
        math::store(y + l * d + j, static_cast<math::acc_t<T>>(n / den));
      }
      __syncthreads();
    }
    for (int64_t e = tid; e < m * d; e += bd) static_cast<St*>(p.num_out)[r * m * d + e] = static_cast<St>(S[e]);
    for (int64_t i = tid; i < m; i += bd) static_cast<St*>(p.den_out)[r * m + i] = static_cast<St>(z[i]);
    __syncthreads();
  }
}

template <typename T>
__global__ void linear_attention_backward_kernel(LinearAttentionBackwardParams p) {
  using St = state_t<T>;
  extern __shared__ double sh[];
  const int64_t m = p.m, d = p.d;
  double* z = sh;
  double* H = z + m;
  double* qs = H + m;
  double* ks = qs + m;
  double* gn = ks + m;
  double* vs = gn + d;
  double* red = vs + d;
  const int tid = threadIdx.x, bd = blockDim.x;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    double* S = static_cast<double*>(p.workspace) + r * m * d;
    double* G = static_cast<double*>(p.workspace) + (p.rows + r) * m * d;
    const T* q = static_cast<const T*>(p.q) + r * p.len * m;
    const T* k = static_cast<const T*>(p.k) + r * p.len * m;
    const T* v = static_cast<const T*>(p.v) + r * p.len * d;
    const T* dy = static_cast<const T*>(p.grad_y) + r * p.len * d;
    T* gq = static_cast<T*>(p.grad_q) + r * p.len * m;
    T* gk = static_cast<T*>(p.grad_k) + r * p.len * m;
    T* gv = static_cast<T*>(p.grad_v) + r * p.len * d;
    // The sums after the chunk, from the state in; the gradients of the state out.
    load_or_zero<St>(p.num_in, r * m * d, m * d, S);
    load_or_zero<St>(p.grad_num_out, r * m * d, m * d, G);
    load_or_zero<St>(p.den_in, r * m, m, z);
    load_or_zero<St>(p.grad_den_out, r * m, m, H);
    __syncthreads();
    for (int64_t l = 0; l < p.len; ++l) {
      for (int64_t i = tid; i < m; i += bd) {
        ks[i] = ld(k, l * m + i);
        z[i] += ks[i];
      }
      __syncthreads();
      for (int64_t j = tid; j < d; j += bd) {
        const double vj = ld(v, l * d + j);
        for (int64_t i = 0; i < m; ++i) S[i * d + j] += ks[i] * vj;
      }
      __syncthreads();
    }
    for (int64_t l = p.len - 1; l >= 0; --l) {
      double part = 0.0;
      for (int64_t i = tid; i < m; i += bd) {
        qs[i] = ld(q, l * m + i);
        ks[i] = ld(k, l * m + i);
        part += z[i] * qs[i];
      }
      const double D = cuda::block_reduce(part, red) + p.eps;  // syncs: qs, ks visible
      double gyn = 0.0;
      for (int64_t j = tid; j < d; j += bd) {
        double n = 0.0;
        for (int64_t i = 0; i < m; ++i) n += S[i * d + j] * qs[i];
        const double g = ld(dy, l * d + j);
        gyn += g * n;
        gn[j] = g / D;
        vs[j] = ld(v, l * d + j);
      }
      const double gD = -cuda::block_reduce(gyn, red) / (D * D);  // syncs: gn, vs visible
      for (int64_t i = tid; i < m; i += bd) {
        double a = z[i] * gD;
        for (int64_t j = 0; j < d; ++j) a += S[i * d + j] * gn[j];
        math::store(gq + l * m + i, static_cast<math::acc_t<T>>(a));
        H[i] += qs[i] * gD;
      }
      __syncthreads();
      for (int64_t j = tid; j < d; j += bd) {
        double a = 0.0;
        for (int64_t i = 0; i < m; ++i) {
          G[i * d + j] += qs[i] * gn[j];
          a += G[i * d + j] * ks[i];
          S[i * d + j] -= ks[i] * vs[j];
        }
        math::store(gv + l * d + j, static_cast<math::acc_t<T>>(a));
      }
      __syncthreads();
      for (int64_t i = tid; i < m; i += bd) {
        double a = H[i];
        for (int64_t j = 0; j < d; ++j) a += G[i * d + j] * vs[j];
        math::store(gk + l * m + i, static_cast<math::acc_t<T>>(a));
        z[i] -= ks[i];
      }
      __syncthreads();
    }
    for (int64_t e = tid; e < m * d; e += bd) static_cast<St*>(p.grad_num_in)[r * m * d + e] = static_cast<St>(G[e]);
    for (int64_t i = tid; i < m; i += bd) static_cast<St*>(p.grad_den_in)[r * m + i] = static_cast<St>(H[i]);
    __syncthreads();
  }
}

Status shared_fits(int64_t bytes, const char* what) {
  TEMPO_CORE_CHECK(bytes <= kMaxSharedBytes, std::string(what) +
                                                 ": the feature size m and value size d are too "
                                                 "large for the CUDA kernel's shared memory");
  return Status::Ok();
}

}  // namespace

Status linear_attention_forward_cuda(const LinearAttentionForwardParams& p, void* stream) {
  Status s = detail::validate(p);
  if (!s.ok() || p.rows == 0) return s;
  TEMPO_CORE_CHECK(p.workspace, "causal linear attention forward: the CUDA kernel needs its workspace");
  const int64_t shared = (3 * p.m + 32) * static_cast<int64_t>(sizeof(double));
  s = shared_fits(shared, "causal linear attention forward");
  if (!s.ok()) return s;
  auto st = static_cast<cudaStream_t>(stream);
  math::by_dtype(p.dtype, [&](auto t) {
    linear_attention_forward_kernel<decltype(t)><<<cuda::row_grid(p.rows), kLaThreads, shared, st>>>(p);
  });
  return cuda::launch_status("causal linear attention forward");
}

Status linear_attention_backward_cuda(const LinearAttentionBackwardParams& p, void* stream) {
  Status s = detail::validate(p);
  if (!s.ok() || p.rows == 0) return s;
  TEMPO_CORE_CHECK(p.workspace, "causal linear attention backward: the CUDA kernel needs its workspace");
  const int64_t shared = (4 * p.m + 2 * p.d + 32) * static_cast<int64_t>(sizeof(double));
  s = shared_fits(shared, "causal linear attention backward");
  if (!s.ok()) return s;
  auto st = static_cast<cudaStream_t>(stream);
  math::by_dtype(p.dtype, [&](auto t) {
    linear_attention_backward_kernel<decltype(t)><<<cuda::row_grid(p.rows), kLaThreads, shared, st>>>(p);
  });
  return cuda::launch_status("causal linear attention backward");
}

}  // namespace tempo
