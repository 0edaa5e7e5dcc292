// CUDA kernels of the attention softmax: one block per row (grid-stride over rows), block
// reductions, the same per-element math and Philox draws as the CPU kernels.
#include <cfloat>

#include <algorithm>

#include "tempo/attention.h"
#include "../math/philox.h"
#include "../math/softmax.h"
#include "common.cuh"

namespace tempo {
namespace {

template <typename Acc>
__device__ Acc exp_np(Acc x) {
  if constexpr (sizeof(Acc) == 8) {
    return exp(x);
  } else {
    return math::exp_nonpositive(x);
  }
}

template <typename T>
__global__ void forward_kernel(AttentionSoftmaxForwardParams p, uint64_t threshold, DropoutScale dscale) {
  using Acc = math::acc_t<T>;
  __shared__ Acc shared[32];
  const PhiloxState rng = cuda::resolve(p.rng);
  const int64_t C = p.cols, rows_total = p.rows_total();
  const Acc scale = static_cast<Acc>(p.scale);
  const Acc neg_inf = -static_cast<Acc>(INFINITY);
  T* scores = static_cast<T*>(p.scores);
  const int64_t seq_q = p.seq();
  for (int64_t r = blockIdx.x; r < rows_total; r += gridDim.x) {
    const int64_t i = p.row_offset + r % p.rows, bh = r / p.rows, b = bh / p.heads, h = bh % p.heads;
    const int64_t e_row = (bh * seq_q + i) * C;  // dropout element index of the row's first entry
    const float* m = p.attn_mask ? p.attn_mask + b * p.mask_stride[0] + h * p.mask_stride[1] + i * p.mask_stride[2]
                                 : nullptr;
    T* s = scores + r * C;
    auto logit = [&](int64_t j) {
      if (p.causal && j > i) return neg_inf;
      Acc v = math::to_float(s[j]) * scale;
      if (m) v += static_cast<Acc>(m[j * p.mask_stride[3]]);
      return v;
    };
    Acc mx = neg_inf;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const Acc v = logit(j);
      mx = v > mx ? v : mx;
    }
    mx = cuda::block_reduce<true>(mx, shared);
    const bool empty = !(mx > neg_inf);
    Acc sum = 0;
    if (!empty)
      for (int64_t j = threadIdx.x; j < C; j += blockDim.x) sum += exp_np<Acc>(logit(j) - mx);
    sum = cuda::block_reduce(sum, shared);
    const Acc inv = empty ? Acc(0) : Acc(1) / sum;
    // Each thread reads and then overwrites only its own elements of the row.
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const Acc pj = empty ? Acc(0) : exp_np<Acc>(logit(j) - mx) * inv;
      math::store(s + j, pj);
      if (p.p > 0.0) {
        const Acc stored = math::round_to_acc<T>(pj);
        math::store(static_cast<T*>(p.dropped) + r * C + j,
                    dscale.apply(stored, cuda::keep_bit(p.mask_bits, rng, threshold, e_row + j)));
      }
    }
  }
}

template <typename T>
__global__ void backward_kernel(AttentionSoftmaxBackwardParams p, uint64_t threshold, DropoutScale dscale) {
  using Acc = math::acc_t<T>;
  __shared__ Acc shared[32];
  const PhiloxState rng = cuda::resolve(p.rng);
  const int64_t C = p.cols;
  const Acc scale = static_cast<Acc>(p.scale);
  const int64_t rows = p.rows, seq_q = p.seq(), rows_total = p.rows_total();
  for (int64_t r = blockIdx.x; r < rows_total; r += gridDim.x) {
    const int64_t e_row = ((r / rows) * seq_q + p.row_offset + r % rows) * C;
    T* g = static_cast<T*>(p.grad) + r * C;
    const T* pr = static_cast<const T*>(p.probs) + r * C;
    auto dp = [&](int64_t j) {
      const Acc v = math::to_float(g[j]);
      return p.p > 0.0 ? dscale.apply(v, cuda::keep_bit(p.mask_bits, rng, threshold, e_row + j)) : v;
    };
    Acc dot = 0;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) dot += dp(j) * math::to_float(pr[j]);
    dot = cuda::block_reduce(dot, shared);
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const Acc v = scale * math::to_float(pr[j]) * (dp(j) - dot);
      math::store(g + j, v);
    }
  }
}

// ---- the q/k/v split (aib) ----------------------------------------------------------------

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
  math::by_dtype(p.dtype, [&](auto t) {
    qkv_split_forward_kernel<decltype(t)><<<cuda::grid_for(p.numel()), cuda::kThreads, 0, st>>>(p);
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
      cuda::column_group_sums_kernel<T><<<tiles, cuda::kThreads, 0, st>>>(parts, tokens > 0 ? groups : 1, M,
                                                                         static_cast<T*>(p.grad_bias));
    }
  });
  return cuda::launch_status("qkv split backward");
}

Status attention_softmax_forward_cuda(const AttentionSoftmaxForwardParams& p, void* stream) {
  Status s = detail::validate(p);
  const int64_t rows_total = p.rows_total();
  if (!s.ok() || rows_total * p.cols == 0) return s;
  auto st = static_cast<cudaStream_t>(stream);
  const uint64_t threshold = math::keep_threshold(p.p);
  if (p.p > 0.0 && p.mask_bits)
    cuda::keep_bits_kernel<<<cuda::grid_for(bit_mask_bytes(rows_total * p.cols)), cuda::kThreads, 0, st>>>(
        p.rng, p.mask_bits, rows_total * p.cols, threshold);
  math::by_dtype(p.dtype, [&](auto t) {
    forward_kernel<decltype(t)><<<cuda::row_grid(rows_total), cuda::kThreads, 0, st>>>(p, threshold, DropoutScale(p.p));
  });
  return cuda::launch_status("attention softmax forward");
}

Status attention_softmax_backward_cuda(const AttentionSoftmaxBackwardParams& p, void* stream) {
  Status s = detail::validate(p);
  if (!s.ok() || p.rows_total() * p.cols == 0) return s;
  auto st = static_cast<cudaStream_t>(stream);
  math::by_dtype(p.dtype, [&](auto t) {
    backward_kernel<decltype(t)><<<cuda::row_grid(p.rows_total()), cuda::kThreads, 0, st>>>(p, math::keep_threshold(p.p),
                                                                                    DropoutScale(p.p));
  });
  return cuda::launch_status("attention softmax backward");
}

}  // namespace tempo
