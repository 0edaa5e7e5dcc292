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
__device__ Acc block_reduce(Acc v, Acc* shared, bool is_max) {
  for (int o = 16; o > 0; o >>= 1) {
    const Acc w = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? (w > v ? w : v) : v + w;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  Acc total = shared[0];
  for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w)
    total = is_max ? (shared[w] > total ? shared[w] : total) : total + shared[w];
  return total;
}

template <typename Acc>
__device__ Acc exp_np(Acc x) {
  if constexpr (sizeof(Acc) == 8) {
    return exp(x);
  } else {
    return math::exp_nonpositive(x);
  }
}

__device__ bool keep_of(const uint8_t* bits, const PhiloxState& rng, uint64_t threshold, int64_t e) {
  if (bits) return ((bits[e >> 3] >> (e & 7)) & 1u) != 0;
  const math::Philox4 r = math::philox_group(rng.seed, rng.offset, static_cast<uint64_t>(e >> 2));
  return static_cast<uint64_t>(r.v[e & 3]) < threshold;
}


template <typename T>
__global__ void forward_kernel(AttentionSoftmaxForwardParams p, uint64_t threshold, DropoutScale dscale) {
  using Acc = math::acc_t<T>;
  __shared__ Acc shared[32];
  const PhiloxState rng = cuda::resolve(p.rng);
  const int64_t C = p.cols, rows_total = p.batch * p.heads * p.rows;
  const Acc scale = static_cast<Acc>(p.scale);
  const Acc neg_inf = -static_cast<Acc>(INFINITY);
  T* scores = static_cast<T*>(p.scores);
  const int64_t seq_q = p.seq_q > 0 ? p.seq_q : p.rows;
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
    mx = block_reduce(mx, shared, true);
    const bool empty = !(mx > neg_inf);
    Acc sum = 0;
    if (!empty)
      for (int64_t j = threadIdx.x; j < C; j += blockDim.x) sum += exp_np<Acc>(logit(j) - mx);
    sum = block_reduce(sum, shared, false);
    const Acc inv = empty ? Acc(0) : Acc(1) / sum;
    // Each thread reads and then overwrites only its own elements of the row.
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const Acc pj = empty ? Acc(0) : exp_np<Acc>(logit(j) - mx) * inv;
      math::store(s + j, pj);
      if (p.p > 0.0) {
        const Acc stored = math::round_to_acc<T>(pj);
        math::store(static_cast<T*>(p.dropped) + r * C + j,
                    dscale.apply(stored, keep_of(p.mask_bits, rng, threshold, e_row + j)));
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
  const int64_t rows = p.rows > 0 ? p.rows : p.rows_total;
  const int64_t seq_q = p.seq_q > 0 ? p.seq_q : rows;
  for (int64_t r = blockIdx.x; r < p.rows_total; r += gridDim.x) {
    const int64_t e_row = ((r / rows) * seq_q + p.row_offset + r % rows) * C;
    T* g = static_cast<T*>(p.grad) + r * C;
    const T* pr = static_cast<const T*>(p.probs) + r * C;
    auto dp = [&](int64_t j) {
      const Acc v = math::to_float(g[j]);
      return p.p > 0.0 ? dscale.apply(v, keep_of(p.mask_bits, rng, threshold, e_row + j)) : v;
    };
    Acc dot = 0;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) dot += dp(j) * math::to_float(pr[j]);
    dot = block_reduce(dot, shared, false);
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const Acc v = scale * math::to_float(pr[j]) * (dp(j) - dot);
      math::store(g + j, v);
    }
  }
}

int row_grid(int64_t rows) { return static_cast<int>(rows < 65535 ? (rows > 0 ? rows : 1) : 65535); }

}  // namespace

Status attention_softmax_forward_cuda(const AttentionSoftmaxForwardParams& p, void* stream) {
  Status s = detail::validate(p);
  const int64_t rows_total = p.batch * p.heads * p.rows;
  if (!s.ok() || rows_total * p.cols == 0) return s;
  auto st = static_cast<cudaStream_t>(stream);
  const uint64_t threshold = math::keep_threshold(p.p);
  if (p.p > 0.0 && p.mask_bits)
    cuda::keep_bits_kernel<<<cuda::grid_for(dropout_mask_bytes(rows_total * p.cols)), cuda::kThreads, 0, st>>>(
        p.rng, p.mask_bits, rows_total * p.cols, threshold);
  cuda::by_dtype(p.dtype, [&](auto t) {
    forward_kernel<decltype(t)><<<row_grid(rows_total), cuda::kThreads, 0, st>>>(p, threshold, DropoutScale(p.p));
  });
  return cuda::launch_status("attention softmax forward");
}

Status attention_softmax_backward_cuda(const AttentionSoftmaxBackwardParams& p, void* stream) {
  Status s = detail::validate(p);
  if (!s.ok() || p.rows_total * p.cols == 0) return s;
  auto st = static_cast<cudaStream_t>(stream);
  cuda::by_dtype(p.dtype, [&](auto t) {
    backward_kernel<decltype(t)><<<row_grid(p.rows_total), cuda::kThreads, 0, st>>>(p, math::keep_threshold(p.p),
                                                                                    DropoutScale(p.p));
  });
  return cuda::launch_status("attention softmax backward");
}

}  // namespace tempo
