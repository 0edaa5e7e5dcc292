// CUDA kernels of the attention softmax: rows kept in registers with 16-byte accesses where the
// width and alignment allow (attention_forward_rows_kernel, attention_backward_rows_kernel), else one block per row
// reading the row from memory in each pass (the general kernels: fp64, widths not a multiple of
// 8 or above 8192); the same per-element math and Philox draws as the CPU kernels.
#include <cfloat>

#include <algorithm>
#include <type_traits>

#include "tempo/attention.h"
#include "../math/philox.h"
#include "../math/softmax.h"
#include "common.cuh"

namespace tempo {
namespace {

template <typename T>
__global__ void attention_forward_kernel(AttentionSoftmaxForwardParams p, uint64_t threshold, DropoutScale dscale) {
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
    const float* m =
        p.attn_mask ? p.attn_mask + b * p.mask_stride[0] + h * p.mask_stride[1] + i * p.mask_stride[2] : nullptr;
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
      for (int64_t j = threadIdx.x; j < C; j += blockDim.x) sum += math::exp_shifted<Acc>(logit(j) - mx);
    sum = cuda::block_reduce(sum, shared);
    const Acc inv = empty ? Acc(0) : Acc(1) / sum;
    // Each thread reads and then overwrites only its own elements of the row.
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const Acc pj = empty ? Acc(0) : math::exp_shifted<Acc>(logit(j) - mx) * inv;
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
__global__ void attention_backward_kernel(AttentionSoftmaxBackwardParams p, uint64_t threshold, DropoutScale dscale) {
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

// ---- rows in registers, 16-byte accesses (the fast path) ------------------------------------
// For 16/32-bit data whose rows are a multiple of 8 wide (a row then starts on a mask byte) and
// whose scores (and dropped probabilities) are 16-byte aligned: TPR threads a row (a warp, with
// 8 rows a block, up to 1024 columns; the whole block beyond, up to 8192), each thread holding
// V packs of 8 elements (pack k TPR + lane) in registers. The forward reads the scores once,
// takes the row's maximum and sum from registers, writes P and the dropped probabilities as
// 16-byte words, and draws the dropout bits itself, 8 at a time (keep_byte: the same Philox
// draws as the general kernels), writing each mask byte once in bits mode (no separate bits
// pass). The backward reads the gradient and P once and the mask byte per 8 elements. The
// per-element formulas are the general kernels'; the row sums are added in another order.
constexpr int64_t kPack = 8;

template <int TPR, bool Max = false>
__device__ __forceinline__ float row_reduce(float v, float* shared) {
  if constexpr (TPR == 32)
    return cuda::warp_reduce<Max>(v);
  else
    return cuda::block_reduce<Max>(v, shared);
}

// vec_mask: the additive mask's rows are contiguous and 16-byte aligned (read 8 floats at once).
template <typename T, int TPR, int V>
__global__ void __launch_bounds__(cuda::kThreads)
    attention_forward_rows_kernel(AttentionSoftmaxForwardParams p, uint64_t threshold, DropoutScale dscale,
                                  bool vec_mask) {
  __shared__ float shared[32];
  constexpr int kRowsPerBlock = cuda::kThreads / TPR;
  const int lane = static_cast<int>(threadIdx.x) % TPR;
  const int64_t slot = static_cast<int64_t>(threadIdx.x) / TPR;
  const PhiloxState rng = cuda::resolve(p.rng);
  const int64_t C = p.cols, packs = C / kPack, rows_total = p.rows_total(), seq_q = p.seq();
  const bool dropout = p.p > 0.0;
  const float scale = static_cast<float>(p.scale);
  const float neg_inf = -INFINITY;
  float x[V][8];
  for (int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock; r0 < rows_total;
       r0 += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int64_t r = r0 + slot;
    if (r >= rows_total) continue;  // the same for every thread of the row (a warp, or the block)
    const int64_t i = p.row_offset + r % p.rows, bh = r / p.rows, b = bh / p.heads, h = bh % p.heads;
    const float* m =
        p.attn_mask ? p.attn_mask + b * p.mask_stride[0] + h * p.mask_stride[1] + i * p.mask_stride[2] : nullptr;
    T* s = static_cast<T*>(p.scores) + r * C;
    float mx = neg_inf;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t pk = static_cast<int64_t>(k) * TPR + lane;
#pragma unroll
      for (int q = 0; q < 8; ++q) x[k][q] = neg_inf;
      if (pk >= packs) continue;
      cuda::Pack8<T> sv;
      cuda::load8v(s, pk * kPack, sv);
      cuda::Pack8<float> mv;
      if (m) {
        if (vec_mask) {
          cuda::load8v(m, pk * kPack, mv);
        } else {
#pragma unroll
          for (int q = 0; q < 8; ++q) mv.v[q] = m[(pk * kPack + q) * p.mask_stride[3]];
        }
      }
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const int64_t j = pk * kPack + q;
        float v = math::to_float(sv.v[q]) * scale;
        if (m) v += mv.v[q];
        if (p.causal && j > i) v = neg_inf;
        x[k][q] = v;
        mx = v > mx ? v : mx;
      }
    }
    mx = row_reduce<TPR, true>(mx, shared);
    const bool empty = !(mx > neg_inf);
    float sum = 0;
#pragma unroll
    for (int k = 0; k < V; ++k)
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        x[k][q] = empty ? 0.0f : math::exp_shifted<float>(x[k][q] - mx);  // the padding's -inf gives 0
        sum += x[k][q];
      }
    sum = row_reduce<TPR>(sum, shared);
    const float inv = empty ? 0.0f : 1.0f / sum;
    const int64_t row_byte = (bh * seq_q + i) * C / kPack;  // the row's first mask byte
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t pk = static_cast<int64_t>(k) * TPR + lane;
      if (pk >= packs) continue;
      cuda::Pack8<T> out, dout;
#pragma unroll
      for (int q = 0; q < 8; ++q) math::store(&out.v[q], x[k][q] * inv);
      cuda::store8v(s, pk * kPack, out);
      if (dropout) {
        const uint32_t bits = math::keep_byte(rng.seed, rng.offset, row_byte + pk, threshold);
        if (p.mask_bits) p.mask_bits[row_byte + pk] = static_cast<uint8_t>(bits);
#pragma unroll
        for (int q = 0; q < 8; ++q)
          math::store(&dout.v[q], dscale.apply(math::to_float(out.v[q]), ((bits >> q) & 1u) != 0));
        cuda::store8v(static_cast<T*>(p.dropped) + r * C, pk * kPack, dout);
      }
    }
  }
}

template <typename T, int TPR, int V>
__global__ void __launch_bounds__(cuda::kThreads)
    attention_backward_rows_kernel(AttentionSoftmaxBackwardParams p, uint64_t threshold, DropoutScale dscale) {
  __shared__ float shared[32];
  constexpr int kRowsPerBlock = cuda::kThreads / TPR;
  const int lane = static_cast<int>(threadIdx.x) % TPR;
  const int64_t slot = static_cast<int64_t>(threadIdx.x) / TPR;
  const PhiloxState rng = cuda::resolve(p.rng);
  const int64_t C = p.cols, packs = C / kPack, rows_total = p.rows_total(), seq_q = p.seq();
  const bool dropout = p.p > 0.0;
  const float scale = static_cast<float>(p.scale);
  // The row's gradient and P stay in registers as they were read (16-bit: half the registers
  // of floats), with their mask bytes; dP is formed from them in both passes.
  cuda::Pack8<T> gp[V], pp[V];
  uint32_t bits[V];
  auto dp = [dropout, dscale](const cuda::Pack8<T>& g, uint32_t b, int q) {
    const float v = math::to_float(g.v[q]);
    return dropout ? dscale.apply(v, ((b >> q) & 1u) != 0) : v;
  };
  for (int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock; r0 < rows_total;
       r0 += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int64_t r = r0 + slot;
    if (r >= rows_total) continue;
    const int64_t row_byte = ((r / p.rows) * seq_q + p.row_offset + r % p.rows) * C / kPack;
    T* g = static_cast<T*>(p.grad) + r * C;
    const T* prow = static_cast<const T*>(p.probs) + r * C;
    float dot = 0;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t pk = static_cast<int64_t>(k) * TPR + lane;
      bits[k] = 0xffu;
      if (pk >= packs) continue;
      cuda::load8v(g, pk * kPack, gp[k]);
      cuda::load8v(prow, pk * kPack, pp[k]);
      if (dropout)
        bits[k] =
            p.mask_bits ? p.mask_bits[row_byte + pk] : math::keep_byte(rng.seed, rng.offset, row_byte + pk, threshold);
#pragma unroll
      for (int q = 0; q < 8; ++q) dot += dp(gp[k], bits[k], q) * math::to_float(pp[k].v[q]);
    }
    dot = row_reduce<TPR>(dot, shared);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t pk = static_cast<int64_t>(k) * TPR + lane;
      if (pk >= packs) continue;
      cuda::Pack8<T> out;
#pragma unroll
      for (int q = 0; q < 8; ++q)
        math::store(&out.v[q], scale * math::to_float(pp[k].v[q]) * (dp(gp[k], bits[k], q) - dot));
      cuda::store8v(g, pk * kPack, out);
    }
  }
}

// Launches the fast kernels where they apply (see above); false where the general ones run.
template <typename T, typename Launch>
bool launch_rows(int64_t cols, int64_t rows_total, Launch launch) {
  if constexpr (sizeof(T) > 4) {
    return false;
  } else {
    if (cols % kPack != 0 || cols > 8192) return false;
    auto grid = [&](int rows_per_block) { return cuda::row_grid((rows_total + rows_per_block - 1) / rows_per_block); };
    constexpr int W = 32, B = cuda::kThreads, RW = cuda::kThreads / 32;
    if (cols <= 8 * W)
      launch(std::integral_constant<int, W>{}, std::integral_constant<int, 1>{}, grid(RW));
    else if (cols <= 16 * W)
      launch(std::integral_constant<int, W>{}, std::integral_constant<int, 2>{}, grid(RW));
    else if (cols <= 32 * W)
      launch(std::integral_constant<int, W>{}, std::integral_constant<int, 4>{}, grid(RW));
    else if (cols <= 8 * B)
      launch(std::integral_constant<int, B>{}, std::integral_constant<int, 1>{}, grid(1));
    else if (cols <= 16 * B)
      launch(std::integral_constant<int, B>{}, std::integral_constant<int, 2>{}, grid(1));
    else
      launch(std::integral_constant<int, B>{}, std::integral_constant<int, 4>{}, grid(1));
    return true;
  }
}

}  // namespace

Status attention_softmax_forward_cuda(const AttentionSoftmaxForwardParams& p, void* stream) {
  Status s = detail::validate(p);
  const int64_t rows_total = p.rows_total();
  if (!s.ok() || rows_total * p.cols == 0) return s;
  auto st = static_cast<cudaStream_t>(stream);
  const uint64_t threshold = math::keep_threshold(p.p);
  const DropoutScale dscale(p.p);
  const bool aligned = cuda::aligned16(p.scores) && (p.p == 0.0 || cuda::aligned16(p.dropped));
  const bool vec_mask = p.attn_mask && p.mask_stride[3] == 1 && cuda::aligned16(p.attn_mask) &&
                        p.mask_stride[0] % 4 == 0 && p.mask_stride[1] % 4 == 0 && p.mask_stride[2] % 4 == 0;
  math::by_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    if (aligned && launch_rows<T>(p.cols, rows_total, [&](auto tpr, auto v, int grid) {
          attention_forward_rows_kernel<T, decltype(tpr)::value, decltype(v)::value>
              <<<grid, cuda::kThreads, 0, st>>>(p, threshold, dscale, vec_mask);
        }))
      return;
    if (p.p > 0.0 && p.mask_bits)
      cuda::keep_bits_kernel<<<cuda::grid_for(bit_mask_bytes(rows_total * p.cols)), cuda::kThreads, 0, st>>>(
          p.rng, p.mask_bits, rows_total * p.cols, threshold);
    attention_forward_kernel<T><<<cuda::row_grid(rows_total), cuda::kThreads, 0, st>>>(p, threshold, dscale);
  });
  return cuda::launch_status("attention softmax forward");
}

Status attention_softmax_backward_cuda(const AttentionSoftmaxBackwardParams& p, void* stream) {
  Status s = detail::validate(p);
  if (!s.ok() || p.rows_total() * p.cols == 0) return s;
  auto st = static_cast<cudaStream_t>(stream);
  const uint64_t threshold = math::keep_threshold(p.p);
  const DropoutScale dscale(p.p);
  const bool aligned = cuda::aligned16(p.grad) && cuda::aligned16(p.probs);
  math::by_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    if (aligned && launch_rows<T>(p.cols, p.rows_total(), [&](auto tpr, auto v, int grid) {
          attention_backward_rows_kernel<T, decltype(tpr)::value, decltype(v)::value>
              <<<grid, cuda::kThreads, 0, st>>>(p, threshold, dscale);
        }))
      return;
    attention_backward_kernel<T><<<cuda::row_grid(p.rows_total()), cuda::kThreads, 0, st>>>(p, threshold, dscale);
  });
  return cuda::launch_status("attention softmax backward");
}

}  // namespace tempo
