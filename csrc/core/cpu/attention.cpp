// CPU kernels of the attention softmax: chunks of rows (whole mask bytes) over OpenMP
// threads; each row in fp32 (fp64 for fp64 data) with vectorisable loops.
#include "tempo/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../math/numeric.h"
#include "../math/softmax.h"
#include "dispatch.h"
#include "dropout_bits.h"

namespace tempo {
namespace {

using math::bf16_t;
using math::fp16_t;

template <typename T>
void forward_chunk(const AttentionSoftmaxForwardParams& p, int64_t r0, int64_t r1, std::vector<math::acc_t<T>>& x,
                   std::vector<uint8_t>& keep, std::vector<uint8_t>& local) {
  using Acc = math::acc_t<T>;
  const int64_t C = p.cols;
  T* scores = static_cast<T*>(p.scores);
  T* dropped = static_cast<T*>(p.dropped);
  const bool dropout = p.p > 0.0;
  const bool block = p.block();
  const int64_t seq_q = p.seq();
  const uint8_t* bits =
      dropout && !block ? cpu::draw_chunk_bits(p.rng, p.p, p.mask_bits, r0 * C, r1 * C, local) : nullptr;
  const uint64_t threshold = math::keep_threshold(p.p);
  const DropoutScale dscale(p.p);
  const Acc scale = static_cast<Acc>(p.scale);
  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
  x.resize(static_cast<size_t>(C));
  keep.resize(static_cast<size_t>(C));
  Acc* xr = x.data();
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = p.row_offset + r % p.rows;  // the absolute query row
    const int64_t bh = r / p.rows;
    const int64_t b = bh / p.heads, h = bh % p.heads;
    T* s = scores + r * C;
    if (p.attn_mask) {
      const float* m = p.attn_mask + b * p.mask_stride[0] + h * p.mask_stride[1] + i * p.mask_stride[2];
      const int64_t ms = p.mask_stride[3];
#pragma omp simd
      for (int64_t j = 0; j < C; ++j) xr[j] = math::to_float(s[j]) * scale + static_cast<Acc>(m[j * ms]);
    } else {
#pragma omp simd
      for (int64_t j = 0; j < C; ++j) xr[j] = math::to_float(s[j]) * scale;
    }
    if (p.causal)
      for (int64_t j = i + 1; j < C; ++j) xr[j] = neg_inf;
    Acc mx = neg_inf;
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < C; ++j) mx = std::max(mx, xr[j]);
    if (!(mx > neg_inf) && !(mx != mx)) {  // every logit masked: P = 0
      for (int64_t j = 0; j < C; ++j) math::store(s + j, Acc(0));
      if (dropout)
        for (int64_t j = 0; j < C; ++j) math::store(dropped + r * C + j, Acc(0));
      continue;
    }
    Acc sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < C; ++j) {
      xr[j] = math::exp_shifted<Acc>(xr[j] - mx);
      sum += xr[j];
    }
    const Acc inv = Acc(1) / sum;
#pragma omp simd
    for (int64_t j = 0; j < C; ++j) math::store(s + j, xr[j] * inv);
    if (dropout) {
      if (block)
        cpu::keep_flags(p.rng, threshold, (bh * seq_q + i) * C, C, keep.data());
      else
        cpu::expand_keep(bits, (r - r0) * C, C, keep.data());
      const uint8_t* k = keep.data();
      T* d = dropped + r * C;
#pragma omp simd
      for (int64_t j = 0; j < C; ++j) math::store(d + j, dscale.apply(math::to_float(s[j]), k[j] != 0));
    }
  }
}

template <typename T>
void backward_chunk(const AttentionSoftmaxBackwardParams& p, int64_t r0, int64_t r1, std::vector<math::acc_t<T>>& x,
                    std::vector<uint8_t>& keep, std::vector<uint8_t>& local) {
  using Acc = math::acc_t<T>;
  const int64_t C = p.cols;
  T* grad = static_cast<T*>(p.grad);
  const T* probs = static_cast<const T*>(p.probs);
  const bool dropout = p.p > 0.0;
  const bool block = p.block();
  const uint64_t threshold = math::keep_threshold(p.p);
  const uint8_t* bits = nullptr;
  if (dropout && !block) {
    bits = p.mask_bits ? p.mask_bits + r0 * C / 8 : cpu::draw_chunk_bits(p.rng, p.p, nullptr, r0 * C, r1 * C, local);
  }
  const DropoutScale dscale(p.p);
  const Acc scale = static_cast<Acc>(p.scale);
  x.resize(static_cast<size_t>(C));
  keep.resize(static_cast<size_t>(C));
  Acc* dp = x.data();
  for (int64_t r = r0; r < r1; ++r) {
    T* g = grad + r * C;
    const T* pr = probs + r * C;
    if (dropout) {
      if (block) {
        const int64_t i = p.row_offset + r % p.rows, bh = r / p.rows;
        cpu::keep_flags(p.rng, threshold, (bh * p.seq_q + i) * C, C, keep.data());
      } else {
        cpu::expand_keep(bits, (r - r0) * C, C, keep.data());
      }
      const uint8_t* k = keep.data();
#pragma omp simd
      for (int64_t j = 0; j < C; ++j) dp[j] = dscale.apply(math::to_float(g[j]), k[j] != 0);
    } else {
#pragma omp simd
      for (int64_t j = 0; j < C; ++j) dp[j] = math::to_float(g[j]);
    }
    Acc dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < C; ++j) dot += dp[j] * math::to_float(pr[j]);
#pragma omp simd
    for (int64_t j = 0; j < C; ++j) {
      const Acc pj = math::to_float(pr[j]);
      math::store(g + j, scale * pj * (dp[j] - dot));
    }
  }
}

template <typename P, typename Chunk>
void run_chunks(const P& p, int64_t rows_total, Chunk chunk) {
  const int64_t rows = cpu::mask_chunk_rows(rows_total, p.cols);
  const int64_t n = (rows_total + rows - 1) / rows;
#pragma omp parallel if (rows_total * p.cols >= cpu::kParallelMinElems && n > 1)
  {
    std::vector<double> xd;
    std::vector<float> xf;
    std::vector<uint8_t> keep, local;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < n; ++c) chunk(c * rows, std::min(rows_total, (c + 1) * rows), xf, xd, keep, local);
  }
}

}  // namespace

Status attention_softmax_forward_cpu(const AttentionSoftmaxForwardParams& p) {
  Status s = detail::validate(p);
  const int64_t rows_total = p.rows_total();
  if (!s.ok() || rows_total * p.cols == 0) return s;
  math::by_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    run_chunks(p, rows_total, [&](int64_t r0, int64_t r1, auto& xf, auto& xd, auto& keep, auto& local) {
      if constexpr (std::is_same_v<T, double>)
        forward_chunk<T>(p, r0, r1, xd, keep, local);
      else
        forward_chunk<T>(p, r0, r1, xf, keep, local);
    });
  });
  return Status::Ok();
}

Status attention_softmax_backward_cpu(const AttentionSoftmaxBackwardParams& p) {
  Status s = detail::validate(p);
  if (!s.ok() || p.rows_total() * p.cols == 0) return s;
  math::by_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    run_chunks(p, p.rows_total(), [&](int64_t r0, int64_t r1, auto& xf, auto& xd, auto& keep, auto& local) {
      if constexpr (std::is_same_v<T, double>)
        backward_chunk<T>(p, r0, r1, xd, keep, local);
      else
        backward_chunk<T>(p, r0, r1, xf, keep, local);
    });
  });
  return Status::Ok();
}

}  // namespace tempo
