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
