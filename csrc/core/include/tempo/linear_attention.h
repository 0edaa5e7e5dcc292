// Causal linear attention over one chunk of a sequence, with carried prefix-sum states (SLiM;
// docs/slim.md, docs/accuracy.md). Per row (a batch x head pair), with
// feature-mapped queries q_l, keys k_l (M values each, non-negative) and values v_l (D):
//   S_l = num_in + sum_{i<=l} k_i v_i^T   (M x D),   z_l = den_in + sum_{i<=l} k_i   (M)
//   y_l = S_l^T q_l / (z_l . q_l + eps)
// and the state after the chunk, (S_len, z_len), goes to the next chunk. The kernels walk the
// chunk one position at a time keeping only the running sums (never the len x M x D tensor);
// the backward rebuilds each S_l by subtracting from the total, which it first sums again from
// num_in (in double on the CPU), and returns the gradients of q, k, v and of the state in.
#pragma once

#include "tempo/common.h"

namespace tempo {

// Tensors are contiguous: q, k [rows, len, m]; v, y [rows, len, d]; num [rows, m, d];
// den [rows, m]. Data in `dtype`; the states in its state type (linear_attention_state_dtype).
// What the forward and the backward both read:
struct LinearAttentionInputs {
  DType dtype = DType::kFloat32;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* num_in = nullptr;  // the state before the chunk; null: zeros (the first chunk)
  const void* den_in = nullptr;  // null: zeros
  int64_t rows = 0, len = 0, m = 0, d = 0;
  double eps = 1e-6;          // added to every denominator
  void* workspace = nullptr;  // CUDA: linear_attention_workspace_bytes (the running sums); CPU: unused
};

struct LinearAttentionForwardParams : LinearAttentionInputs {
  void* y = nullptr;        // out
  void* num_out = nullptr;  // out: the state after the chunk
  void* den_out = nullptr;  // out
};

struct LinearAttentionBackwardParams : LinearAttentionInputs {
  const void* grad_y = nullptr;        // [rows, len, d]
  const void* grad_num_out = nullptr;  // null: zeros
  const void* grad_den_out = nullptr;  // null: zeros
  void* grad_q = nullptr;              // out, data dtype
  void* grad_k = nullptr;
  void* grad_v = nullptr;
  void* grad_num_in = nullptr;  // out, state type
  void* grad_den_in = nullptr;
};

// The states' element type: float64 for float64 data, float32 otherwise.
inline DType linear_attention_state_dtype(DType data) {
  return data == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
}

// Scratch the CUDA kernels need for their double running sums: S (forward), S and its
// gradient (backward), rows x m x d doubles each. The CPU kernels keep them per thread.
inline int64_t linear_attention_workspace_bytes(int64_t rows, int64_t m, int64_t d, bool backward) {
  return (backward ? 2 : 1) * rows * m * d * static_cast<int64_t>(sizeof(double));
}

Status linear_attention_forward_cpu(const LinearAttentionForwardParams& p);
Status linear_attention_backward_cpu(const LinearAttentionBackwardParams& p);
Status linear_attention_forward_cuda(const LinearAttentionForwardParams& p, void* stream);
Status linear_attention_backward_cuda(const LinearAttentionBackwardParams& p, void* stream);

namespace detail {
Status validate(const LinearAttentionForwardParams& p);
Status validate(const LinearAttentionBackwardParams& p);
}  // namespace detail

}  // namespace tempo
