// CUDA kernels of the attention softmax: one block per row (grid-stride over rows), block
// reductions, the same per-element math and Philox draws as the CPU kernels.
#include <cfloat>

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

}  // namespace

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
