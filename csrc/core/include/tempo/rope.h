// Rotary position embedding (RoPE) in one pass: out = x cos + rotate_half(x) sin.
#pragma once

#include "tempo/common.h"

namespace tempo {

// x is [batch, heads, seq, head_dim] with any strides but a contiguous last dimension (a
// transposed q or k of a [batch, seq, heads, head_dim] projection reads in place); cos and sin
// are [table_batch, seq, rotary_dim] contiguous, table_batch 1 (shared by the batch) or batch.
// The first rotary_dim columns of each row rotate in pairs (j, j + rotary_dim / 2), the rest
// pass through: with h = rotary_dim / 2, a = x[j], b = x[j + h] and j < h,
//   out[j]     = a cos[j]     - b sin[j]
//   out[j + h] = b cos[j + h] + a sin[j + h]
// (x cos + rotate_half(x) sin, rotate_half(x) = [-x[h:], x[:h]]), each in the math type (fp32,
// fp64 for fp64 data) with one rounding to the output. The backward is the transpose, in the
// same pass over the incoming gradient (g_a = g[j], g_b = g[j + h]):
//   dx[j]     = g_a cos[j]     + g_b sin[j + h]
//   dx[j + h] = g_b cos[j + h] - g_a sin[j]
// The rotation keeps nothing of x: the backward reads only the gradient and the tables.
// out (dx) is [batch, heads, seq, head_dim] with strides of its own (the caller's choice: x's
// layout, as torch's elementwise ops keep it) and a contiguous last dimension.
struct RopeParams {
  DType dtype = DType::kFloat32;        // x's and out's
  DType table_dtype = DType::kFloat32;  // cos's and sin's: dtype, or float32 for 16-bit data
  int64_t batch = 0, heads = 0, seq = 0, head_dim = 0, rotary_dim = 0;
  int64_t table_batch = 1;
  int64_t x_stride_batch = 0, x_stride_head = 0, x_stride_seq = 0;        // elements
  int64_t out_stride_batch = 0, out_stride_head = 0, out_stride_seq = 0;  // elements
  const void* x = nullptr;  // x (forward) or the gradient of out (backward)
  const void* cos = nullptr;
  const void* sin = nullptr;
  void* out = nullptr;  // out (forward) or dx (backward)
  TEMPO_HD int64_t rows() const { return batch * heads * seq; }
  TEMPO_HD int64_t numel() const { return rows() * head_dim; }
};

Status rope_forward_cpu(const RopeParams& p);
Status rope_backward_cpu(const RopeParams& p);
Status rope_forward_cuda(const RopeParams& p, void* stream);
Status rope_backward_cuda(const RopeParams& p, void* stream);

namespace detail {
Status validate(const RopeParams& p);
}  // namespace detail

}  // namespace tempo
