// CUDA kernels of LayerNorm / RMSNorm and the fused bias-dropout-residual prologue.
// Forward: one block per row (grid-stride over rows), block reductions in the math type, the
// mean corrected by a second pass.
// Backward: kNormBackwardGroups row groups, each block accumulating its columns' partial sums of
// dgamma / dbeta / dbias (the prologue's) in registers (rows up to 8192 wide; in the workspace
// beyond) and storing them once in the workspace, then one thread per column adds the groups
// (no atomics: deterministic).
#include "tempo/norm.h"
#include "../math/philox.h"
#include "common.cuh"

#include <type_traits>

namespace tempo {
namespace {

// h = residual + dropout(x + bias), each step rounded to T as the unfused ops store it;
// or x without the prologue.
template <typename T>
__device__ math::acc_t<T> load_h(const NormForwardParams& p, const PhiloxState& rng, int64_t r, int64_t j,
                                 uint64_t threshold, const DropoutScale& scale) {
  using Acc = math::acc_t<T>;
  const int64_t e = r * p.cols + j;
  const Acc xv = math::to_float(static_cast<const T*>(p.x)[e]);
  if (!p.prologue.residual) return xv;
  const T* pb = static_cast<const T*>(p.prologue.bias);
  Acc v = math::round_to_acc<T>(xv + (pb ? math::to_float(pb[j]) : Acc(0)));
  if (p.prologue.p > 0.0) v = math::round_to_acc<T>(scale.apply(v, cuda::keep_bit(p.mask, rng, threshold, e)));
  return math::round_to_acc<T>(math::to_float(static_cast<const T*>(p.prologue.residual)[e]) + v);
}

// T: the data's type; P: the parameters' (T, or float with float_params).
template <typename T, typename P>
__global__ void norm_forward_kernel(NormForwardParams p, uint64_t threshold, DropoutScale scale) {
  using Acc = math::acc_t<T>;
  __shared__ Acc shared[32];
  const PhiloxState rng = cuda::resolve(p.prologue.rng);
  const P* w = static_cast<const P*>(p.weight);
  const P* b = static_cast<const P*>(p.beta);
  T* y = static_cast<T*>(p.y);
  const int64_t M = p.cols;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    // Two passes, the second corrected (as the CPU kernel): the deviations from the first
    // mean and their squares; the mean's error (its rounding, of the row's magnitude) is then
    // the shift mean(d), and deviations (x - mean) - shift err by a rounding of their own size.
    Acc mean = 0, shift = 0, var = 0;
    if (p.kind == NormKind::kLayerNorm) {
      Acc s = 0;
      for (int64_t j = threadIdx.x; j < M; j += blockDim.x) s += load_h<T>(p, rng, r, j, threshold, scale);
      mean = cuda::block_reduce(s, shared) / static_cast<Acc>(M);
      Acc s1 = 0, s2 = 0;
      for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
        const Acc d = load_h<T>(p, rng, r, j, threshold, scale) - mean;
        s1 += d;
        s2 += d * d;
      }
      s1 = cuda::block_reduce(s1, shared);
      s2 = cuda::block_reduce(s2, shared);
      shift = s1 / static_cast<Acc>(M);
      const Acc v = (s2 - s1 * shift) / static_cast<Acc>(M);  // >= 0 but for rounding
      var = v > Acc(0) ? v : Acc(0);
    } else {
      Acc ss = 0;
      for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
        const Acc h = load_h<T>(p, rng, r, j, threshold, scale);
        ss += h * h;
      }
      var = cuda::block_reduce(ss, shared) / static_cast<Acc>(M);
    }
    const Acc rstd = static_cast<Acc>(1) / sqrt(var + static_cast<Acc>(p.eps));
    if (threadIdx.x == 0) static_cast<Acc*>(p.rstd)[r] = rstd;
    for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
      Acc v = ((load_h<T>(p, rng, r, j, threshold, scale) - mean) - shift) * rstd;
      if (p.kept > 0 && p.kept_slot[j] >= 0) static_cast<Acc*>(p.kept_xhat)[r * p.kept + p.kept_slot[j]] = v;
      if (w) v *= math::to_float(w[j]);
      if (b) v += math::to_float(b[j]);
      math::store(y + r * M + j, v);
    }
  }
}

// xhat of element (r, j): read where column j is kept, else recovered from y.
template <typename T, typename P>
__device__ math::acc_t<T> xhat_at(const NormBackwardParams& p, int64_t r, int64_t j, math::acc_t<T> gamma) {
  using Acc = math::acc_t<T>;
  if (p.kept > 0 && p.kept_slot[j] >= 0) return static_cast<const Acc*>(p.kept_xhat)[r * p.kept + p.kept_slot[j]];
  const P* b = static_cast<const P*>(p.beta);
  return (math::to_float(static_cast<const T*>(p.y)[r * p.cols + j]) - (b ? math::to_float(b[j]) : Acc(0))) / gamma;
}

// K > 0: each thread owns the columns threadIdx.x + k blockDim.x (k < K; K blockDim.x >= M) and
// keeps their dgamma / dbeta / dbias partial sums in registers over the block's rows, storing
// them once; K = 0 (rows wider than that): the partial sums are added in the workspace.
template <typename T, typename P, int K>
__global__ void __launch_bounds__(512)
    norm_backward_kernel(NormBackwardParams p, uint64_t threshold, DropoutScale scale) {
  using Acc = math::acc_t<T>;
  __shared__ Acc shared[32];
  const PhiloxState rng = cuda::resolve(p.prologue.rng);
  const int64_t M = p.cols;
  const T* dy = static_cast<const T*>(p.grad_y);
  const P* w = static_cast<const P*>(p.weight);
  const Acc* rstd = static_cast<const Acc*>(p.rstd);
  Acc* part = static_cast<Acc*>(p.workspace) + static_cast<int64_t>(blockIdx.x) * 3 * M;
  const bool prologue = p.grad_residual != nullptr;
  const bool dropout = prologue && p.prologue.p > 0.0;
  constexpr int KR = K > 0 ? K : 1;
  Acc rw[KR], rb[KR], rpb[KR];
#pragma unroll
  for (int k = 0; k < KR; ++k) rw[k] = rb[k] = rpb[k] = 0;
  if (K == 0)
    for (int64_t j = threadIdx.x; j < 3 * M; j += blockDim.x) part[j] = 0;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    Acc c1 = 0, c2 = 0;
    for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
      const Acc g = math::to_float(dy[r * M + j]);
      const Acc gamma = w ? math::to_float(w[j]) : Acc(1);
      // gy * xhat: dy * (y - beta) where recovered (no division), gy * the kept xhat elsewhere.
      if (p.kept > 0 && p.kept_slot[j] >= 0) {
        c1 += g * gamma * static_cast<const Acc*>(p.kept_xhat)[r * p.kept + p.kept_slot[j]];
      } else {
        const P* b = static_cast<const P*>(p.beta);
        c1 += g * (math::to_float(static_cast<const T*>(p.y)[r * M + j]) - (b ? math::to_float(b[j]) : Acc(0)));
      }
      c2 += g * gamma;
    }
    const Acc m1 = cuda::block_reduce(c1, shared) / static_cast<Acc>(M);
    const Acc m2 = p.kind == NormKind::kLayerNorm ? cuda::block_reduce(c2, shared) / static_cast<Acc>(M) : Acc(0);
    const Acc rs = rstd[r];
    auto column = [&](int64_t j, Acc& aw, Acc& ab, Acc& apb) {
      const int64_t e = r * M + j;
      const Acc g = math::to_float(dy[e]);
      const Acc gamma = w ? math::to_float(w[j]) : Acc(1);
      const Acc xhat = xhat_at<T, P>(p, r, j, gamma);
      const Acc dh = rs * (g * gamma - xhat * m1 - m2);
      aw += g * xhat;
      ab += g;
      if (prologue) {
        math::store(static_cast<T*>(p.grad_residual) + e, dh);
        Acc d = math::round_to_acc<T>(dh);
        if (dropout) d = scale.apply(d, cuda::keep_bit(p.mask, rng, threshold, e));
        math::store(static_cast<T*>(p.grad_x) + e, d);
        apb += math::round_to_acc<T>(d);
      } else {
        math::store(static_cast<T*>(p.grad_x) + e, dh);
      }
    };
    if constexpr (K > 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
        if (j < M) column(j, rw[k], rb[k], rpb[k]);
      }
    } else {
      for (int64_t j = threadIdx.x; j < M; j += blockDim.x) column(j, part[j], part[M + j], part[2 * M + j]);
    }
  }
  if constexpr (K > 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (j < M) {
        part[j] = rw[k];
        part[M + j] = rb[k];
        part[2 * M + j] = rpb[k];
      }
    }
  }
}

// K = 16, for 16/32-bit data only; false (nothing launched) for fp64.
template <typename T, typename P>
bool launch_backward_k16(const NormBackwardParams& p, int groups, int threads, uint64_t threshold, cudaStream_t st) {
  if constexpr (sizeof(T) <= 4) {
    norm_backward_kernel<T, P, 16><<<groups, threads, 0, st>>>(p, threshold, DropoutScale(p.prologue.p));
    return true;
  } else {
    return false;
  }
}

// The backward's launch: K columns per thread in registers for rows up to 16 x 512 wide
// (256 threads up to 4096 columns, 512 above), the workspace path beyond.
template <typename T, typename P>
void launch_norm_backward(const NormBackwardParams& p, int groups, uint64_t threshold, cudaStream_t st) {
  const DropoutScale scale(p.prologue.p);
  const int64_t M = p.cols;
  const int threads = M > 16 * cuda::kThreads ? 2 * cuda::kThreads : cuda::kThreads;
  const int64_t per = (M + threads - 1) / threads;
  if (per <= 1)
    norm_backward_kernel<T, P, 1><<<groups, threads, 0, st>>>(p, threshold, scale);
  else if (per <= 2)
    norm_backward_kernel<T, P, 2><<<groups, threads, 0, st>>>(p, threshold, scale);
  else if (per <= 4)
    norm_backward_kernel<T, P, 4><<<groups, threads, 0, st>>>(p, threshold, scale);
  else if (per <= 8)
    norm_backward_kernel<T, P, 8><<<groups, threads, 0, st>>>(p, threshold, scale);
  else if (per <= 16 && launch_backward_k16<T, P>(p, groups, threads, threshold, st))
    return;  // fp64: the workspace path (K=16 spills)
  else
    norm_backward_kernel<T, P, 0><<<groups, cuda::kThreads, 0, st>>>(p, threshold, scale);
}

template <typename T, typename P>
__global__ void norm_column_sum_kernel(NormBackwardParams p, int groups) {
  using Acc = math::acc_t<T>;
  const int64_t M = p.cols;
  const Acc* ws = static_cast<const Acc*>(p.workspace);
  // (two pointers, not an array indexed by a runtime value: that would live on the stack)
  P* const gw = p.weight ? static_cast<P*>(p.grad_weight) : nullptr;
  P* const gb = p.beta ? static_cast<P*>(p.grad_beta) : nullptr;
  T* bias = static_cast<T*>(p.grad_bias);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < 3 * M; j += stride) {
    const int64_t which = j / M;
    P* const param = which == 0 ? gw : gb;
    if (which < 2 ? !param : !bias) continue;
    Acc s = 0;
    for (int g = 0; g < groups; ++g) s += ws[static_cast<int64_t>(g) * 3 * M + j];
    if (which < 2)
      math::store(param + j % M, s);
    else
      math::store(bias + j % M, s);
  }
}

// ---- rows in registers, 16-byte accesses (the fast path) ------------------------------------
// (__launch_bounds__(512): these kernels launch up to 512 threads, which leaves 128 registers
// a thread; without the bound ptxas gave the backward 154 and the launch would fail.)
// For 16/32-bit data whose rows are a multiple of 8 wide (so that a row starts on a mask byte)
// and whose tensors are 16-byte aligned: one block per row, each thread holding V packs of 8
// elements (pack k*blockDim.x + threadIdx.x) in registers, read and written as 16-byte words.
// The forward reads x (and the prologue's residual, bias) once and draws the dropout bits
// itself (writing the mask in bits mode); the backward reads dy and y once per row and keeps
// its dgamma / dbeta / dbias partial sums in registers. Same formulas, in the same order per
// element, as the kernels above; the sums are reduced in another order (within the tolerance
// the emulator tests hold).
constexpr int64_t kRowPack = 8;

template <typename T>
using Pack = cuda::Pack8<T>;

template <typename T, typename P, int V>
__global__ void __launch_bounds__(512)
    norm_forward_rows_kernel(NormForwardParams p, uint64_t threshold, DropoutScale scale) {
  using Acc = float;
  __shared__ Acc shared[32];
  const PhiloxState rng = cuda::resolve(p.prologue.rng);
  const int64_t M = p.cols, packs = M / kRowPack;
  const bool prologue = p.prologue.residual != nullptr;
  const bool dropout = prologue && p.prologue.p > 0.0;
  const P* w = static_cast<const P*>(p.weight);
  const P* b = static_cast<const P*>(p.beta);
  const T* pb = static_cast<const T*>(p.prologue.bias);
  Acc h[V][8];
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const T* xr = static_cast<const T*>(p.x) + r * M;
    Acc sum = 0;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t pk = static_cast<int64_t>(k) * blockDim.x + threadIdx.x;
#pragma unroll
      for (int q = 0; q < 8; ++q) h[k][q] = 0;
      if (pk >= packs) continue;
      Pack<T> xv;
      cuda::load8v(xr, pk * kRowPack, xv);
      if (!prologue) {
#pragma unroll
        for (int q = 0; q < 8; ++q) h[k][q] = math::to_float(xv.v[q]);
      } else {
        Pack<T> rv, bv;
        cuda::load8v(static_cast<const T*>(p.prologue.residual) + r * M, pk * kRowPack, rv);
        if (pb) cuda::load8v(pb, pk * kRowPack, bv);
        const int64_t byte = (r * M) / kRowPack + pk;
        uint32_t bits = 0xffu;
        if (dropout) {
          bits = math::keep_byte(rng.seed, rng.offset, byte, threshold);
          if (p.mask) p.mask[byte] = static_cast<uint8_t>(bits);
        }
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          Acc v = math::round_to_acc<T>(math::to_float(xv.v[q]) + (pb ? math::to_float(bv.v[q]) : Acc(0)));
          if (dropout) v = math::round_to_acc<T>(scale.apply(v, ((bits >> q) & 1u) != 0));
          h[k][q] = math::round_to_acc<T>(math::to_float(rv.v[q]) + v);
        }
      }
#pragma unroll
      for (int q = 0; q < 8; ++q) sum += p.kind == NormKind::kLayerNorm ? h[k][q] : h[k][q] * h[k][q];
    }
    Acc mean = 0, shift = 0, var = 0;
    if (p.kind == NormKind::kLayerNorm) {
      mean = cuda::block_reduce(sum, shared) / static_cast<Acc>(M);
      Acc s1 = 0, s2 = 0;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        if (static_cast<int64_t>(k) * blockDim.x + threadIdx.x >= packs) continue;
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          const Acc d = h[k][q] - mean;
          s1 += d;
          s2 += d * d;
        }
      }
      s1 = cuda::block_reduce(s1, shared);
      s2 = cuda::block_reduce(s2, shared);
      shift = s1 / static_cast<Acc>(M);
      const Acc v = (s2 - s1 * shift) / static_cast<Acc>(M);
      var = v > Acc(0) ? v : Acc(0);
    } else {
      var = cuda::block_reduce(sum, shared) / static_cast<Acc>(M);
    }
    const Acc rstd = static_cast<Acc>(1) / sqrt(var + static_cast<Acc>(p.eps));
    if (threadIdx.x == 0) static_cast<Acc*>(p.rstd)[r] = rstd;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t pk = static_cast<int64_t>(k) * blockDim.x + threadIdx.x;
      if (pk >= packs) continue;
      Pack<P> wv, bv;
      if (w) cuda::load8v(w, pk * kRowPack, wv);
      if (b) cuda::load8v(b, pk * kRowPack, bv);
      Pack<T> out;
      Pack<int32_t> slots;  // the kept columns' slots, 8 at a time (32 bytes, from the cache)
      if (p.kept > 0) cuda::load8v(p.kept_slot, pk * kRowPack, slots);
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        Acc v = ((h[k][q] - mean) - shift) * rstd;
        if (p.kept > 0 && slots.v[q] >= 0) static_cast<Acc*>(p.kept_xhat)[r * p.kept + slots.v[q]] = v;
        if (w) v *= math::to_float(wv.v[q]);
        if (b) v += math::to_float(bv.v[q]);
        math::store(&out.v[q], v);
      }
      cuda::store8v(static_cast<T*>(p.y) + r * M, pk * kRowPack, out);
    }
  }
}

template <typename T, typename P, int V>
__global__ void __launch_bounds__(512)
    norm_backward_rows_kernel(NormBackwardParams p, uint64_t threshold, DropoutScale scale) {
  using Acc = float;
  __shared__ Acc shared[32];
  const PhiloxState rng = cuda::resolve(p.prologue.rng);
  const int64_t M = p.cols, packs = M / kRowPack;
  const P* w = static_cast<const P*>(p.weight);
  const P* b = static_cast<const P*>(p.beta);
  const Acc* rstd = static_cast<const Acc*>(p.rstd);
  const bool prologue = p.grad_residual != nullptr;
  const bool dropout = prologue && p.prologue.p > 0.0;
  Acc aw[V][8], ab[V][8], apb[V][8], g[V][8], xh[V][8];
#pragma unroll
  for (int k = 0; k < V; ++k)
#pragma unroll
    for (int q = 0; q < 8; ++q) aw[k][q] = ab[k][q] = apb[k][q] = 0;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    Acc c1 = 0, c2 = 0;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t pk = static_cast<int64_t>(k) * blockDim.x + threadIdx.x;
      if (pk >= packs) continue;
      Pack<T> dv, yv;
      Pack<P> wv, bv;
      cuda::load8v(static_cast<const T*>(p.grad_y) + r * M, pk * kRowPack, dv);
      cuda::load8v(static_cast<const T*>(p.y) + r * M, pk * kRowPack, yv);
      if (w) cuda::load8v(w, pk * kRowPack, wv);
      if (b) cuda::load8v(b, pk * kRowPack, bv);
      Pack<int32_t> slots;
      if (p.kept > 0) cuda::load8v(p.kept_slot, pk * kRowPack, slots);
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const Acc gq = math::to_float(dv.v[q]);
        const Acc gamma = w ? math::to_float(wv.v[q]) : Acc(1);
        const int32_t slot = p.kept > 0 ? slots.v[q] : -1;
        const Acc centred = math::to_float(yv.v[q]) - (b ? math::to_float(bv.v[q]) : Acc(0));
        if (slot >= 0) {
          xh[k][q] = static_cast<const Acc*>(p.kept_xhat)[r * p.kept + slot];
          c1 += gq * gamma * xh[k][q];
        } else {
          xh[k][q] = centred / gamma;
          c1 += gq * centred;
        }
        c2 += gq * gamma;
        g[k][q] = gq;
      }
    }
    const Acc m1 = cuda::block_reduce(c1, shared) / static_cast<Acc>(M);
    const Acc m2 = p.kind == NormKind::kLayerNorm ? cuda::block_reduce(c2, shared) / static_cast<Acc>(M) : Acc(0);
    const Acc rs = rstd[r];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t pk = static_cast<int64_t>(k) * blockDim.x + threadIdx.x;
      if (pk >= packs) continue;
      Pack<P> wv;
      if (w) cuda::load8v(w, pk * kRowPack, wv);
      const int64_t byte = (r * M) / kRowPack + pk;
      uint32_t bits = 0xffu;
      if (dropout) bits = p.mask ? p.mask[byte] : math::keep_byte(rng.seed, rng.offset, byte, threshold);
      Pack<T> dxv, drv;
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const Acc gamma = w ? math::to_float(wv.v[q]) : Acc(1);
        const Acc dh = rs * (g[k][q] * gamma - xh[k][q] * m1 - m2);
        aw[k][q] += g[k][q] * xh[k][q];
        ab[k][q] += g[k][q];
        if (prologue) {
          math::store(&drv.v[q], dh);
          Acc d = math::round_to_acc<T>(dh);
          if (dropout) d = scale.apply(d, ((bits >> q) & 1u) != 0);
          math::store(&dxv.v[q], d);
          apb[k][q] += math::round_to_acc<T>(d);
        } else {
          math::store(&dxv.v[q], dh);
        }
      }
      cuda::store8v(static_cast<T*>(p.grad_x) + r * M, pk * kRowPack, dxv);
      if (prologue) cuda::store8v(static_cast<T*>(p.grad_residual) + r * M, pk * kRowPack, drv);
    }
  }
  Acc* part = static_cast<Acc*>(p.workspace) + static_cast<int64_t>(blockIdx.x) * 3 * M;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int64_t pk = static_cast<int64_t>(k) * blockDim.x + threadIdx.x;
    if (pk >= packs) continue;
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const int64_t j = pk * kRowPack + q;
      part[j] = aw[k][q];
      part[M + j] = ab[k][q];
      part[2 * M + j] = apb[k][q];
    }
  }
}

// Threads and packs per thread of the fast path for rows of `cols`: V (1, 2 or 4, at most
// max_v) packs of 8 elements a thread, at most 512 threads (a multiple of 32). 0: no fast path.
inline int rows_threads(int64_t cols, int v) {
  const int64_t packs = cols / kRowPack;
  const int64_t t = (packs + v - 1) / v;
  return static_cast<int>((t + 31) / 32 * 32);
}

inline bool rows_fit(int64_t cols, int max_v) { return cols % kRowPack == 0 && cols / kRowPack <= 512 * max_v; }

inline int rows_v(int64_t cols) {
  for (int v : {1, 2, 4})
    if (rows_threads(cols, v) <= 512) return v;
  return 0;
}

}  // namespace

Status norm_forward_cuda(const NormForwardParams& p, void* stream) {
  Status s = detail::validate(p);
  if (!s.ok() || p.rows * p.cols == 0) return s;
  auto st = static_cast<cudaStream_t>(stream);
  const uint64_t threshold = math::keep_threshold(p.prologue.p);
  const bool dropout = p.prologue.residual && p.prologue.p > 0.0;
  NormForwardParams launched = p;
  if (!dropout || p.prologue.mode != DropoutMode::kBits) launched.mask = nullptr;  // philox: draw in place
  const bool fast = p.dtype != DType::kFloat64 && rows_fit(p.cols, 4) && cuda::aligned16(p.x) && cuda::aligned16(p.y) &&
                    cuda::aligned16(p.weight) && cuda::aligned16(p.beta) && cuda::aligned16(p.prologue.residual) &&
                    cuda::aligned16(p.prologue.bias) && cuda::aligned16(p.kept_slot);
  if (fast) {
    const int v = rows_v(p.cols), threads = rows_threads(p.cols, v);
    const int grid = cuda::row_grid(p.rows);
    const DropoutScale scale(p.prologue.p);
    math::by_dtype(p.dtype, [&](auto t) {
      using T = decltype(t);
      if constexpr (!std::is_same_v<T, double>) {
        auto go = [&](auto param_tag) {
          using P = decltype(param_tag);
          if (v == 1)
            norm_forward_rows_kernel<T, P, 1><<<grid, threads, 0, st>>>(launched, threshold, scale);
          else if (v == 2)
            norm_forward_rows_kernel<T, P, 2><<<grid, threads, 0, st>>>(launched, threshold, scale);
          else
            norm_forward_rows_kernel<T, P, 4><<<grid, threads, 0, st>>>(launched, threshold, scale);
        };
        if (sizeof(T) == 2 && p.float_params)
          go(float{});
        else
          go(T{});
      }
    });
    return cuda::launch_status("norm forward");
  }
  if (launched.mask) {
    cuda::keep_bits_kernel<<<cuda::grid_for(bit_mask_bytes(p.rows * p.cols)), cuda::kThreads, 0, st>>>(
        p.prologue.rng, launched.mask, p.rows * p.cols, threshold);
  }
  const int grid = cuda::row_grid(p.rows);
  math::by_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    if constexpr (sizeof(T) == 2) {  // float_params: 16-bit data only (validated)
      if (p.float_params) {
        norm_forward_kernel<T, float><<<grid, cuda::kThreads, 0, st>>>(launched, threshold, DropoutScale(p.prologue.p));
        return;
      }
    }
    norm_forward_kernel<T, T><<<grid, cuda::kThreads, 0, st>>>(launched, threshold, DropoutScale(p.prologue.p));
  });
  return cuda::launch_status("norm forward");
}

Status norm_backward_cuda(const NormBackwardParams& p, void* stream) {
  Status s = detail::validate(p);
  if (!s.ok()) return s;
  if (p.cols == 0) return s;
  TEMPO_CORE_CHECK(p.workspace, "norm backward: the CUDA backward needs its workspace");
  auto st = static_cast<cudaStream_t>(stream);
  const uint64_t threshold = math::keep_threshold(p.prologue.p);
  NormBackwardParams launched = p;
  if (!(p.grad_residual && p.prologue.p > 0.0 && p.prologue.mode == DropoutMode::kBits)) launched.mask = nullptr;
  const int groups = static_cast<int>(std::max<int64_t>(1, std::min(p.rows, kNormBackwardGroups)));
  // Rows up to 4096 wide (one pack a thread): with two, ptxas spills under the 128 registers
  // that 512 threads leave; wider rows take the K-column kernel below (no spill).
  const bool fast = p.dtype != DType::kFloat64 && rows_fit(p.cols, 1) && cuda::aligned16(p.grad_y) &&
                    cuda::aligned16(p.y) && cuda::aligned16(p.grad_x) && cuda::aligned16(p.grad_residual) &&
                    cuda::aligned16(p.weight) && cuda::aligned16(p.beta) && cuda::aligned16(p.kept_slot);
  if (fast) {
    const int v = rows_v(p.cols), threads = rows_threads(p.cols, v);
    const DropoutScale scale(p.prologue.p);
    math::by_dtype(p.dtype, [&](auto t) {
      using T = decltype(t);
      if constexpr (!std::is_same_v<T, double>) {
        auto go = [&](auto param_tag) {
          using P = decltype(param_tag);
          norm_backward_rows_kernel<T, P, 1><<<groups, threads, 0, st>>>(launched, threshold, scale);
          norm_column_sum_kernel<T, P><<<cuda::grid_for(3 * p.cols), cuda::kThreads, 0, st>>>(launched, groups);
        };
        if (sizeof(T) == 2 && p.float_params)
          go(float{});
        else
          go(T{});
      }
    });
    return cuda::launch_status("norm backward");
  }
  math::by_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    if constexpr (sizeof(T) == 2) {  // float_params: 16-bit data only (validated)
      if (p.float_params) {
        launch_norm_backward<T, float>(launched, groups, threshold, st);
        norm_column_sum_kernel<T, float><<<cuda::grid_for(3 * p.cols), cuda::kThreads, 0, st>>>(launched, groups);
        return;
      }
    }
    launch_norm_backward<T, T>(launched, groups, threshold, st);
    norm_column_sum_kernel<T, T><<<cuda::grid_for(3 * p.cols), cuda::kThreads, 0, st>>>(launched, groups);
  });
  return cuda::launch_status("norm backward");
}

}  // namespace tempo
